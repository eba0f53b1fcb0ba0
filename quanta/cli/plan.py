"""`quanta plan MODEL`: will it fit, before anything is downloaded or loaded.

MODEL is a known shape (llama-3-8b, qwen2.5-7b, ...), a config.json, a checkpoint directory or a GGUF
file. The report gives, per GPU, the weights by part, the activation peak, the CUDA-graph and runtime
headroom and the KV cache (bytes per token, capacity in tokens, sequences of max-model-len at once),
then the verdict and, when it does not fit, the single changes that would make it fit. --json prints
the same plan as one JSON object for tools.
"""
from __future__ import annotations

import argparse
import json

GIB = 2**30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def print_report(p) -> None:
    """The human-readable plan, ending with format_verdict's words."""
    from quanta.planner.memory_plan import format_verdict

    w = p.weights
    print(f"{p.model}: {p.quantization} on {p.gpus} ({_gib(p.gpu_memory)} each), "
          f"tensor-parallel size {p.tensor_parallel_size}")
    print(f"  budget per GPU   {_gib(p.budget)} ({p.budget / p.gpu_memory:.2g} of {_gib(p.gpu_memory)})")
    print(f"  weights          {_gib(w.total)} (embedding {_gib(w.embedding)}, linears {_gib(w.linears)}, "
          f"lm_head {_gib(w.lm_head)}, norms {_gib(w.norms)})")
    print(f"  load peak        {_gib(p.load_peak)} (while loading: the weights so far + one module's canonical form)")
    print(f"  activation peak  {_gib(p.activation_peak)}")
    print(f"  CUDA graphs      {_gib(p.cuda_graphs)}")
    print(f"  runtime          {_gib(p.runtime_overhead)}")
    if p.lora_slots:
        print(f"  LoRA slots       {_gib(p.lora_slots)}")
    print(f"  KV cache         {_gib(p.kv_cache_bytes)} at {p.kv_bytes_per_token:,} bytes per token "
          f"({p.kv_cache_dtype}): {p.kv_capacity_tokens:,} tokens, {p.max_concurrent_seqs} sequences of "
          f"{p.max_model_len:,} tokens at once")
    for note in p.notes:
        print(f"  note: {note}")
    print(format_verdict(p))
    for s in p.suggestions:
        print(f"  would fit with {s.what}: {s.kv_capacity_tokens:,} tokens of KV cache, "
              f"{s.max_concurrent_seqs} sequences at once")


def cmd_plan(args) -> None:
    from dataclasses import fields

    from quanta.planner.memory_plan import plan
    from quanta.planner.request import PlanRequest

    p = plan(args.model, PlanRequest(**{f.name: getattr(args, f.name) for f in fields(PlanRequest)}))
    if args.json:
        print(json.dumps(p.to_dict(), indent=2))
    else:
        print_report(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="will a model fit: weights, activations and KV capacity per GPU")
    p.add_argument("model", help="known shape (llama-3-8b, qwen2.5-7b, ...), config.json, checkpoint or GGUF")
    p.add_argument("--quantization", default="auto",
                   help="auto (the checkpoint's), fp16, bf16, fp32, awq, gptq, nf4, fp8, gguf:TYPE (e.g. gguf:Q4_K_M)")
    p.add_argument("--bits", type=int, default=None, help="awq / gptq bits (default 4)")
    p.add_argument("--group-size", type=int, default=None, help="awq / gptq group (default 128; -1 per channel), "
                                                                "nf4 blocksize (default 64)")
    p.add_argument("--gpus", default="1x80GiB",
                   help="NxSIZE (1x80GiB, 4x24GiB, 2x16GB) or [Nx]NAME (t4, l4, a10g, rtx3090, rtx4090, "
                        "a100-40gb, a100-80gb, h100, h200)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    p.add_argument("--tensor-parallel-size", type=int, default=None, help="default: the number of GPUs")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-gpu-memory", default=None,
                   help="cap each GPU's budget (15GiB, or a card name such as t4), as LLM(max_gpu_memory=...)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (no graph headroom)")
    p.add_argument("--enable-lora", action="store_true", help="count LoRA adapter slots")
    p.add_argument("--max-loras", type=int, default=1, help="adapter slots (with --enable-lora)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the slots' rank (with --enable-lora)")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.set_defaults(func=cmd_plan)
