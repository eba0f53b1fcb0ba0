"""Online serving latency and throughput, in the manner of vLLM's benchmark_serving: requests arrive at a
fixed rate, as a Poisson process, or all at once, under a concurrency cap, against a running
`quanta serve` (or any OpenAI-compatible /v1/completions); TTFT, TPOT, ITL and end-to-end latency
(mean, median, p99), requests/s and output tokens/s, as JSON.

With --server-pid it also reports CPU seconds per 1000 output tokens of the server's process and each of its
children (the engine process) beside its own: the busiest process bounds what a saturated server can deliver.
The client is aiohttp, as benchmark_serving's: at saturation a load generator in one Python process reads
thousands of streamed chunks a second, and httpx's per-chunk cost made the generator, not the server, the
slowest process (serving_overhead.py reports each process's CPU per token).

    quanta serve synthetic:llama3-8b:w4g128 --port 8000 &
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 500 \
        --request-rate 8 --max-concurrency 256 --input-len 512 --output-len 128 --out result.json

Prompts are random token ids (no tokenizer needed), streamed with ignore_eos so each request makes
exactly its output length. --dataset sharegpt-like samples input/output lengths from log-normal laws
with ShareGPT's means instead of the fixed --input-len / --output-len (± --range-ratio). TPOT is
(latency - TTFT) / (output tokens - 1) per request; ITL is the gap between streamed chunks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp
import psutil

SHAREGPT_MEAN_IN, SHAREGPT_MEAN_OUT = 202, 179     # ShareGPT's mean prompt / output tokens (vLLM's blog)


def lengths(args, rng: random.Random) -> list[tuple[int, int]]:
    """(input, output) token counts of each request."""
    def around(mean: int) -> int:
        if args.dataset == "sharegpt-like":
            return max(4, min(args.max_len, int(rng.lognormvariate(0, 0.8) * mean / 1.377)))   # e^(0.8²/2)
        return rng.randint(max(1, int(mean * (1 - args.range_ratio))), int(mean * (1 + args.range_ratio)))
    return [(around(args.input_len if args.dataset == "random" else SHAREGPT_MEAN_IN),
             around(args.output_len if args.dataset == "random" else SHAREGPT_MEAN_OUT))
            for _ in range(args.num_prompts)]


async def one(http: aiohttp.ClientSession, args, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; its TTFT, chunk gaps, latency and output tokens."""
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}       # chunks carry their tokens, so a model without a tokenizer streams too
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with http.post(args.base_url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"ok": False, "error": (await r.read()).decode()[:200]}
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        return {"ok": False, "error": "no output"}
    return {"ok": True, "ttft": stamps[0] - start, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "latency": end - start, "output_tokens": tokens, "input_tokens": len(prompt)}


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a process and of each of its live children, by "pid:name"."""
    proc = psutil.Process(pid)
    out = {}
    for p in [proc] + proc.children(recursive=True):
        try:
            out[f"{p.pid}:{p.name()}"] = sum(p.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def summary(values: list[float]) -> dict:
    """Mean, median and p99 in milliseconds."""
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * p99}


async def run(args) -> dict:
    rng = random.Random(args.seed)
    work = [([rng.randrange(args.vocab_low, args.vocab_high) for _ in range(i)], o) for i, o in lengths(args, rng)]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.max_concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=args.timeout)) as http:
        if args.model is None:
            async with http.get(args.base_url + "/v1/models") as r:
                args.model = (await r.json())["data"][0]["id"]
        await one(http, args, work[0][0], 4)                         # warm-up, not counted
        gate = asyncio.Semaphore(args.max_concurrency)

        async def capped(prompt, out):
            async with gate:
                return await one(http, args, prompt, out)

        server0 = tree_cpu(args.server_pid) if getattr(args, "server_pid", None) else {}
        client0 = time.process_time()
        tasks, start = [], time.perf_counter()
        for prompt, out in work:
            tasks.append(asyncio.create_task(capped(prompt, out)))
            if args.request_rate != float("inf"):
                gap = rng.expovariate(args.request_rate) if args.arrivals == "poisson" else 1 / args.request_rate
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - client0
        server1 = tree_cpu(args.server_pid) if server0 else {}
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_tokens"] for r in ok)
    per_1k = 1e3 / max(out_tokens, 1)
    tpot = [(r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {"base_url": args.base_url, "model": args.model, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate, "arrivals": args.arrivals, "max_concurrency": args.max_concurrency,
            "dataset": args.dataset, "completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:5],
            "duration_s": duration, "total_input_tokens": sum(r["input_tokens"] for r in ok),
            "total_output_tokens": out_tokens, "request_throughput": len(ok) / duration,
            "output_throughput": out_tokens / duration,
            "ttft": summary([r["ttft"] for r in ok]), "tpot": summary(tpot),
            "itl": summary([g for r in ok for g in r["itl"]]), "e2el": summary([r["latency"] for r in ok]),
            "client_cpu_s_per_1k_tokens": client_cpu * per_1k,
            "server_cpu_s_per_1k_tokens": {k: (v - server0.get(k, 0.0)) * per_1k for k, v in server1.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-pid", type=int, default=None, help="report this process' and its children's CPU "
                                                                "time per 1000 output tokens")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    p.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--dataset", choices=("random", "sharegpt-like"), default="random")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--max-len", type=int, default=2048, help="cap on sampled sharegpt-like lengths")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=20000, help="prompt ids are drawn from [low, high)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON here as well")
    args = p.parse_args()
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
