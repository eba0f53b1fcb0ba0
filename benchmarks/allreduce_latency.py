"""Latency of the small all-reduces tensor-parallel decode makes, each as decode makes it: a row-parallel layer's
partial [rows, hidden] fp16 block summed over the ranks, added to the residual stream and normalized (RMSNorm)
for the next layer. Three ways, eager and captured in a CUDA graph (as the engine's decode graphs hold them):
  nccl             torch.distributed's all-reduce over NCCL in place, then the norm kernel (the engine's path for
                   blocks past the one-shot size);
  torch_one_shot   torch's symm_mem.one_shot_all_reduce, the block staged in a float32 symmetric buffer and cast
                   back, then the norm kernel (the engine's path before the fused kernel);
  fused            the engine's OneShotAllReduceNorm (engine/one_shot_all_reduce.py): one kernel.
Each operation starts with a copy of the rank's partial block (a stand-in for the layer that makes it, the same
in all three). Each rank's block differs; the fused result's largest error against the float32 sum is reported.

    python benchmarks/allreduce_latency.py --world 4 --hidden 8192 --rows 1 --ops 160

One process per GPU. Each figure is the median over --reps of (time of --ops back-to-back operations) / ops, in
microseconds. JSON on the last line (rank 0).
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

from quanta.engine.parallel.one_shot import OneShotAllReduceNorm
from quanta.kernels import fused_norm

EPS = 1e-5


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


def partial_block(rank: int, rows: int, hidden: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(rows, hidden, generator=g).to(device, torch.float16)


def rank_main(rank: int, args, port: int, queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            device_id=device)
    group = dist.group.WORLD
    src = partial_block(rank, args.rows, args.hidden, device)
    residual = torch.randn(args.rows, args.hidden, generator=torch.Generator().manual_seed(99)).to(device,
                                                                                                      torch.float16)
    weight = (torch.rand(args.hidden, generator=torch.Generator().manual_seed(98)) + 0.5).to(device, torch.float16)

    def nccl(p, r):
        dist.all_reduce(p)
        return fused_norm.rms_norm(p, weight, EPS, r)

    import torch.distributed._symmetric_memory as symm_mem
    staging = symm_mem.empty(src.numel(), dtype=torch.float32, device=device)
    symm_mem.rendezvous(staging, group.group_name)

    def torch_one_shot(p, r):
        staging.copy_(p.view(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staging, "sum", group.group_name)
        return fused_norm.rms_norm(out.view(p.shape).to(p.dtype), weight, EPS, r)

    fused = OneShotAllReduceNorm(group, device, torch.float16, args.hidden)
    total = torch.stack([partial_block(r, args.rows, args.hidden, device).float()
                         for r in range(args.world)]).sum(0).to(torch.float16)
    result = {"fused_max_error_h": float((fused(src.clone(), residual, weight, EPS)[1].float()
                                          - (total.float() + residual.float()).half().float()).abs().max())}
    for name, step in (("nccl", nccl), ("torch_one_shot", torch_one_shot),
                       ("fused", lambda p, r: fused(p, r, weight, EPS))):
        def chain():
            r = residual
            for _ in range(args.ops):
                _, r = step(src.clone(), r)
        try:
            result[f"{name}_eager_us"], result[f"{name}_graph_us"] = eager_and_graph(chain, args.ops, args.reps)
        except Exception as e:                  # noqa: BLE001 -- reported, not fatal: the other figures stand
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
