"""cpu_rows: the CPU's GEMM for the formats without a packed torch kernel, holding the weight at its bytes and
dequantizing a block of rows per call; and GGUF Q4_K on the packed int4 kernel (GGUF blocks where cpu_ggml's native
code cannot run). Oracles: the gguf package's
dequantization for GGML blocks, torch's float8 conversion times the scales, the bitsandbytes tables applied
to the codes in float64."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from quanta.kernels import registry
from quanta.cpu import affine as cpu_affine, int4 as cpu_int4, rows as cpu_rows
from quanta.quant.ggml import kquantize
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import Gguf
from test_affine_gemm import make_affine
from test_codebook_gemm import make_codebook
from test_fp8_gemm import make_fp8

CPU = torch.device("cpu")


def k_quant(n: int, k: int, name: str, seed: int = 0) -> tuple[Gguf, torch.Tensor]:
    """A K-quant weight (blocks from quanta's quantizer) and the gguf package's dequantization of them."""
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05)
    data = getattr(kquantize, name.lower())(w.reshape(-1, 256)).reshape(n, -1)
    t = GGMLQuantizationType[name]
    return Gguf(data=data, ggml_type=int(t), shape=(n, k)), torch.from_numpy(quants.dequantize(data.numpy(), t))


def legacy(n: int, k: int, name: str) -> tuple[Gguf, torch.Tensor]:
    w = np.random.default_rng(1).standard_normal((n, k)).astype(np.float32) * 0.05
    t = GGMLQuantizationType[name]
    blocks = quants.quantize(w, t)
    return Gguf(data=torch.from_numpy(blocks), ggml_type=int(t), shape=(n, k)), torch.from_numpy(quants.dequantize(blocks, t))


def codebook_oracle(w) -> torch.Tensor:
    """table[code] * absmax in float64, blocks over the flattened weight (bitsandbytes' layout)."""
    flat = w.table.double()[w.codes.reshape(-1).long()]
    return (flat * w.block_absmax().double().repeat_interleave(w.blocksize)[: flat.numel()]).reshape(w.shape)


def fp8_oracle(w) -> torch.Tensor:
    return w.data.double() * w.expanded_scale().double()


def held_bytes(state) -> int:
    total = 0
    for block in state.blocks:
        fields = block.tensors().values() if hasattr(block, "tensors") else (block.packed, block.absmax, block.table)
        total += sum(t.numel() * t.element_size() for t in fields)
    return total


CASES = {
    "q6_K": lambda: k_quant(48, 512, "Q6_K"),
    "q5_K": lambda: k_quant(40, 256, "Q5_K"),
    "q3_K": lambda: k_quant(32, 512, "Q3_K"),
    "q5_0": lambda: legacy(48, 320, "Q5_0"),
    "nf4": lambda: (w := make_codebook(72, 256, 64, "nf4", False, device="cpu"), codebook_oracle(w)),
    "fp4-dq": lambda: (w := make_codebook(73, 192, 64, "fp4", True, device="cpu"), codebook_oracle(w)),
    "fp8-channel": lambda: (w := make_fp8(72, 256, "e4m3", "channel", device="cpu"), fp8_oracle(w)),
    "fp8-block": lambda: (w := make_fp8(300, 256, "e4m3", "block", device="cpu"), fp8_oracle(w)),
    "int3-g64": lambda: (w := make_affine(64, 256, 3, 64, "asym", device="cpu"), w.dequantize().double()),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rows_match_the_oracle_and_hold_the_stored_bytes(case, dtype, monkeypatch):
    """Selected on the CPU for the format; several row blocks (a small block budget) give x @ W.T of the
    oracle's W; the state holds the weight's own bytes (NF4 codes two a byte; affine codes one a byte, as the
    Affine kind holds them), not a dequantized copy."""
    monkeypatch.setattr(cpu_rows, "BLOCK_WEIGHTS", 32 * 256)
    monkeypatch.setenv("QUANTA_NATIVE", "0")            # GGUF blocks go to cpu_ggml where native code runs
    w, want = CASES[case]()
    module, _ = registry.select(w, CPU, dtype)
    assert module is cpu_rows
    state = cpu_rows.prepare(w, CPU, dtype)
    assert len(state.blocks) > 1
    x = torch.randn(5, w.shape[1]).to(dtype)
    bias = torch.randn(w.shape[0]).to(dtype)
    got = cpu_rows.apply(x, state, bias)
    ref = x.double() @ want.double().T + bias.double()
    assert got.dtype == dtype and got.shape == (5, w.shape[0])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    held = sum(t.numel() * t.element_size() for t in w.tensors().values()) if isinstance(w, Affine) else w.nbytes
    assert held_bytes(state) <= 1.15 * held
    assert cpu_rows.path(state, 5)[0] == "cpu_rows"


def test_rows_do_not_depend_on_the_batch():
    """A row's output is the same bit for bit whatever else is in the call (decode, prefill chunk)."""
    w, _ = CASES["q6_K"]()
    state = cpu_rows.prepare(w, CPU, torch.float32)
    x = torch.randn(70, 512)
    alone = torch.cat([cpu_rows.apply(x[i:i + 1], state) for i in range(70)])
    for m in (2, 17, 70):
        assert torch.equal(cpu_rows.apply(x[:m], state), alone[:m]), m


def test_rows_refuse_what_they_cannot_run():
    w, _ = CASES["q6_K"]()
    assert cpu_rows.supports(w, torch.device("cuda"), torch.float32) == "CPU only"
    assert "float16" in cpu_rows.supports(w, CPU, torch.float16)
    assert cpu_rows.supports(torch.zeros(4, 4), CPU, torch.float32) == "not a QTensor"


def test_q4_k_runs_on_the_packed_int4_kernel_without_native_code(monkeypatch):
    """Q4_K's sub-blocks are affine groups of 32 with float mins: their Affine form equals the gguf package's
    dequantization bit for bit, and where cpu_ggml cannot run the registry picks cpu_int4 (4-bit codes kept
    packed)."""
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    w, want = k_quant(64, 512, "Q4_K")
    assert torch.equal(cpu_affine.affine_form(w).dequantize(), want)
    module, reason = registry.select(w, CPU, torch.float32)
    assert module is cpu_int4 and "cpu_vnni: no native library" in reason
    state = cpu_int4.prepare(w, CPU, torch.float32)
    x = torch.randn(3, 512)
    ref = x.double() @ want.double().T
    assert ((module.apply(x, state).double() - ref).norm() / ref.norm()).item() < 2e-2
    assert state.packed.nbytes + state.scales_zeros.nbytes <= 1.15 * w.nbytes


def test_a_forced_kernel_that_cannot_run_the_weights_is_named(tmp_path):
    """`kernel=` names a kernel: one that does not exist for these weights is a ConfigError listing the ones that
    do, and "auto" lets the registry choose (validate reports the choice as "auto")."""
    from quanta.engine.config import EngineConfig
    from quanta.quant.errors import ConfigError
    w, _ = k_quant(64, 512, "Q4_K")
    with pytest.raises(ConfigError, match="kernel 'triton_fp8' cannot run .* on cpu; the kernels for these weights "
                                          "are cpu_vnni, cpu_int4, cpu_ggml, cpu_int8, cpu_rows, dequantized"):
        registry.select(w, CPU, torch.float32, force="triton_fp8")
    assert registry.select(w, CPU, torch.float32, force="cpu_rows")[0] is cpu_rows
    assert EngineConfig(model=str(tmp_path), device="cpu", kernel="auto").kernel is None


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_a_tied_16_bit_table_is_held_once_on_the_cpu(tmp_path, stored):
    """A tied model stored in 16 bits, run with float32 activations: the embedding keeps the table in its 16 bits
    (rows widened on lookup) and the lm_head computes from that same tensor, so the table is held once; greedy
    tokens match transformers run in float32 on the same weights."""
    from quanta.engine import LLM, SamplingParams
    from tiny_models import build_tiny_hf, hf_greedy
    path, model = build_tiny_hf("llama", tmp_path / "m", stored, tie=True)
    with LLM(str(path), device="cpu", max_model_len=64, quiet=True) as llm:
        table, head = llm.model.model.embed_tokens.table, llm.model.lm_head.state
        assert table.dtype == stored and head.data_ptr() == table.data_ptr()
        ids = [5, 9, 200, 31]
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(model.float(), ids, 6)
