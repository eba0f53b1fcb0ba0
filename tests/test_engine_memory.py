"""LLM.memory(): bytes held by weights (per kind and kernel), KV cache, activations, graphs, against figures
computed from the shapes and the source files; LLM.close() / with / del let go of what the engine held."""
from __future__ import annotations

import gc
import weakref

import gguf
import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine.core import EngineClosedError
from quanta.engine.layers import MergedQuantLinear, QuantLinear
from quanta.loaders.gguf.file import read_gguf
from kernel_util import cpu_4bit_kernel  # noqa: I001

from tiny_models import build_tiny_hf

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def ggml_bytes(n: int, k: int, type_name: str) -> int:
    """Bytes of an [n, k] GGUF tensor by hand: q8_0 blocks are 32 codes + an fp16 scale, q6_K blocks are
    256 weights in 210 bytes, q4_1 blocks 32 nibbles + fp16 scale and min."""
    per_block = {"q8_0": (32, 34), "q6_K": (256, 210), "q4_1": (32, 20), "q4_0": (32, 18), "q5_0": (32, 22)}
    weights, size = per_block[type_name]
    return n * k // weights * size


@pytest.fixture(scope="module")
def smollm(default_model_path):
    llm = LLM(model=str(default_model_path), device="cpu", num_kv_blocks=32, max_model_len=256, quiet=True)
    yield llm, default_model_path
    llm.close()


def test_default_model_weights_by_kernel_at_their_bytes(smollm):
    """Every GEMM of the default model on the CPU holds its stored bytes: the Q4_1 layers on the packed 4-bit
    kernel, the tied Q8_0 table as the lm_head on cpu_vnni (its bytes in 16-row tiles, from which the embedding
    reads its rows: held once) or cpu_ggml (the file's blocks themselves, shared with the embedding)."""
    llm, path = smollm
    weights = llm.memory()["weights"]
    assert not [k for k in weights if k.endswith("-> dequantized")], weights
    kernel = cpu_4bit_kernel()[0]
    head = weights[f"gguf q8_0 -> {'cpu_vnni' if kernel == 'cpu_vnni' else 'cpu_ggml'}"]
    assert head["layers"] == 1 and head["stored_bytes"] == ggml_bytes(49152, 576, "q8_0")
    assert head["bytes"] == head["stored_bytes"]
    assert weights["embedding gguf q8_0"]["bytes"] == 0                 # the lm_head's bytes, counted there
    assert weights[f"gguf q4_1 -> {kernel}"]["layers"] == 120


def test_a_tied_embedding_reads_the_lm_heads_tiles_exactly(smollm):
    """Where the embedding reads its rows from the lm_head's state, they are the file's rows: the gguf package's
    dequantization of the same Q8_0 blocks."""
    llm, path = smollm
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    ids = torch.tensor([0, 1, 17, 4242, 49151])
    want = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(49152, 576)[ids]
    assert torch.equal(llm.model.model.embed_tokens(ids), want)


def test_dequantized_weights_say_how_much_they_expanded(default_model_path):
    with LLM(model=str(default_model_path), device="cpu", kernel="dequantized", num_kv_blocks=8, max_model_len=64,
             quiet=True) as llm:
        _check_weights_by_kernel(llm, default_model_path)


def _check_weights_by_kernel(llm, path):
    mem = llm.memory()
    types = {t.name: t.type.name for t in read_gguf(path).tensors}
    weights = mem["weights"]
    assert weights["total"] == sum(e["bytes"] for k, e in weights.items() if k != "total")
    layers = [m for m in llm.model.modules() if isinstance(m, QuantLinear) and m.kernel is not None]
    assert sum(e.get("layers", 0) for k, e in weights.items() if " -> " in k) == len(layers)
    fallback = {k: e for k, e in weights.items() if k.endswith("-> dequantized")}
    assert fallback, weights                       # every GEMM, the tied lm_head (the q8_0 table) among them
    for key, entry in fallback.items():
        gguf_type = key.split(" ")[1]
        chosen = [m for m in layers if m.kernel.NAME == "dequantized" and m.scheme == f"gguf {gguf_type}"]
        held = sum(m.out_features * m.in_features * torch.finfo(m.dtype).bits // 8 for m in chosen)
        stored = sum(ggml_bytes(m.out_features, m.in_features, gguf_type) for m in chosen)
        assert entry["bytes"] == held and entry["stored_bytes"] == stored
        assert entry["expanded_by"] == round(held / stored, 2) and entry["expanded_by"] > 1
    head = llm.model.lm_head
    assert types["token_embd.weight"] == head.scheme.split(" ")[1]     # tied: the lm_head is the table


def test_default_model_kv_cache_and_estimates(smollm):
    llm, path = smollm
    mem = llm.memory()
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; float32 on the CPU; 32 blocks of 16 tokens; K and V.
    assert mem["kv_cache"] == 2 * 30 * 32 * 16 * 3 * 64 * 4 and mem["kv_cache_blocks"] == 32
    assert mem["activation_source"] == "plan estimate"
    tokens = llm.config.max_num_batched_tokens
    assert mem["activation_peak"] >= 4 * 256 * 49152 * 4 + 3 * tokens * 576 * 4   # sampling rows + residual stream
    assert mem["cuda_graphs"] == 0 and mem["free"] > 0


def test_tiny_hf_weights_are_the_transformers_parameters(tmp_path):
    path, hf = build_tiny_hf("llama", tmp_path / "m")
    with LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64, quiet=True) as llm:
        weights = llm.memory()["weights"]
    expected = sum(p.numel() * 4 for p in hf.parameters())               # float32, untied
    assert weights["total"] == expected
    assert weights["dense torch.float32 -> dense"]["layers"] == 2 * 4 + 1     # qkv, o, gate_up, down; lm_head
    assert "expanded_by" not in weights["dense torch.float32 -> dense"]


def held_tensors(llm: LLM) -> list[weakref.ref]:
    """Weak references to the big tensors an LLM holds: every weight state, the embedding, norms, KV."""
    refs = [weakref.ref(llm.kv_cache.kv), weakref.ref(llm.model.model.embed_tokens.table)]
    for module in llm.model.modules():
        if isinstance(module, QuantLinear) and module.kernel is not None:
            state = module.state
            tensors = [state] if isinstance(state, torch.Tensor) else \
                [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
            refs += [weakref.ref(t) for t in tensors]
        elif not isinstance(module, MergedQuantLinear):
            refs += [weakref.ref(p) for p in module.parameters(recurse=False)]
    return refs


def new_llm() -> LLM:
    return LLM(model="synthetic:tiny:w4g32", device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=128,
               quiet=True)


@pytest.mark.parametrize("how", ["close", "with", "del"])
def test_close_with_and_del_free_what_the_llm_held(how):
    for _ in range(3):                           # several engines, one after the other, in one process
        if how == "with":
            with new_llm() as llm:
                llm.generate([[5, 6, 7]], GREEDY)
                refs = held_tensors(llm)
        else:
            llm = new_llm()
            llm.generate([[5, 6, 7]], GREEDY)
            refs = held_tensors(llm)
            if how == "close":
                llm.close()
            else:
                del llm
        assert len(refs) > 20
        assert [r for r in refs if r() is not None] == []
        if how != "del":
            llm.close()                          # idempotent
            with pytest.raises(EngineClosedError, match="closed"):
                llm.generate([[5, 6, 7]], GREEDY)
            with pytest.raises(EngineClosedError):
                llm.memory()
            del llm
        gc.collect()


# --- on a GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_start_up_refuses_what_cannot_fit_before_loading_with_the_plans_words():
    """A Llama-3-70B in fp16 on one GPU: the engine's start-up check refuses it with quanta plan's verdict
    (naming a format that would fit) before a byte of weights reaches the device."""
    from quanta.quant.errors import ConfigError
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match=r"^does not fit: synthetic:llama3-70b:fp16 \(fp16\) on 1x.*would fit with"):
        LLM(model="synthetic:llama3-70b:fp16", quiet=True)
    assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
def test_close_returns_the_gpu_memory_each_time():
    """Three engines made and closed in one process: each close gives back every byte it allocated (torch's
    cuBLAS workspaces, one per stream its GEMMs ran on, included), and the memory report's load peak is at
    least its weights."""
    baseline = None
    for _ in range(3):
        with LLM(model="synthetic:llama3-8b:w4g128", gpu_memory_utilization=0.3, max_model_len=2048,
                 quiet=True) as llm:
            mem = llm.memory()
            assert mem["load_peak"] >= mem["weights"]["total"] > 4 * 2**30
            assert llm.generate({"prompt_token_ids": [11, 12, 13]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        gc.collect()
        baseline = torch.cuda.memory_allocated() if baseline is None else baseline
        assert torch.cuda.memory_allocated() == baseline
        assert baseline < 64 * 2**20
