"""Prefill on the CPU: quanta against llama.cpp (llama-cpp-python) on the same GGUF, each engine in its own
process one after the other, and how soon a short request gets its first token through `quanta serve` while a
long prompt is being prefilled.

    python benchmarks/cpu_prefill.py [--model PATH] [--lengths 512 8000] [--runs 3] [--threads 2] --out r.json

Prefill time is the time to the first token of a request of N random token ids with max_tokens=1 (median of
the runs, after a warm-up). quanta runs with its CPU defaults (prefix caching off, so every run computes the
whole prompt); llama.cpp runs at each n_batch of --llama-batches and the best is kept (its prefill speed
depends on it). The concurrent figure: a long prompt sent to `quanta serve` with its defaults, and
--probes requests of 4 tokens sent during its prefill, one after another; each probe's time to its first
streamed token is reported, with the long prompt's own time to first token.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_server  # noqa: E402
from bench_io import emit  # noqa: E402


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run_quanta(args) -> dict:
    """Seconds to the first token at each length, quanta's offline engine in this process."""
    import torch
    from quanta.engine import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu", max_model_len=max(args.lengths) + 16, enable_prefix_caching=False,
              quiet=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate({"prompt_token_ids": prompt_ids(64, 1)}, one, use_tqdm=False)
    out = {"max_num_batched_tokens": llm.core.config.max_num_batched_tokens}
    for n in args.lengths:
        times = []
        for run in range(args.runs):
            start = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt_ids(n, 100 + run)}, one, use_tqdm=False)
            times.append(time.perf_counter() - start)
        out[str(n)] = times
    return out


def run_llama_cpp(args) -> dict:
    """Seconds to evaluate each prompt in llama.cpp, at each n_batch, in this process."""
    from llama_cpp import Llama
    out = {"llama_cpp": __import__("llama_cpp").__version__}
    for batch in args.llama_batches:
        llm = Llama(args.model, n_ctx=max(args.lengths) + 16, n_threads=args.threads, n_threads_batch=args.threads,
                    n_batch=batch, n_ubatch=batch, verbose=False)
        llm.eval(prompt_ids(64, 1))
        for n in args.lengths:
            times = []
            for run in range(args.runs):
                llm.reset()
                start = time.perf_counter()
                llm.eval(prompt_ids(n, 100 + run))
                times.append(time.perf_counter() - start)
            out[f"{n}@{batch}"] = times
        del llm
    return out


def concurrent(args) -> dict:
    """The long prompt through `quanta serve` (a thread), probes of 4 tokens sent while it runs."""
    proc, url = local_server.start(args.model, ["--device", "cpu", "--max-model-len", str(args.long + 16),
                                                "--no-prefix-caching"])
    try:
        http = httpx.Client(base_url=url, timeout=600)
        name = http.get("/v1/models").json()["data"][0]["id"]

        def first_token(ids: list[int]) -> float:
            start = time.perf_counter()
            body = {"model": name, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        return time.perf_counter() - start
            raise SystemExit("no token streamed")

        first_token(prompt_ids(16, 2))                                        # warm-up
        long_ttft = []
        worker = threading.Thread(target=lambda: long_ttft.append(first_token(prompt_ids(args.long, 3))))
        worker.start()
        time.sleep(args.probe_after)
        probes = []
        while worker.is_alive() and len(probes) < args.probes:
            probes.append(first_token(prompt_ids(4, 10 + len(probes))))
            time.sleep(1.0)
        worker.join()
        return {"long_tokens": args.long, "long_ttft_s": long_ttft[0], "probe_ttft_s": probes}
    finally:
        local_server.stop(proc)


def child(args, engine: str) -> dict:
    """Run one engine's part in a fresh process and read its JSON."""
    cmd = [sys.executable, __file__, "--engine", engine, "--model", args.model, "--runs", str(args.runs),
           "--threads", str(args.threads), "--lengths", *map(str, args.lengths),
           "--llama-batches", *map(str, args.llama_batches)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": str(args.threads)})
    if done.returncode:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 8000])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-batches", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--long", type=int, default=8000, help="the long prompt of the concurrent run")
    p.add_argument("--probes", type=int, default=5)
    p.add_argument("--probe-after", type=float, default=3.0, help="seconds into the long prefill of the first probe")
    p.add_argument("--engine", choices=("quanta", "llama.cpp"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model is None:
        from quanta.cli.default_model import default_model_path
        args.model = str(default_model_path())
    if args.engine:
        print(json.dumps(run_quanta(args) if args.engine == "quanta" else run_llama_cpp(args)))
        return
    quanta, llama = child(args, "quanta"), child(args, "llama.cpp")
    rows = []
    for n in args.lengths:
        ours = statistics.median(quanta[str(n)])
        best = min(args.llama_batches, key=lambda b: statistics.median(llama[f"{n}@{b}"]))
        peer = statistics.median(llama[f"{n}@{best}"])
        rows.append({"tokens": n, "quanta_s": round(ours, 2), "quanta_tok_s": round(n / ours),
                     "llama_cpp_s": round(peer, 2), "llama_cpp_tok_s": round(n / peer), "llama_cpp_n_batch": best,
                     "ratio": round(peer / ours, 2)})
    result = {"model": Path(args.model).name, "threads": args.threads, "cpu": platform.processor() or platform.machine(),
              "date": time.strftime("%Y-%m-%d"), "quanta_max_num_batched_tokens": quanta["max_num_batched_tokens"],
              "llama_cpp": llama["llama_cpp"], "prefill": rows, "raw": {"quanta": quanta, "llama.cpp": llama},
              "concurrent": concurrent(args)}
    emit(result, args.out)
    print(f"{'tokens':>7} {'quanta s':>9} {'tok/s':>6} {'llama.cpp s':>12} {'tok/s':>6} {'quanta/llama.cpp':>17}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['quanta_s']:>9} {r['quanta_tok_s']:>6} {r['llama_cpp_s']:>12} "
              f"{r['llama_cpp_tok_s']:>6} {r['ratio']:>17}")
    c = result["concurrent"]
    print(f"concurrent: {c['long_tokens']}-token prompt first token {c['long_ttft_s']:.1f} s; 4-token requests "
          f"meanwhile: {', '.join(f'{t:.2f}' for t in c['probe_ttft_s'])} s")


if __name__ == "__main__":
    main()
