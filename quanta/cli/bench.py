"""`quanta bench MODEL [MODEL ...]`: which format should I run? Each format's memory, KV capacity, decode speed,
time to first token, throughput (and quality against --reference) on one engine, with the peers at their best.

    quanta bench llama-3-8b --formats awq,gptq,gguf:Q4_K_M,fp16 --peers transformers,transformers-bnb --out bench/
    quanta bench path/to/model.gguf --formats awq,gguf:Q8_0 --reference path/to/model.gguf --out bench/

Known shapes run on synthetic weights at that shape; checkpoints run as they are and converted into each format.
On a CPU the sizes default to a quick run (short prompts, few requests).
"""
from __future__ import annotations

import argparse
import sys

from quanta.cli.options import quiet_parent

SIZES = ("decode_input", "decode_output", "ttft_input", "num_prompts", "throughput_input", "throughput_output",
         "runs", "windows", "ctx")


def cmd_bench(args) -> None:
    import torch

    from quanta.toolkit.bench.measure import Settings
    from quanta.toolkit.bench.pipeline import bench

    given = {k: getattr(args, k) for k in SIZES if getattr(args, k) is not None}
    common = dict(device=args.device, budgets=tuple(b.strip() for b in args.budget.split(",") if b.strip()),
                  kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization, **given)
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    settings = Settings(**common) if gpu else Settings.small(**common)
    result = bench(args.models, formats=args.formats, peers=args.peers, settings=settings, reference=args.reference,
                   out=args.out, quiet=args.quiet, command="quanta bench " + " ".join(sys.argv[2:]))
    print(result.table)
    for path in result.files:
        print(f"wrote {path}")


def register(sub: argparse._SubParsersAction) -> None:
    from quanta.toolkit.bench.names import DEFAULT_FORMATS, PEERS

    p = sub.add_parser("bench", help="compare formats: memory, speed and quality on one engine, with peers",
                       parents=[quiet_parent()])
    p.add_argument("models", nargs="+", help="known shapes (llama-3-8b, ...) or checkpoints (GGUF file, HF directory)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="comma list of bench formats "
                   f"(default {','.join(DEFAULT_FORMATS)})")
    p.add_argument("--peers", default="none", help=f"comma list of {', '.join(PEERS)}, or none")
    p.add_argument("--budget", default="24GiB,16GiB", help="GPU budgets for the KV capacity columns (the plan)")
    p.add_argument("--reference", help="a checkpoint to measure each real variant's quality against")
    p.add_argument("--out", help="folder for bench.json, bench.md and the charts")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    for size in SIZES:
        p.add_argument("--" + size.replace("_", "-"), type=int, default=None)
    p.set_defaults(func=cmd_bench)
