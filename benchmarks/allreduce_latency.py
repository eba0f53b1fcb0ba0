"""Latency of the small all-reduces tensor-parallel decode makes (one [batch, hidden] fp16 row block after each
row-parallel layer): torch.distributed over NCCL, eager and captured in a CUDA graph (as the engine's decode
graphs hold them), and the engine's one-shot all-reduce over symmetric memory (engine/one_shot_all_reduce.py) in
fp16 and bf16, eager and in a graph, with its largest error against the exact sum.

    python benchmarks/allreduce_latency.py --world 4 --hidden 8192 --rows 1 --ops 160

One process per GPU. Each figure is the median over --reps of (time of --ops back-to-back all-reduces) / ops,
in microseconds. JSON on the last line (rank 0).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_io import emit

from quanta.engine.one_shot_all_reduce import OneShotAllReduce


def timed(fn, ops: int, reps: int) -> float:
    """Median µs per operation of `fn` (which runs `ops` operations)."""
    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / ops * 1e6)
    return round(statistics.median(samples), 2)


def eager_and_graph(fn, ops: int, reps: int) -> tuple[float, float]:
    """(µs per operation of `fn` run eagerly, the same captured in a CUDA graph and replayed)."""
    eager = timed(fn, ops, reps)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):             # warm-up off the capture stream, as torch.cuda.graph wants
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return eager, timed(graph.replay, ops, reps)


def rank_main(rank: int, args, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            device_id=device)
    x = torch.randn(args.rows, args.hidden, dtype=torch.float16, device=device)
    result = {}

    def nccl():
        for _ in range(args.ops):
            dist.all_reduce(x)
            x.mul_(0.25)
    result["nccl_eager_us"], result["nccl_graph_us"] = eager_and_graph(nccl, args.ops, args.reps)
    for dtype in (torch.float16, torch.bfloat16):   # the engine's one-shot kernel: fp16 staged in fp32
        name = f"one_shot_{str(dtype).removeprefix('torch.')}"
        try:
            reducer = OneShotAllReduce(dist.group.WORLD, device, dtype)
            y = x.to(dtype)
            expect = y.float() * args.world          # every rank holds the same rows here
            got = reducer(y)
            result[f"{name}_max_error"] = float((got.float() - expect).abs().max())

            def one_shot():
                z = y
                for _ in range(args.ops):
                    z = reducer(z).mul_(0.25)
            result[f"{name}_eager_us"], result[f"{name}_graph_us"] = eager_and_graph(one_shot, args.ops, args.reps)
        except Exception as e:                  # noqa: BLE001 -- reported, not fatal: the NCCL figures stand
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    torch.cuda.synchronize()
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--ops", type=int, default=160)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    emit({"benchmark": "allreduce_latency", "world": args.world, "rows": args.rows, "hidden": args.hidden,
          "ops": args.ops, "device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
          "nccl_env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM"))}, **result},
         args.out)


if __name__ == "__main__":
    main()
