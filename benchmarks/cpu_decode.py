"""Decode speed of a model on the CPU: tokens/s of greedy generation at batch 1.

    python benchmarks/cpu_decode.py [--model PATH] [--tokens 128] [--runs 3] [--llama-cpp]

Reports decode tokens/s (median over runs), with the kernel used by each quantized layer kind, as JSON on the
last line. --llama-cpp also runs llama.cpp (llama-cpp-python, greedy, the same prompt and token count) on the
same GGUF in a process of its own, after quanta's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from quanta.engine import LLM, SamplingParams
from quanta.cli.default_model import default_model_path


PROMPT = "The history of the Roman Empire begins with"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp on the same GGUF")
    ap.add_argument("--engine", choices=("llama.cpp",), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(llama_cpp_decode(args)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=str(args.model or default_model_path()), dtype=args.dtype, device="cpu")
    prompt = PROMPT
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
    if args.llama_cpp:
        cmd = [sys.executable, __file__, "--engine", "llama.cpp", "--model", str(args.model or default_model_path()),
               "--tokens", str(args.tokens), "--runs", str(args.runs), "--threads", str(torch.get_num_threads())]
        del llm
        done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode:
            raise SystemExit(f"llama.cpp failed:\n{done.stderr[-3000:]}")
        result["llama_cpp"] = json.loads(done.stdout.strip().splitlines()[-1])
        result["ratio"] = round(result["tokens_per_s_median"] / result["llama_cpp"]["tokens_per_s_median"], 2)
    print(json.dumps(result))


def llama_cpp_decode(args) -> dict:
    """llama.cpp's greedy decode tokens/s on the same prompt, in this process."""
    import llama_cpp
    llm = llama_cpp.Llama(args.model, n_ctx=512, n_threads=args.threads or 2, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())
    llm.eval(prompt[:4])
    rates = []
    for _ in range(args.runs):
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(args.tokens):
            token = llm.sample(temp=0.0)
            llm.eval([token])
        rates.append(args.tokens / (time.perf_counter() - start))
    return {"llama_cpp": llama_cpp.__version__, "tokens_per_s_median": round(statistics.median(rates), 2),
            "tokens_per_s_runs": [round(r, 2) for r in rates]}


if __name__ == "__main__":
    main()
