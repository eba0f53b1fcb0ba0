import pytest
import torch

from kernel_util import DEVICE, TOL, WEIRD, rel_err  # noqa: I001
from quanta.kernels import activation


@pytest.mark.parametrize("rows", [1, 3, 73])
@pytest.mark.parametrize("i", list(WEIRD[:3]) + [1024, 1500])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
def test_silu_and_mul(rows, i, dtype):
    x = torch.randn(rows, 2 * i).to(DEVICE, dtype) * 3
    assert rel_err(activation.silu_and_mul(x), activation.reference(x)) < TOL[dtype]
