import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001
from quanta.kernels import rotary


@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 64), (7, 3, 1, 128), (5, 32, 8, 128), (2, 5, 5, 96)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
def test_rotary(t, hq, hk, d, dtype):
    q = torch.randn(t, hq, d).to(DEVICE, dtype)
    k = torch.randn(t, hk, d).to(DEVICE, dtype)
    pos = torch.randint(0, 8192, (t,)).to(DEVICE)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)
    for got, want in zip(rotary.rotary(q, k, pos, inv_freq), rotary.reference(q, k, pos, inv_freq)):
        assert got.shape == want.shape and rel_err(got, want) < TOL[dtype] if dtype != torch.float32 \
            else rel_err(got, want) < 1e-4      # fp32: libdevice vs torch sin/cos of angles up to 8192
