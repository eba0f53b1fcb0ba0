"""IQ4_NL's and IQ4_XS's dp4a GEMV (gemv_iq4): the activations in IQ4's order against the plain codes, the GEMV
against the gguf package's dequantization times x rounded to 8 bits (integer twins under the interpreter), and how
far x's rounding takes it from the fp16 product. Its PTX through the emulator and its SwiGLU epilogue are tested
with the other dp4a GEMV's (test_ggml_dp4a)."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
from test_ggml_dp4a import dequantized_x
from test_ggml_gemm import make_gguf
from quanta.kernels import activation, ggml_gemm
from quanta.kernels.ggml import gemv_dp4a, gemv_iq4

TYPES = ["IQ4_NL", "IQ4_XS"]


def test_interleaved_codes_are_the_plain_codes_in_iq4_order():
    """Byte 2i of each 32-value block holds value i's code, byte 2i + 1 value 16 + i's; scales and sums as plain."""
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    plain, inter = gemv_dp4a.quantize_rows(x), gemv_dp4a.quantize_rows(x, interleave=True)
    blocks = plain[0].reshape(2, -1, 2, 16)
    assert torch.equal(inter[0], blocks.transpose(2, 3).reshape(2, 512))
    assert torch.equal(inter[1], plain[1]) and torch.equal(inter[2], plain[2])


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m,config", [(1, None), (1, (16, 4, 64.0, 1)), (1, (64, 4, 1e-3, 1)), (3, None)])
def test_iq4_gemv_is_the_gguf_weight_times_the_rounded_activations(name, m, config):
    """N = 40 (not a multiple of BLOCK_N), K three tiles, with a bias: planned, split-K at every tile and one
    program's K loop, three rows; against the gguf package's dequantization times x rounded to 8 bits; x's rounding
    keeps it within 2% of the fp16 product; quantizing in the call gives the same as codes given."""
    w, ref = make_gguf(40, 768, name, seed=m)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    q, d, _ = gemv_dp4a.quantize_rows(x)
    y = gemv_iq4.matmul(x, st, bias, config)
    refd = ref.double().T.to(DEVICE)
    assert y.dtype == torch.float16 and y.shape == (m, 40)
    assert rel_err(y, dequantized_x(q, d) @ refd + bias.double()) < TOL[torch.float16]
    assert rel_err(y, x.double() @ refd + bias.double()) < 2e-2
    given = gemv_iq4.matmul(x, st, bias, config, quantized=gemv_dp4a.quantize_rows(x, interleave=True))
    assert torch.equal(given, y)


def test_only_iq4_types_whole_tiles_and_16_bit_floats():
    assert "no table dp4a GEMV" in gemv_iq4.applies(ggml_gemm.prepare(make_gguf(40, 512, "Q4_0")[0], DEVICE,
                                                                       torch.float16))
    assert "not a multiple of 256" in gemv_iq4.applies(ggml_gemm.prepare(make_gguf(40, 288, "IQ4_NL")[0], DEVICE,
                                                                          torch.float16))
    assert "float32" in gemv_iq4.applies(ggml_gemm.prepare(make_gguf(40, 512, "IQ4_XS")[0], DEVICE, torch.float32))


@pytest.mark.parametrize("name", TYPES)
def test_iq4_gemv_in_bf16(name):
    """bf16 activations (where the registry leaves IQ4 on the ggml kernels) and output, within bf16's error of the
    gguf package's weight times the rounded activations."""
    w, ref = make_gguf(40, 512, name, seed=4)
    st = ggml_gemm.prepare(w, DEVICE, torch.bfloat16)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    q, d, _ = gemv_dp4a.quantize_rows(x)
    y = gemv_iq4.matmul(x, st)
    want = dequantized_x(q, d) @ ref.double().T.to(DEVICE)
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < TOL[torch.bfloat16]


def test_plan_gives_the_iq4_gemv_every_weight_of_its_types_at_one_row(monkeypatch):
    """With the type in plan.DP4A_TYPES (both IQ4 types as built), at one row on CUDA, whatever the weight's size, in
    fp16 and bf16; else the table GEMV."""
    from quanta.kernels.device_caps import PRESETS
    from quanta.kernels.ggml import plan
    caps = PRESETS["sm90"]

    def state(name="IQ4_XS", dtype=torch.float16):
        return ggml_gemm.prepare(make_gguf(32, 256, name)[0], DEVICE, dtype)    # plans are cached on it
    assert plan.DP4A_TYPES == ("iq4_nl", "iq4_xs")
    st = state()
    assert [plan.choose(st, caps, m).path.name for m in (1, 2)] == ["gemv_iq4", "cublas"]
    assert plan.choose(state("IQ4_NL", torch.bfloat16), caps, 1).path.name == "gemv_iq4"
    assert plan.choose(state(), PRESETS["cpu"], 1).path.name == "gemv"
    assert "byte permutes" in plan.explain(st, caps, 1)[1]
    monkeypatch.setattr(plan, "DP4A_TYPES", ())
    assert plan.choose(state(), caps, 1).path.name == "gemv"


@pytest.mark.gpu
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_iq4_gemv_at_the_8b_shapes(name, n, k):
    """The PTX at real shapes, planned launch, with its SwiGLU epilogue: the gguf package's weight times the rounded
    activations within fp16's error."""
    w, ref = make_gguf(n, k, name, seed=11)
    st = ggml_gemm.prepare(w, "cuda", torch.float16)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12)).to("cuda", torch.float16)
    q, d, _ = gemv_dp4a.quantize_rows(x)
    want = dequantized_x(q, d) @ ref.double().T.cuda()
    y = gemv_iq4.matmul(x, st)
    assert rel_err(y, want) < TOL[torch.float16] and rel_err(y, x.double() @ ref.double().T.cuda()) < 2e-2
    small = x / 64                                   # silu(gate) * up of random blocks' scales within fp16
    fused = gemv_iq4.matmul(small, st, glu=True)
    assert rel_err(fused, activation.silu_and_mul(gemv_iq4.matmul(small, st))) < TOL[torch.float16]


@pytest.mark.parametrize("name", ["Q2_K", "IQ4_XS"])
def test_x_rounded_in_the_programs_gives_the_same(name, monkeypatch):
    """QUANTIZE_IN_PROGRAMS on: each program rounds its own tiles of x instead of quantize_rows' launch; the same
    output."""
    w, _ = make_gguf(40, 512, name, seed=9)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(10)).to(DEVICE, torch.float16)
    module = gemv_iq4 if name.startswith("IQ4") else gemv_dp4a
    assert not gemv_dp4a.QUANTIZE_IN_PROGRAMS
    launched = module.matmul(x, st)
    monkeypatch.setattr(gemv_dp4a, "QUANTIZE_IN_PROGRAMS", True)
    assert torch.equal(module.matmul(x, st), launched)
