"""RMSNorm (+ residual), rotary and SiLU-and-mul kernels against their torch references."""
import pytest
import torch

from kernel_util import DEVICE, TOL, bf16_rounds_to_nearest, rel_err  # noqa: I001
from quanta.kernels import fused_norm


@pytest.mark.parametrize("rows,d", [(1, 64), (3, 423), (73, 213), (5, 4096)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
def test_rms_norm(rows, d, residual, dtype):
    x = torch.randn(rows, d).to(DEVICE, dtype)
    r = torch.randn(rows, d).to(DEVICE, dtype) if residual else None
    w = (torch.rand(d) + 0.5).to(DEVICE, dtype)
    got, want = fused_norm.rms_norm(x, w, 1e-5, r), fused_norm.reference(x, w, 1e-5, r)
    if residual:
        if dtype != torch.bfloat16 or bf16_rounds_to_nearest():
            assert torch.equal(got[1], want[1])
        assert rel_err(got[1], want[1]) < TOL[dtype] / 2
        got, want = got[0], want[0]
    assert rel_err(got, want) < TOL[dtype] / 2


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("d", [423, 4096])
def test_rms_norm_in_order_puts_feature_order_k_in_column_k(residual, d):
    """With `order` (a permutation), the kernel's row is its plain row with column k holding feature order[k],
    bit for bit (the same arithmetic, only the row is permuted), as the reference does; the residual stream is
    not permuted."""
    rows = 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g).to(DEVICE, torch.float16)
    r = torch.randn(rows, d, generator=g).to(DEVICE, torch.float16) if residual else None
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE, torch.float16)
    order = torch.randperm(d, generator=g).to(DEVICE, torch.int32)
    plain, ordered = fused_norm.rms_norm(x, w, 1e-5, r), fused_norm.rms_norm(x, w, 1e-5, r, order)
    ref, ref_plain = fused_norm.reference(x, w, 1e-5, r, order), fused_norm.reference(x, w, 1e-5, r)
    if residual:
        assert torch.equal(ordered[1], plain[1]) and torch.equal(ref[1], x + r)
        plain, ordered, ref, ref_plain = plain[0], ordered[0], ref[0], ref_plain[0]
    assert torch.equal(ordered, plain[:, order.long()])
    assert torch.equal(ref, ref_plain[:, order.long()])
    assert rel_err(ordered, ref) < TOL[torch.float16] / 2


@pytest.mark.gpu
def test_gpu_rms_norm_llama():
    x, r = torch.randn(2, 512, 8192, device="cuda", dtype=torch.bfloat16).unbind(0)
    w = torch.rand(8192, device="cuda", dtype=torch.bfloat16)
    y, h = fused_norm.rms_norm(x, w, 1e-5, r)
    y_ref, h_ref = fused_norm.reference(x, w, 1e-5, r)
    assert torch.equal(h, h_ref) and rel_err(y, y_ref) < TOL[torch.bfloat16] / 2
    # a row of 8192 permuted across 16 warps (tl.gather through shared memory) on the GPU's lowering
    order = torch.randperm(8192, device="cuda").to(torch.int32)
    y_ordered, h_ordered = fused_norm.rms_norm(x, w, 1e-5, r, order)
    assert torch.equal(y_ordered, y[:, order.long()]) and torch.equal(h_ordered, h)
