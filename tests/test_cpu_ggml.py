"""cpu_ggml: GGUF blocks as stored on the CPU (cpu/ggml_matmul.c), every ggml type quanta reads, against the
`gguf` package's dequantization of the same bytes (random valid blocks: every bit pattern of codes and scales) and a
float64 matmul; a row's result the same bit for bit whatever the batch and the thread count; the file's bytes held,
not a copy; and a Q4_K_M file written by `quanta convert` generating on it the greedy text of the dequantized path."""
import shutil

import pytest
import torch

from kernel_util import cpu_4bit_kernel  # noqa: I001
from quanta.kernels import registry
from quanta.cpu import ggml as cpu_ggml, int4 as cpu_int4, vnni as cpu_vnni
from test_ggml_gemm import make_gguf

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

CPU = torch.device("cpu")
TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def shape_of(name: str) -> tuple[int, int]:
    """N = 37 (a short last tile of four rows); K two super-blocks, or nine blocks of 32."""
    return (37, 512) if name.endswith("_K") or name == "IQ4_XS" else (37, 288)


@pytest.mark.parametrize("name", TYPES)
def test_each_type_dequantizes_as_the_gguf_package(name):
    """x = the identity gives W^T exactly (one nonzero product a sum): the values the C makes of the blocks are
    the gguf package's, bit for bit."""
    w, ref = make_gguf(*shape_of(name), name, device="cpu")
    state = cpu_ggml.prepare(w, CPU, torch.float32)
    got = cpu_ggml.apply(torch.eye(w.shape[1]), state).T
    assert torch.equal(got, ref)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_each_type_matches_a_float64_matmul(name, dtype):
    w, ref = make_gguf(*shape_of(name), name, device="cpu", seed=1)
    state = cpu_ggml.prepare(w, CPU, dtype)
    x = torch.randn(2, 3, w.shape[1]).to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    got = cpu_ggml.apply(x, state, bias)
    want = x.double() @ ref.double().T + bias.double()
    assert got.dtype == dtype and got.shape == (2, 3, w.shape[0])
    tol = 1e-6 if dtype == torch.float32 else 1e-2              # bfloat16: the output's rounding
    assert ((got.double() - want).norm() / want.norm()).item() < tol


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_a_row_does_not_depend_on_the_batch_or_the_threads(name):
    """Decode (one row), prefill chunks of every length mod the C's row tile, one thread or two: the same bits."""
    w, _ = make_gguf(*shape_of(name), name, device="cpu", seed=2)
    state = cpu_ggml.prepare(w, CPU, torch.float32)
    x = torch.randn(23, w.shape[1])
    alone = torch.cat([cpu_ggml.apply(x[i:i + 1], state) for i in range(23)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for m in (2, 3, 4, 5, 9, 23):
                assert torch.equal(cpu_ggml.apply(x[:m], state), alone[:m]), (n, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", TYPES)
def test_the_registry_holds_every_type_at_its_file_bytes(name):
    """Q4_0, Q4_1 and Q8_0 go to cpu_vnni where it builds (its tiles hold the file's bytes), else Q4_1 to
    torch's int4 kernel (its packed form is Q4_1's own 5 bits a weight); every other type on cpu_ggml, whose state
    is the weight's own blocks (no copy). N = 48: both tile 16 rows."""
    w, _ = make_gguf(48, shape_of(name)[1], name, device="cpu")
    module, _ = registry.select(w, CPU, torch.float32)
    if name in ("Q4_0", "Q4_1", "Q8_0") and cpu_4bit_kernel()[0] == "cpu_vnni":
        assert module is cpu_vnni
        state = module.prepare(w, CPU, torch.float32)
        assert state.codes.nbytes + state.scales.nbytes + getattr(state.offsets, "nbytes", 0) == w.nbytes
        return
    if name == "Q4_1":
        assert module is cpu_int4
        state = module.prepare(w, CPU, torch.float32)
        assert state.packed.nbytes + state.scales_zeros.nbytes == w.nbytes
        return
    assert module is cpu_ggml
    state = module.prepare(w, CPU, torch.float32)
    assert state.blocks.nbytes == w.nbytes and state.blocks.data_ptr() == w.data.data_ptr()
    assert module.path(state, 1)[0] == "cpu_ggml"


def test_without_a_compiler_the_next_kernel_runs(monkeypatch, tmp_path):
    w, _ = make_gguf(40, 512, "Q6_K", device="cpu")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("QUANTA_CACHE", str(tmp_path / "cache"))
    cpu_ggml.library.cache_clear()
    try:
        assert "no native library" in cpu_ggml.supports(w, CPU, torch.float32)
        module, reason = registry.select(w, CPU, torch.float32)
        assert module.NAME == "cpu_rows" and "cpu_ggml: no native library" in reason
        assert not list((tmp_path / "cache").rglob("*.so"))          # nothing half-built left behind
    finally:
        cpu_ggml.library.cache_clear()


def test_it_refuses_what_it_cannot_run():
    w, _ = make_gguf(40, 512, "Q6_K", device="cpu")
    assert cpu_ggml.supports(w, torch.device("cuda"), torch.float32) == "CPU only"
    assert "float16" in cpu_ggml.supports(w, CPU, torch.float16)
    assert cpu_ggml.supports(torch.zeros(4, 4), CPU, torch.float32) == "GGUF blocks only"


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory, default_model_path):
    import quanta
    out = tmp_path_factory.mktemp("q4km") / "smollm2-q4_k_m.gguf"
    quanta.convert(default_model_path, "gguf:Q4_K_M", out, validate=False, quiet=True)
    return out


def test_a_q4_k_m_file_generates_the_dequantized_paths_greedy_text(q4_k_m):
    """The default model converted to Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 tensors): every GEMM at the file's bytes,
    on cpu_ggml (the Q8_0 one on cpu_vnni where it builds), and the greedy tokens of the float32 dequantized
    path."""
    from quanta.engine import LLM, SamplingParams
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs = {}
    for kernel in (None, "dequantized"):
        with LLM(str(q4_k_m), device="cpu", kernel=kernel, max_model_len=128, quiet=True) as llm:
            if kernel is None:
                chosen = {(k["scheme"], k["kernel"]) for k in llm.kernels()}
                q8 = "cpu_vnni" if cpu_4bit_kernel()[0] == "cpu_vnni" else "cpu_ggml"
                assert chosen == {(f"gguf {t}", "cpu_ggml") for t in ("q4_K", "q5_0", "q6_K")} | {("gguf q8_0", q8)}
                weights = llm.memory()["weights"]
                held = [e for key, e in weights.items() if "-> cpu_" in key]
                assert all(e["bytes"] == e["stored_bytes"] for e in held), weights
            runs[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[None] == runs["dequantized"]
