"""LoRA over a quantized base (issue 47's figures): offline throughput of a batch with N adapters spread over its
requests against the same batch on an engine without LoRA, and batch-1 decode with one adapter against none.

    python benchmarks/lora_throughput.py --model synthetic:llama3-8b:w4g128 --adapters 8 --rank 16 \
        --batch 64 --input-len 512 --output-len 128 --out lora.json

Adapters are written as peft checkpoints (adapter_config.json + adapter_model.safetensors) with random A and B
for every linear of every layer, at the model's shapes, in a scratch directory. Both engines are alive at once
(0.45 of the GPU's memory each); after a whole batch on each, their batch runs alternate. Throughputs are medians
of --runs generate calls. JSON on the last line.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_io import emit
from decode_profile import decode_profile, print_profile
from throughput import model_shape

from quanta.engine import LLM, SamplingParams
from quanta.kernels import lora_epilogue
from quanta.lora.request import LoRARequest

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(path: Path, shape: dict, rank: int, seed: int) -> None:
    """A random rank-`rank` peft LoRA over every linear of a llama of `shape`, in float16."""
    from safetensors.torch import save_file
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for block, names in TARGETS.items():
            for name in names:
                k, n = dims[name]
                stem = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, k, generator=g) / k ** 0.5).half()
                tensors[f"{stem}.lora_B.weight"] = (0.01 * torch.randn(n, rank, generator=g)).half()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [n for names in TARGETS.values() for n in names], "task_type": "CAUSAL_LM"}))


def requests(n: int, input_len: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, vocab - 10, (input_len,), generator=g).tolist()} for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds(llm: LLM, prompts, params, loras) -> float:
    """Seconds of one generate call."""
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    sync()
    return time.perf_counter() - start


def timed(llm: LLM, prompts, params, loras, runs: int) -> float:
    """Median seconds of one generate call (after a warm-up call)."""
    llm.generate(prompts[:2], params, use_tqdm=False, lora_request=None if loras is None else loras[:2])
    return statistics.median(seconds(llm, prompts, params, loras) for _ in range(runs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:llama3-8b:w4g128")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rank-chunk", type=int, default=None,
                   help="B's rank columns a GEMV epilogue step reads (lora_epilogue.RANK_CHUNK; a sweep)")
    p.add_argument("--profile", action="store_true", help="also where a batch-1 token's time goes (decode_profile)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.rank_chunk:
        lora_epilogue.RANK_CHUNK = args.rank_chunk
    shape = model_shape(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    loras = []
    for i in range(args.adapters):
        write_adapter(scratch / f"a{i}", shape, args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(scratch / f"a{i}")))
    prompts = requests(args.batch, args.input_len, shape["vocab_size"])
    batch = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=args.decode_len, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    spread = [loras[i % len(loras)] for i in range(args.batch)]
    common = dict(max_num_seqs=args.batch, quiet=True)
    result = {"model": args.model, "adapters": args.adapters, "rank": args.rank, "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "rank_chunk": lora_epilogue.RANK_CHUNK,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    configs = {"base": ({}, None, None),
               "lora": (dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank), spread, loras[0])}
    # both engines live side by side and their batch runs alternate, so a drift of the machine's clocks or memory
    # during the minutes of the run falls on both alike
    engines = {name: LLM(args.model, **common, **kwargs, gpu_memory_utilization=0.45)
               for name, (kwargs, _, _) in configs.items()}
    batch_times = {name: [] for name in engines}
    prefill_times = {name: [] for name in engines}
    for name, llm in engines.items():
        seconds(llm, prompts, batch, configs[name][1])          # a whole batch first: adapters read, kernels built
    for _ in range(args.runs):
        for name, llm in engines.items():
            batch_times[name].append(seconds(llm, prompts, batch, configs[name][1]))
            prefill_times[name].append(seconds(llm, prompts, first, configs[name][1]))
    for name, llm in engines.items():
        _, batch_loras, one = configs[name]
        result[f"{name}_batch_tok_s"] = args.batch * args.output_len / statistics.median(batch_times[name])
        result[f"{name}_batch_runs_s"] = batch_times[name]
        # the batch's prefill (one token each) apart from its decode steps
        result[f"{name}_batch_prefill_s"] = statistics.median(prefill_times[name])
        result[f"{name}_batch_decode_step_ms"] = 1e3 * (statistics.median(batch_times[name])
                                                        - result[f"{name}_batch_prefill_s"]) / (args.output_len - 1)
        whole = timed(llm, prompts[:1], decode, None if one is None else [one], args.runs)
        prefill = timed(llm, prompts[:1], first, None if one is None else [one], args.runs)
        result[f"{name}_decode_tok_s"] = (args.decode_len - 1) / (whole - prefill)
        if args.profile:
            result[f"{name}_profile"] = decode_profile(llm, top=24, lora_request=one)
            print(f"== {name}, batch 1" + ("" if one is None else ", one adapter"))
            print_profile(result[f"{name}_profile"])
            if one is not None:
                result[f"{name}_no_adapter_profile"] = decode_profile(llm, top=24)
                print(f"== {name}, batch 1, no adapter")
                print_profile(result[f"{name}_no_adapter_profile"])
        if name == "lora":
            result["lora_slot_bytes"] = llm.memory()["lora_slots"]
            unadapted = timed(llm, prompts, batch, None, args.runs)
            result["lora_engine_no_adapter_batch_tok_s"] = args.batch * args.output_len / unadapted
    for llm in engines.values():
        llm.close()
    result["batch_ratio"] = result["lora_batch_tok_s"] / result["base_batch_tok_s"]
    result["decode_ratio"] = result["lora_decode_tok_s"] / result["base_decode_tok_s"]
    result["batch_prefill_ratio"] = result["base_batch_prefill_s"] / result["lora_batch_prefill_s"]
    result["batch_decode_ratio"] = result["base_batch_decode_step_ms"] / result["lora_batch_decode_step_ms"]
    emit(result, args.out)


if __name__ == "__main__":
    main()
