"""The server's overhead on a CPU: the same requests through offline LLM.generate and through `quanta serve`
at saturation (all requests at once), on a model whose step is cheap so that the Python work around the
step (scheduling, bookkeeping, HTTP, JSON, SSE) decides the throughput, as it does on a GPU.

    python benchmarks/serving_overhead.py --model synthetic:tiny --num-prompts 512 --input-len 64 \
        --output-len 64 --max-num-seqs 256 [--serve-flag=--no-prefix-caching ...] --out result.json

Both sides run the requests of benchmarks/serving.py's generator (same seed, same token ids), greedy with
ignore_eos. Besides output tokens/s it reports CPU seconds per 1000 output tokens of each process (the
offline run; the server process and its children; the load generator), which stays meaningful on a
loaded machine where wall-clock throughput does not: a server whose work runs under one GIL can go no
faster than 1 / (its CPU per token), one that spreads it over processes as fast as its busiest process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_server  # noqa: E402
import serving  # noqa: E402  (benchmarks/serving.py: the load generator and its request lengths)



def requests(args) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, exactly as serving.run draws them."""
    rng = random.Random(args.seed)
    return [([rng.randrange(args.vocab_low, args.vocab_high) for _ in range(i)], o)
            for i, o in serving.lengths(args, rng)]


def engine_flags(args) -> dict:
    return {"device": "cpu", "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}


def offline(args) -> dict:
    """LLM.generate over every request at once, after a small warm-up; wall and CPU time."""
    import torch
    from quanta.engine import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quiet=True, **engine_flags(args))
    work = requests(args)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in work]
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    me = psutil.Process()
    cpu0, start = sum(me.cpu_times()[:2]), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, sum(me.cpu_times()[:2]) - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.close()
    return {"output_tokens": tokens, "duration_s": wall, "output_throughput": tokens / wall,
            "cpu_s_per_1k_tokens": 1e3 * cpu / tokens}


def server(args) -> dict:
    """`quanta serve` on a free port, loaded by serving.run at request rate inf."""
    flags = engine_flags(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc, url = local_server.start(args.model, ["--device", flags["device"], "--max-num-seqs", str(flags["max_num_seqs"]),
                                               "--max-model-len", str(flags["max_model_len"]), *args.serve_flag],
                                   env=env, log=None, ready_s=300)
    try:
        load = argparse.Namespace(**vars(args))
        load.base_url, load.request_rate, load.arrivals, load.api_key, load.timeout = url, float("inf"), "poisson", None, 3600
        load.model, load.server_pid = None, proc.pid
        spy = None if not args.py_spy else subprocess.Popen(
            ["py-spy", "record", "--subprocesses", "--nonblocking", "-f", "raw", "-o", args.py_spy, "-p", str(proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = asyncio.run(serving.run(load))
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
    finally:
        local_server.stop(proc)
    return {k: result[k] for k in ("completed", "failed", "errors", "duration_s", "total_output_tokens",
                                   "output_throughput", "ttft", "tpot", "server_cpu_s_per_1k_tokens",
                                   "client_cpu_s_per_1k_tokens")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=500, help="prompt ids are drawn from [low, high)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (the model is tiny)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--serve-flag", action="append", default=[], help="extra `quanta serve` flag (repeatable)")
    p.add_argument("--py-spy", default=None, help="profile the server under load into this file "
                                                  "(py-spy's raw collapsed stacks; py-spy on PATH)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.dataset, args.range_ratio, args.max_len = "random", 0.0, 2048
    result = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "max_num_seqs": args.max_num_seqs}
    if not args.skip_offline:
        result["offline"] = offline(args)
        print(json.dumps(result["offline"]), flush=True)
    result["server"] = server(args)
    if not args.skip_offline:
        result["server_over_offline"] = result["server"]["output_throughput"] / result["offline"]["output_throughput"]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
