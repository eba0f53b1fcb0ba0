"""The batched LoRA slot kernels (quanta.lora.kernels.add_lora: shrink + expand) on Llama-3-8B's merged linears,
against the W4A16 g128 GEMM they follow, at the rows of a batch's decode step: what the adapters add to a step.

    python benchmarks/lora_slots.py --out slots.json [--rows 16,64,256] [--adapters 8] [--rank 16]

The step's rows are spread evenly over `adapters` slots. GPU time per call under a CUDA graph (linears.bench), the
A and B bytes every slot holds (read once a call when every slot has rows) as GB/s beside the measured copy
bandwidth, and the share of the base GEMM's time the products add.
"""
from __future__ import annotations

import argparse
import time

import torch
from linears import SHAPES, affine_w, bench, prepared_copies, start_run, write_run

from quanta.kernels.affine import plan
from quanta.lora import kernels as lora_kernels
from quanta.lora.kernels import add_lora, sort_by_slot

PARTS = {"qkv": (4096, 1024, 1024), "o": (4096,), "gate_up": (14336, 14336), "down": (4096,)}


def slot_tensors(n: int, k: int, parts: tuple, slots: int, rank: int):
    """Random A [S, P*R, K], B [S, N, R] (fp16), scale [S, P] and the parts' column bounds."""
    a = (torch.randn(slots, len(parts) * rank, k, device="cuda") / k ** 0.5).half()
    b = (0.01 * torch.randn(slots, n, rank, device="cuda")).half()
    scale = torch.full((slots, len(parts)), 2.0, device="cuda")
    bounds = [0]
    for width in parts:
        bounds.append(bounds[-1] + width)
    assert bounds[-1] == n
    return a, b, scale, bounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--block-n", default=str(lora_kernels.SPLIT_BLOCK_N),
                    help="expand column blocks to time (lora.kernels.SPLIT_BLOCK_N, a sweep: '64,128,256')")
    args = ap.parse_args()
    t0, meta = start_run(adapters=args.adapters, rank=args.rank)
    rows_out = []
    for layer, (n, k) in SHAPES["8b"].items():
        w4 = affine_w(n, k, 4, 128)
        st4 = prepared_copies(w4)
        a, b, scale, bounds = slot_tensors(n, k, PARTS[layer], args.adapters, args.rank)
        slot_bytes = a.numel() * 2 + b.numel() * 2
        for t in map(int, args.rows.split(",")):
            xs = [torch.randn(t, k, device="cuda").half() for _ in range(4)]
            y = torch.randn(t, n, device="cuda").half()
            slots = (torch.arange(t, device="cuda") % args.adapters).to(torch.int32)
            order, starts = sort_by_slot(slots, args.adapters)
            base = bench(plan.matmul, xs, st4, w4.nbytes)
            for block_n in map(int, args.block_n.split(",")):
                lora_kernels.SPLIT_BLOCK_N = block_n
                lora = bench(lambda x: add_lora(x, y, slots, a, b, scale, bounds, order, starts), xs)
                rec = {"layer": layer, "n": n, "k": k, "rows": t, "block_n": block_n, "base_us": round(base, 2),
                       "lora_us": round(lora, 2), "added": round(lora / base, 3),
                       "slot_GBps": round(slot_bytes / lora / 1e3, 1)}
                rows_out.append(rec)
                print(rec, flush=True)
        del st4
        torch.cuda.empty_cache()
    write_run(args.out, meta, t0, rows=rows_out)
    print(f"| rows | layer | block_n | W4 GEMM us | slot kernels us | added | slot GB/s (copy {meta['copy_GBps']}) |")
    for r in rows_out:
        print(f"| {r['rows']} | {r['layer']} | {r['block_n']} | {r['base_us']} | {r['lora_us']} | {r['added']:.2f} | "
              f"{r['slot_GBps']} |")
    print(f"seconds {time.time() - t0:.0f}")


if __name__ == "__main__":
    main()
