"""A GGUF model on the GPU: its Q4_1 / Q8_0 layers run on the affine kernels at the bytes they take on
disk, as `quanta inspect` reports, and its logits match the same file dequantized once to 16 bits.

The default model's file cannot travel to the GPU machine, so the test writes one of the same shape
(SmolLM2-135M: Q4_1 linears, a tied Q8_0 embedding) from random weights with the `gguf` package.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

SMOLLM2 = dict(vocab=49152, hidden=576, inter=1536, layers=30, heads=9, kv_heads=3)
TINY = dict(vocab=256, hidden=128, inter=256, layers=2, heads=4, kv_heads=2)
LINEARS = {"attn_q": ("hidden", "hidden"), "attn_k": ("kv", "hidden"), "attn_v": ("kv", "hidden"),
           "attn_output": ("hidden", "hidden"), "ffn_gate": ("inter", "hidden"), "ffn_up": ("inter", "hidden"),
           "ffn_down": ("hidden", "inter")}


def write_model(path, shape: dict, linear_type=T.Q4_1, embed_type=T.Q8_0, seed: int = 0, types: dict | None = None,
                output_type=None):
    """A llama GGUF file of `shape` with random weights; no tokenizer (prompts are token ids). `types`: a ggml type
    per linear name where it is not `linear_type` (a mix); `output_type`: an untied output.weight of that type."""
    rng = np.random.default_rng(seed)
    dims = {"hidden": shape["hidden"], "inter": shape["inter"],
            "kv": shape["kv_heads"] * shape["hidden"] // shape["heads"]}
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", shape["layers"])
    w.add_uint32("llama.embedding_length", shape["hidden"])
    w.add_uint32("llama.feed_forward_length", shape["inter"])
    w.add_uint32("llama.attention.head_count", shape["heads"])
    w.add_uint32("llama.attention.head_count_kv", shape["kv_heads"])
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_uint32("llama.context_length", 2048)
    w.add_uint32("llama.vocab_size", shape["vocab"])

    def add(name, rows, cols, t, scale):
        data = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if t.name.endswith("_K"):                   # gguf-py has no K-quant quantizer: quanta's, llama.cpp's bytes
            from quanta.quant.ggml.quantize import quantize
            raw = quantize(torch.from_numpy(data), t.name.lower().replace("_k", "_K")).data.numpy()
            w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=t)
        else:
            w.add_tensor(name, quants.quantize(data, t), raw_dtype=t)

    add("token_embd.weight", shape["vocab"], shape["hidden"], embed_type, 0.5)
    for layer in range(shape["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(shape["hidden"], dtype=np.float32))
        for name, (rows, cols) in LINEARS.items():
            add(f"blk.{layer}.{name}.weight", dims[rows], dims[cols], (types or {}).get(name, linear_type),
                0.5 / dims[cols] ** 0.5)
    w.add_tensor("output_norm.weight", np.ones(shape["hidden"], dtype=np.float32))
    if output_type is not None:
        add("output.weight", shape["vocab"], shape["hidden"], output_type, 0.5 / shape["hidden"] ** 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def held_on_the_gpu(path) -> int:
    """GPU bytes the model's weights take once built from `path` in fp16 on the Triton kernels."""
    from quanta.engine.model_loader import build_model
    from quanta.loaders import load
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    held = build_model(load(str(path), tokenizer=False), torch.device("cuda"), torch.float16, triton=True, quiet=True)
    weights = torch.cuda.memory_allocated() - before
    del held
    return weights


def test_a_gguf_without_tokenizer_loads_and_takes_token_ids(tmp_path):
    from quanta.engine import LLM, SamplingParams
    llm = LLM(model=str(write_model(tmp_path / "tiny.gguf", TINY)), device="cpu", quiet=True)
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_default_model_shape_runs_packed_on_the_affine_kernels(tmp_path):
    from quanta.engine import LLM
    from quanta.planner.memory_plan import plan
    path = write_model(tmp_path / "smollm2-shape.gguf", SMOLLM2)
    file_bytes = path.stat().st_size
    weights = held_on_the_gpu(path)
    # Held as stored, up to the kernel layout's padding of K to whole tiles (576 columns take 640 in 4-bit
    # tiles of 128), plus the tied lm_head's packed second copy of the Q8_0 table: what `quanta plan` predicts.
    predicted = plan(str(path), gpus="1x80GiB", dtype="float16").weights
    assert abs(weights - predicted.total) <= 0.02 * predicted.total, (weights, predicted)
    assert predicted.total - predicted.lm_head <= 1.10 * file_bytes, (predicted, file_bytes)

    llm = LLM(model=str(path), dtype="float16", num_kv_blocks=64, max_model_len=512, enforce_eager=True, quiet=True)
    kernels = {row["name"]: row for row in llm.kernels(m=(1, 16, 256))}
    linears = [r for n, r in kernels.items() if n.startswith("model.layers.")]
    assert len(linears) == 30 * 4 and all(r["kernel"] == "triton_affine" for r in linears)
    assert kernels["lm_head"]["kernel"] == "triton_affine"              # the tied Q8_0 table, packed
    exact = LLM(model=str(path), dtype="float16", kernel="dequantized", num_kv_blocks=64, max_model_len=512,
                enforce_eager=True, quiet=True)
    ids = torch.randint(3, SMOLLM2["vocab"], (48,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = llm.prompt_logits(ids), exact.prompt_logits(ids)
    assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item()

    report = subprocess.run([sys.executable, "-m", "quanta.cli.main", "-q", "inspect", str(path), "--json",
                             "--device", "cuda"], capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr
    info = json.loads(report.stdout)
    assert info["kernels"] and all("triton_affine" in what for what in info["kernels"]), info["kernels"]


# A Q4_K_M-like mix at widths that K-quant blocks tile: q, k, o, gate, up Q4_K; v and down Q6_K; a Q6_K output.
KMIX_SHAPE = dict(vocab=8192, hidden=1024, inter=2816, layers=4, heads=16, kv_heads=4)
KMIX = {"attn_v": T.Q6_K, "ffn_down": T.Q6_K}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_k_quant_mix_runs_at_its_bytes_on_the_ggml_kernels(tmp_path):
    """Every linear and the quantized output.weight run on triton_ggml at the blocks' bytes (what `quanta plan`
    counts, within 3%), and the greedy tokens and logits agree with the same file dequantized once to 16 bits."""
    from quanta.engine import LLM, SamplingParams
    from quanta.planner.memory_plan import plan
    path = write_model(tmp_path / "kmix.gguf", KMIX_SHAPE, linear_type=T.Q4_K, embed_type=T.Q4_K, types=KMIX,
                       output_type=T.Q6_K)
    weights = held_on_the_gpu(path)
    predicted = plan(str(path), gpus="1x80GiB", dtype="float16").weights
    assert abs(weights - predicted.total) <= 0.03 * predicted.total, (weights, predicted)
    assert weights <= 1.03 * path.stat().st_size

    flags = dict(dtype="float16", num_kv_blocks=64, max_model_len=512, enforce_eager=True, quiet=True)
    llm = LLM(model=str(path), **flags)
    kernels = {row["name"]: row for row in llm.kernels(m=(1, 16, 512))}
    assert all(r["kernel"] == "triton_ggml" for n, r in kernels.items() if n.startswith("model.layers.")), kernels
    assert kernels["lm_head"]["kernel"] == "triton_ggml"
    exact = LLM(model=str(path), kernel="dequantized", **flags)
    ids = torch.randint(3, KMIX_SHAPE["vocab"], (300,), generator=torch.Generator().manual_seed(0)).tolist()
    ours, ref = llm.prompt_logits(ids), exact.prompt_logits(ids)          # 300 rows: the cuBLAS path too
    assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [ids[:8], ids[8:40]]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in exact.generate(prompts, greedy, use_tqdm=False)]
