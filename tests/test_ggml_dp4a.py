"""Q2_K's and Q3_K's dp4a GEMV against 8-bit activations (gemv_dp4a): the activation quantization against a torch
reference of its rule, the GEMV against the gguf package's dequantization times those activations (its integer twin
under the interpreter, the dp4a PTX through the emulator), and how far x's rounding takes it from the fp16 product."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
import ptx_emulator
from test_ggml_gemm import make_gguf
from quanta.kernels import activation, ggml_gemm
from quanta.kernels.ggml import gemv_dp4a, gemv_iq4


def reference_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in torch: each 32-value block's codes floor(x * 127 / amax + 1/2) and scale amax / 127."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.floor(blocks * inv + 0.5).reshape(x.shape), (amax / 127.0).reshape(x.shape[0], -1)


def dequantized_x(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (q.double().reshape(q.shape[0], -1, 32) * d.double()[..., None]).reshape(q.shape)


@pytest.mark.parametrize("m", [1, 3])
def test_activation_codes_follow_the_rule(m):
    """Codes within one of the reference's (a float32 FMA may round a half-way value the other way), never past
    127; scales amax / 127; each 16 values' sum the sum of its codes; an all-zero block codes zeros."""
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.float16) * 3
    x[0, 32:64] = 0
    q, d, s = gemv_dp4a.quantize_rows(x)
    want_q, want_d = reference_codes(x)
    assert q.dtype == torch.int8 and (q.float() - want_q.to(q.device)).abs().max() <= 1
    assert (q.float() == want_q.to(q.device)).float().mean() > 0.999
    assert q.abs().max() <= 127 and torch.equal(d, want_d.to(d.device))
    assert torch.equal(s, q.int().reshape(m, -1, 16).sum(dim=2, dtype=torch.int32))
    assert not q[0, 32:64].any() and d[0, 1] == 0


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
@pytest.mark.parametrize("m,config", [(1, None), (1, (32, 4, 64.0, 1)), (1, (16, 4, 1e-3, 1)), (3, None)])
def test_dp4a_gemv_is_the_gguf_weight_times_the_rounded_activations(name, m, config):
    """N = 40 (not a multiple of a column block), K three super-blocks, with a bias: planned, split-K at every
    super-block and one program's K loop (one row; the planned launch with three rows, a program row each),
    against the gguf package's dequantization times x rounded to 8 bits; x's rounding keeps it within 2% of the
    fp16 product."""
    w, ref = make_gguf(40, 768, name, seed=m)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    q, d, _ = quantized = gemv_dp4a.quantize_rows(x)
    y = gemv_dp4a.matmul(x, st, bias, config, quantized=quantized)
    refd = ref.double().T.to(DEVICE)
    assert y.dtype == torch.float16 and y.shape == (m, 40)
    assert rel_err(y, dequantized_x(q, d) @ refd + bias.double()) < TOL[torch.float16]
    assert rel_err(y, x.double() @ refd + bias.double()) < 2e-2
    assert torch.equal(gemv_dp4a.matmul(x, st, bias, config), y)          # quantizing in the call: the same


# Each dp4a GEMV by the types it takes, and the launch configs its SwiGLU test runs (one split, splits at every tile)
KERNELS = {"Q2_K": gemv_dp4a, "Q3_K": gemv_dp4a, "IQ4_NL": gemv_iq4, "IQ4_XS": gemv_iq4}
GLU_CONFIGS = {gemv_dp4a: ((32, 4, 1e-3, 1), (32, 4, 64.0, 1)), gemv_iq4: ((32, 4, 1e-3, 1), (16, 4, 64.0, 1))}


@pytest.mark.parametrize("name", KERNELS)
def test_dp4a_ptx_through_the_emulator(name, monkeypatch):
    """The dp4a PTX (IQ4's byte permutes too), emulated, gives the integer twins' output exactly."""
    if DEVICE != "cpu":
        pytest.skip("the emulator runs under the interpreter")
    kernel = KERNELS[name]
    w, _ = make_gguf(40, 512, name, seed=5)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    twin = kernel.matmul(x, st, None, (32, 4, 64.0, 1), ptx=False)
    ptx_emulator.install(monkeypatch)
    assert torch.equal(kernel.matmul(x, st, None, (32, 4, 64.0, 1), ptx=True), twin)


@pytest.mark.parametrize("name", KERNELS)
def test_dp4a_glu_epilogue_equals_the_gemv_then_silu_and_mul(name):
    kernel = KERNELS[name]
    w, _ = make_gguf(96, 512, name, seed=7)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(8)).to(DEVICE, torch.float16)
    for config in GLU_CONFIGS[kernel]:
        fused = kernel.matmul(x, st, None, config, glu=True)
        plain = kernel.matmul(x, st, None, config)
        assert fused.shape == (1, 48) and rel_err(fused, activation.silu_and_mul(plain)) < TOL[torch.float16]


def test_only_q2_k_and_q3_k_in_column_planes_and_fp16():
    w, _ = make_gguf(40, 512, "Q4_K", seed=9)
    assert "no dp4a GEMV" in gemv_dp4a.applies(ggml_gemm.prepare(w, DEVICE, torch.float16))
    w2, _ = make_gguf(40, 512, "Q2_K", seed=9)
    assert "bfloat16" in gemv_dp4a.applies(ggml_gemm.prepare(w2, DEVICE, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q2_K", "Q3_K"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_dp4a_gemv_at_the_8b_shapes(name, n, k):
    """The dp4a PTX at real shapes, planned launch, with its SwiGLU epilogue: the gguf package's weight times the
    rounded activations within fp16's error."""
    w, ref = make_gguf(n, k, name, seed=11)
    st = ggml_gemm.prepare(w, "cuda", torch.float16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12)).to("cuda", torch.float16)
    q, d, _ = gemv_dp4a.quantize_rows(x)
    want = dequantized_x(q, d) @ ref.double().T.cuda()
    y = gemv_dp4a.matmul(x, st)
    assert rel_err(y, want) < TOL[torch.float16] and rel_err(y, x.double() @ ref.double().T.cuda()) < 2e-2
    fused = gemv_dp4a.matmul(x, st, glu=True)
    assert rel_err(fused, activation.silu_and_mul(y)) < TOL[torch.float16]


def test_plan_gives_the_dp4a_gemv_the_large_weights_of_its_types_at_one_row(monkeypatch):
    """Only types in plan.DP4A_TYPES (neither as built), only their weights of DP4A_MIN_VALUES values and more, only at
    one row on CUDA; the SwiGLU of matmul_glu then comes from its epilogue."""
    from quanta.kernels.device_caps import PRESETS
    from quanta.kernels.ggml import plan
    caps = PRESETS["sm90"]

    def state(name, n):
        return ggml_gemm.prepare(make_gguf(n, 256, name)[0], DEVICE, torch.float16)
    assert "q2_K" not in plan.DP4A_TYPES and "q3_K" not in plan.DP4A_TYPES
    assert plan.choose(state("Q2_K", 64), caps, 1).path.name == "gemv_cols"
    monkeypatch.setattr(plan, "DP4A_TYPES", ("q2_K", "q3_K"))
    monkeypatch.setattr(plan, "DP4A_MIN_VALUES", 64 * 256)
    for name in ("Q2_K", "Q3_K"):
        assert [plan.choose(state(name, 64), caps, m).path.name for m in (1, 2)] == ["gemv_dp4a", "gemm"]
        small = state(name, 32)
        assert plan.choose(small, caps, 1).path.name == "gemv_cols"
        assert "latency-bound" in plan.explain(small, caps, 1)[1]
        assert plan.choose(state(name, 64), PRESETS["cpu"], 1).path.name == "gemv"
    assert plan.choose(state("Q4_K", 64), caps, 1).path.name == "gemv_cols"
    st = state("Q2_K", 64)
    reason = plan.explain(st, caps, 1)[1]
    assert "int8 in blocks of 32" in reason and "four a dp4a" in reason
