"""The M=1 GEMV alone: profile it under Nsight Compute, or sweep its launch configs (W4A16 g128, or W8A16 g128 with
--bits 8; fp16).

    ncu --clock-control none --kernel-name regex:gemv --section SpeedOfLight python benchmarks/profile_gemv.py
    python benchmarks/profile_gemv.py --sweep [--models 8b,70b]   # graphed µs per config and shape
    python benchmarks/profile_gemv.py --sweep --configs "[(64, 8, 1, 64.0, 8, True)]"   # other configs
    python benchmarks/profile_gemv.py --sweep --bits 8 --configs w8      # 8-bit codes, SWEEP_W8
Each swept config is first checked against the dequantized weight (relative error printed).
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linears import SHAPES, affine_w, bench, copies, copy_bandwidth  # noqa: E402

from quanta.kernels import affine  # noqa: E402
from quanta.kernels.affine.gemv import matmul as gemv  # noqa: E402

# (BLOCK_N, RS, num_warps, waves, min_tiles, h2[, stages[, max_registers[, tile_sums]]]); None = the defaults
SWEEP = (None, (256, 4, 2, 8.0, 2, False), (256, 4, 2, 8.0, 2, True), (128, 8, 2, 16.0, 1, True),
         (128, 16, 2, 16.0, 1, True), (128, 8, 2, 32.0, 1, True), (128, 8, 4, 16.0, 1, True),
         (256, 8, 2, 16.0, 1, True), (128, 4, 2, 16.0, 1, True), (64, 8, 2, 16.0, 1, True))
# 8-bit codes: the PDL table's shapes (GEMV_CONFIGS_PDL_W8), with more programs, wider ones, two stages and tile sums
SWEEP_W8 = (None, (256, 8, 4, 8.0, 1, True), (256, 16, 4, 8.0, 1, True), (128, 8, 2, 32.0, 1, True),
            (256, 8, 4, 16.0, 1, True), (256, 16, 4, 16.0, 1, True), (256, 8, 8, 8.0, 1, True),
            (512, 8, 8, 8.0, 1, True), (128, 16, 4, 16.0, 1, True), (256, 8, 4, 8.0, 1, True, 2),
            (256, 16, 4, 8.0, 1, True, 2), (128, 8, 2, 32.0, 1, True, 2), (256, 8, 4, 8.0, 1, True, 1, 0, True),
            (256, 16, 4, 8.0, 1, True, 1, 0, True), (512, 8, 8, 16.0, 1, True, 1, 0, True))


def run(x, st, cfg):
    return gemv(x, st) if cfg is None else gemv(x, st, config=cfg[:5] + cfg[6:], h2=cfg[5])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="graphed timing of every config instead of profiling")
    ap.add_argument("--models", default="8b")
    ap.add_argument("--out")
    ap.add_argument("--configs", default=None,
                    help="the configs to sweep, a Python list of SWEEP's tuples (None = the defaults), or w8")
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8), help="code width of the g128 weight")
    ap.add_argument("--m", type=int, default=1, choices=(1, 2), help="activation rows")
    args = ap.parse_args()
    default = SWEEP_W8 if args.bits == 8 else SWEEP
    args.configs = SWEEP_W8 if args.configs == "w8" else ast.literal_eval(args.configs) if args.configs else default
    torch.manual_seed(0)
    bw = copy_bandwidth() if args.sweep else 0.0
    results = []
    for model in args.models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            w = affine_w(n, k, args.bits, 128)
            x = torch.randn(args.m, k, device="cuda").half()
            if not args.sweep:
                st = affine.prepare(w, "cuda", torch.float16)
                for _ in range(3):
                    gemv(x, st)
                torch.cuda.synchronize()
                continue
            ref = x.float() @ w.dequantize().float().T
            fp16 = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).half(), 2 * n * k)
            us16 = bench(lambda x, wt: x @ wt.t(), [x], fp16, 2 * n * k)
            results.append({"shape": f"{model} {layer}", "m": args.m, "config": "fp16", "us": round(us16, 2)})
            print(json.dumps(results[-1]), flush=True)
            del fp16
            sts = copies(lambda: affine.prepare(w, "cuda", torch.float16), w.nbytes)
            for cfg in args.configs:
                err = float((run(x, sts[0], cfg).float() - ref).norm() / ref.norm())
                us = bench(lambda x, s: run(x, s, cfg), [x], sts, w.nbytes)
                rec = {"shape": f"{model} {layer}", "m": args.m, "config": cfg, "us": round(us, 2),
                       "share": round(w.nbytes / us / 1e3 / bw, 3), "vs_fp16": round(us16 / us, 2), "rel_err": err}
                results.append(rec)
                print(json.dumps(rec), flush=True)
            del sts
            torch.cuda.empty_cache()
    if args.sweep:
        print(f"\ncopy {bw:.0f} GB/s; share of copy bandwidth per config (columns) and shape (rows)")
        shapes = list(dict.fromkeys(r["shape"] for r in results))
        print(f"{'':>2} {'fp16 cuBLAS':>34} " + " ".join(f"{r['us']:>11.1f}" for r in results if r["config"] == "fp16"))
        for i, cfg in enumerate(args.configs):
            print(f"{i:>2} {str(cfg):>34} " + " ".join(
                f"{r['us']:>6.1f}/{r['share']:.0%}" for r in results if r["config"] == cfg))
        print(" " * 38 + " ".join(f"{s:>11}" for s in shapes))
        if args.out:
            Path(args.out).write_text(json.dumps({"copy_GBps": bw, "results": results}, indent=1))


if __name__ == "__main__":
    main()
