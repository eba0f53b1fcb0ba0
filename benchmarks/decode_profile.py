"""Where a batch-1 decode token's time goes on this process's GPU: torch.profiler (CUPTI) over a greedy
generation, kernels inside CUDA graph replays included.

    decode_profile(llm, tokens=64) -> {"wall_ms_per_token", "kernel_ms_per_token", "busy_ms_per_token",
                                       "idle_ms_per_token",
                                       "top": [[kernel, µs per token, exclusive µs per token, calls per token]]}

kernel_ms sums every kernel's duration; busy_ms is the union of their intervals (what overlaps counts once);
idle_ms = wall - busy is the GPU waiting on the host. A kernel's exclusive time is the part of the busy union
that ends with it: from the latest end of the kernels before it (or its start) to its own end. Under
programmatic dependent launch a kernel starts while its predecessor runs and waits for it, so its duration
holds that wait and its exclusive time does not; the exclusive times add up to busy_ms. Under tensor
parallelism this is rank 0's GPU, whose all-reduce kernels include the time spent waiting for the slowest peer.
"""
from __future__ import annotations

import collections
import json
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from quanta.engine import SamplingParams


def _exclusive_us(intervals: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per name, the part of the intervals' union that each of its intervals adds, in start order."""
    out, end = collections.defaultdict(float), float("-inf")
    for s, e, name in sorted(intervals):
        if e > end:
            out[name] += e - max(s, end)
            end = e
    return out


def decode_profile(llm, tokens: int = 64, top: int = 14, lora_request=None, by_grid: bool = False) -> dict:
    """`by_grid`: a kernel launched with several grids (one kernel for several weight shapes) is a row per grid,
    read from the profiler's chrome trace, which holds each launch's grid and block."""
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(32)]}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False, lora_request=lora_request)      # warm-up outside the trace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False, lora_request=lora_request)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    intervals = _grid_intervals(prof) if by_grid else kernel_intervals(prof)
    total, busy, rows = kernel_table(intervals, tokens, top)
    return {"tokens": tokens, "wall_ms_per_token": round(wall * 1e3 / tokens, 3),
            "kernel_ms_per_token": round(total / 1e3 / tokens, 3), "busy_ms_per_token": round(busy / 1e3 / tokens, 3),
            "idle_ms_per_token": round((wall * 1e6 - busy) / 1e3 / tokens, 3), "top": rows}


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in µs of every GPU activity of a torch.profiler run."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(intervals: list[tuple[float, float, str]], per: float, top: int) -> tuple[float, float, list]:
    """(the kernels' summed µs, their busy union's µs, the `top` rows by exclusive time: [name, µs, exclusive µs,
    calls], each over `per`)."""
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for s, e, name in intervals:
        by_name[name][0] += e - s
        by_name[name][1] += 1
    exclusive = _exclusive_us(intervals)
    ranked = sorted(by_name.items(), key=lambda kv: -exclusive[kv[0]])[:top]
    return (sum(v[0] for v in by_name.values()), sum(exclusive.values()),
            [[name[:90], round(us / per, 1), round(exclusive[name] / per, 1), round(n / per, 1)]
             for name, (us, n) in ranked])


def _grid_intervals(prof) -> list[tuple[float, float, str]]:
    """(start, end, "kernel grid=[..] block=[..]") in µs of every kernel of the profile's chrome trace."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return [(e["ts"], e["ts"] + e["dur"], f"{e['name'][:40]} grid={e['args'].get('grid')} "
             f"block={e['args'].get('block')}") for e in events if e.get("cat") == "kernel"]


def print_profile(p: dict) -> None:
    """decode_profile's result as a table: µs per token of each kernel, in all and exclusive, and calls."""
    print(f"per token: wall {p['wall_ms_per_token']} ms, GPU busy {p['busy_ms_per_token']} ms, "
          f"idle {p['idle_ms_per_token']} ms, kernels' durations {p['kernel_ms_per_token']} ms")
    print(f"{'us':>9} {'excl us':>9} {'calls':>6}  kernel")
    for name, us, excl, calls in p["top"]:
        print(f"{us:9.1f} {excl:9.1f} {calls:6.1f}  {name}")
