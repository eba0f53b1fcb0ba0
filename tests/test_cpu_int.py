"""The CPU integer kernels (cpu_int4, cpu_int8: torch's packed int4 / int8 GEMMs) against the weights' own
dequantize(), and what they refuse."""
import pytest
import torch

from kernel_util import rel_err  # noqa: I001
from quanta.kernels import dense, dequantized, registry
from quanta.cpu import int4 as cpu_int4, int8 as cpu_int8, vnni as cpu_vnni
from test_affine_gemm import make_affine
from test_affine_gguf import make_gguf


@pytest.mark.parametrize("zero", ["sym", "asym", "fmin"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_int4_matches_dequantize(zero, dtype):
    w = make_affine(64, 256, 4, 64, zero, device="cpu")
    assert cpu_int4.supports(w, torch.device("cpu"), dtype) is None
    st = cpu_int4.prepare(w, torch.device("cpu"), dtype)
    x = torch.randn(2, 3, 256).to(dtype)
    bias = torch.randn(64).to(dtype)
    y = cpu_int4.apply(x, st, bias)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    assert y.shape == (2, 3, 64) and y.dtype == dtype
    assert rel_err(y, ref) < 2e-2                      # the GEMM runs at bf16 input (compute_dtype)
    assert cpu_int4.compute_dtype(dtype) == torch.bfloat16
    assert cpu_int4.path(st, 3)[0] == "cpu_int4"


@pytest.mark.parametrize("group", [-1, 32], ids=["channel", "g32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_int8_matches_dequantize(dtype, group):
    w = make_affine(48, 160, 8, group, "sym", device="cpu")
    assert cpu_int8.supports(w, torch.device("cpu"), dtype) is None
    st = cpu_int8.prepare(w, torch.device("cpu"), dtype)
    x = torch.randn(5, 160).to(dtype)
    bias = torch.randn(48).to(dtype)
    y = cpu_int8.apply(x, st, bias)
    assert y.shape == (5, 48) and y.dtype == dtype
    assert rel_err(y, x.double() @ w.dequantize().double().T + bias.double()) < 2e-2   # at bf16 input
    assert cpu_int8.compute_dtype(dtype) == torch.bfloat16
    rows = torch.tensor([47, 0, 5])
    assert torch.equal(st.exact_rows(rows), w.dequantize()[rows])           # float32 rows, exactly
    xs = torch.randn(3, 160)
    assert torch.allclose(st.exact_products(rows, xs), (w.dequantize()[rows].double() * xs.double()).sum(-1).float(),
                          rtol=1e-5, atol=1e-5)
    assert torch.allclose(st.row_norms(), w.dequantize().norm(dim=1), rtol=1e-5)
    name, why = cpu_int8.path(st, 5)
    assert name == "cpu_int8" and ("one call per group of 32 columns (5)" in why) == (group == 32), why


def test_gguf_q8_0_without_native_code_runs_on_the_int8_kernel_at_its_bytes(monkeypatch):
    """GGUF Q8_0's blocks of 32 (the default model's tied table) where cpu_ggml cannot run (QUANTA_NATIVE=0):
    cpu_int8 holds the int8 codes and a scale a block, not a dequantized copy, and computes what the gguf
    package's dequantization gives."""
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    w, ref_w = make_gguf(96, 256, "Q8_0", device="cpu")
    module, reason = registry.select(w, torch.device("cpu"), torch.bfloat16)
    assert module is cpu_int8 and "cpu_int4: needs plain 4-bit" in reason
    st = cpu_int8.prepare(w, torch.device("cpu"), torch.bfloat16)
    assert st.codes.nbytes == 96 * 256 and st.codes.dtype == torch.int8
    assert st.codes.nbytes + st.exact_scales.nbytes == w.data.nbytes          # Q8_0's own bytes, nothing more
    x = torch.randn(3, 256)
    assert rel_err(cpu_int8.apply(x, st), x.double() @ ref_w.double().T) < 2e-2
    assert torch.equal(st.exact_rows(torch.arange(96)), ref_w)


def test_they_refuse_what_they_cannot_run():
    cpu = torch.device("cpu")
    w4 = make_affine(64, 256, 4, 64, "sym", device="cpu")
    assert cpu_int4.supports(w4, torch.device("cuda"), torch.bfloat16) == "CPU only"
    assert "float16" in cpu_int4.supports(w4, cpu, torch.float16)
    assert "plain 4-bit" in cpu_int4.supports(make_affine(64, 256, 8, 64, "sym", device="cpu"), cpu, torch.float32)
    assert "symmetric 8-bit" in cpu_int8.supports(w4, cpu, torch.float32)
    assert "symmetric 8-bit" in cpu_int8.supports(make_affine(64, 256, 8, 64, "asym", device="cpu"), cpu,
                                                  torch.float32)
    assert cpu_int8.supports(torch.zeros(4, 4), cpu, torch.float32) == "no exact affine form"


def test_gguf_q4_0_runs_packed_on_the_cpu_without_native_code(monkeypatch):
    """GGUF Q4_0 has an exact affine form: where no native kernel can hold its blocks (QUANTA_NATIVE=0), the
    registry picks cpu_int4 (not a dequantized copy); with them, cpu_vnni takes it where it builds, and
    otherwise cpu_int4 leaves the weight to cpu_ggml, whose state is the file's bytes where the packed form's
    bfloat16 scale and zero a group would be a ninth more."""
    w, ref_w = make_gguf(64, 256, "Q4_0", device="cpu")
    module, reason = registry.select(w, torch.device("cpu"), torch.float32)
    if cpu_vnni.supports(w, torch.device("cpu"), torch.float32) is None:
        assert module is cpu_vnni and reason == "first choice"
    else:
        assert module.NAME == "cpu_ggml" and "cpu_int4: cpu_ggml holds its blocks at their 9216 bytes" in reason
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    module, reason = registry.select(w, torch.device("cpu"), torch.float32)
    assert module is cpu_int4 and "cpu_vnni: no native library" in reason
    x = torch.randn(3, 256)
    assert rel_err(module.apply(x, module.prepare(w, torch.device("cpu"), torch.float32)), x @ ref_w.T) < 2e-2


def test_single_path_modules_name_themselves():
    w = make_affine(8, 64, 4, 32, "sym", device="cpu")
    assert dense.path(torch.zeros(8, 64, dtype=torch.bfloat16), 1) == ("dense", "bfloat16 weight: torch's matmul")
    name, reason = dequantized.path(dequantized.prepare(w, torch.device("cpu"), torch.float16), 7)
    assert name == "dequantized" and "float16" in reason


def test_an_int8_lm_head_refined_picks_the_exact_float32_top():
    """A Q8_0 head on cpu_int8 computes in bfloat16 pieces; its entries that can be a row's largest (each with its
    own Cauchy-Schwarz bound from the rows' norms) are recomputed from the codes in float32, so the argmax and the
    top value are the exact product's, and a row's result does not depend on the rows beside it."""
    from quanta.cpu import matmul as cpu_matmul
    w, ref_w = make_gguf(4096, 256, "Q8_0", device="cpu")
    st = cpu_int8.prepare(w, torch.device("cpu"), torch.bfloat16)
    assert torch.allclose(st.row_norms(), ref_w.norm(dim=1), rtol=1e-5)
    x = torch.randn(40, 256)
    x[1] = x[0] + 1e-4 * torch.randn(256)                        # near ties between the two rows' tops

    def refined(rows):
        logits = cpu_int8.apply(rows, st).float()
        return cpu_matmul.refine_top_rows(logits, rows, st.exact_products, st.row_norms(),
                                          torch.finfo(torch.bfloat16).eps, st.roundings)
    got = refined(x)
    exact = x.double() @ ref_w.double().T
    top = exact.argmax(-1, keepdim=True)
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert ((got.gather(1, top) - exact.gather(1, top)).abs() < 1e-4).all()
    alone = torch.cat([refined(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, got)
