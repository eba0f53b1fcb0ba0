"""The FP8 GEMV at one row: the checkpoint's e4m3 bytes [N, K] times fp16/bf16 activations, against float64 torch
(the interpreter on the CPU; the hardware conversion with -m gpu), and fp8_gemm's routing of one row to it."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001
from quanta.kernels import fp8_gemm, fp8_gemv
from test_fp8_gemm import make_fp8


def reference(x, w, bias=None):
    y = x.double() @ w.dequantize().double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("n,k", [(48, 512), (40, 1000), (64, 4096), (17, 100)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gemv_matches_the_float64_product(n, k, dtype):
    w = make_fp8(n, k, "e4m3", "channel", seed=n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    for b in (None, bias):
        y = fp8_gemv.matmul(x, w.data, w.scale.float(), b, hw_fp8=False)
        assert y.dtype == dtype and y.shape == (1, n)
        assert rel_err(y, reference(x, w, b)) < TOL[dtype]         # the output's rounding, no activation rounding


def test_split_k_partials_add_up_and_leave_the_workspace_clean():
    n, k = 32, 8192
    w = make_fp8(n, k, "e4m3", "channel", seed=3)
    x = torch.randn(1, k, dtype=torch.float16).to(DEVICE)
    one = fp8_gemv.matmul(x, w.data, w.scale.float(), config=(16, 512, 4, 0.0, 1), hw_fp8=False)   # no split
    many = fp8_gemv.matmul(x, w.data, w.scale.float(), config=(16, 512, 4, 64.0, 2), hw_fp8=False)  # 8 splits
    again = fp8_gemv.matmul(x, w.data, w.scale.float(), config=(16, 512, 4, 64.0, 2), hw_fp8=False)
    assert rel_err(one, reference(x, w)) < 4e-3 and rel_err(many, reference(x, w)) < 4e-3
    assert torch.equal(many, again)                                  # a stale workspace would add the last call's
    ws, locks = fp8_gemv.workspace(x.device, n, 1)
    assert not ws.any() and not locks.any()


def test_one_row_of_a_w8a8_weight_takes_the_gemv():
    w = make_fp8(64, 256, "e4m3", "channel", seed=1)
    st = fp8_gemm.W8A8State(w.data.t(), w.scale.float().reshape(1, -1), 64, 256, torch.float16)
    x = torch.randn(1, 256, dtype=torch.float16).to(DEVICE)
    assert rel_err(fp8_gemm.apply(x, st), reference(x, w)) < 4e-3
    assert fp8_gemm.path(st, 1)[0] == "triton_fp8/gemv" and "bandwidth-bound" in fp8_gemm.path(st, 1)[1]
    assert fp8_gemm.path(st, 2)[0] == "triton_fp8/w8a8"


def test_a_split_that_would_be_empty_is_never_launched():
    # K of 3 steps with min_steps 1 and many waves: every split must hold at least one step
    w = make_fp8(16, 1536, "e4m3", "channel", seed=4)
    x = torch.randn(1, 1536, dtype=torch.float16).to(DEVICE)
    y = fp8_gemv.matmul(x, w.data, w.scale.float(), config=(16, 512, 4, 1000.0, 1), hw_fp8=False)
    assert rel_err(y, reference(x, w)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_gpu_hardware_conversion_equals_the_integer_one(n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the hardware e4m3 conversion needs sm89+")
    w = make_fp8(n, k, "e4m3", "channel", device="cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    hw = fp8_gemv.matmul(x, w.data, w.scale.float(), hw_fp8=True)
    assert rel_err(hw, reference(x, w)) < 4e-3
    assert rel_err(fp8_gemv.matmul(x, w.data, w.scale.float(), hw_fp8=False), hw) < 1e-3
    st = fp8_gemm.prepare(w, "cuda", torch.float16)
    assert isinstance(st, fp8_gemm.W8A8State) and fp8_gemm.path(st, 1)[0] == "triton_fp8/gemv"
    assert torch.equal(fp8_gemm.apply(x, st), hw)
    from quanta.kernels import activation
    assert rel_err(fp8_gemm.apply_glu(x, st), activation.silu_and_mul(hw)) < 2e-3


@pytest.mark.parametrize("config", [None, (16, 256, 4, 64.0, 1)], ids=["default", "split-k"])
def test_glu_epilogue_equals_the_gemv_then_silu_and_mul(config):
    from quanta.kernels import activation
    n, k = 96, 1024
    w = make_fp8(n, k, "e4m3", "channel", seed=5)
    x = torch.randn(1, k, dtype=torch.float16).to(DEVICE)
    y = fp8_gemv.matmul(x, w.data, w.scale.float(), None, config, hw_fp8=False)
    fused = fp8_gemv.matmul(x, w.data, w.scale.float(), None, config, hw_fp8=False, glu=True)
    assert fused.shape == (1, n // 2)
    assert torch.equal(fused, activation.silu_and_mul(y))               # rounded as the separate kernels round
    st = fp8_gemm.W8A8State(w.data.t(), w.scale.float().reshape(1, -1), n, k, torch.float16)
    assert torch.equal(fp8_gemm.apply_glu(x, st), fp8_gemv.matmul(x, w.data, w.scale.float(), glu=True))


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_rope_epilogue_equals_the_gemv_then_rotary_and_store(fmt):
    from test_rotary import check_rope_epilogue
    hq, hk, d, k_in = 3, 2, 128, 512                     # 128-row programs straddle q and k, k and v
    n = (hq + 2 * hk) * d
    w = make_fp8(n, k_in, "e4m3", "channel", seed=6)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, k_in, generator=g).to(DEVICE, torch.float16)
    st = fp8_gemm.W8A8State(w.data.t(), w.scale.float().reshape(1, -1), n, k_in, torch.float16)

    def fused(rope):
        assert fp8_gemv.rope_applies(n, rope) and not fp8_gemv.rope_applies(n + d, rope)
        assert fp8_gemm.apply_rope_store(torch.cat([x, x]), st, None, rope) is None     # two rows: W8A8, no epilogue
        return fp8_gemm.apply_rope_store(x, st, None, rope)
    check_rope_epilogue(fused, lambda: fp8_gemv.matmul(x, w.data, w.scale.float(), None, fp8_gemv.ROPE_CONFIG), 1,
                        hq, hk, d, fmt, g)
