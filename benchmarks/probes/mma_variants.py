"""Versions of the MMA kernel module (affine_mma.py: the working tree's, and saved ones given by path, named by
their file names) at the Llama-3-8B / 70B shapes, W4A16 g128, over a few configs, with torch fp16 in the same run
(issue 4, M = 16).

    python benchmarks/probes/mma_variants.py --before benchmarks/probes/_variants/affine_mma_before.py[,...] \
        --out results/mma-variants.json [--ms 16,64] [--models 8b,70b] [--defaults-only] [--reps 2]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (bench, check_close, dense_reference, dense_us, load_module, parse_config,  # noqa: E402
                     start_run, sweep_parser, w4_shapes, write_run)

from quanta.kernels import affine_mma  # noqa: E402

# (BLOCK_M, stages, waves, least K tiles, warps, rows a warp); BLOCK_M is replaced by M's bucket; None = default
CONFIGS = [None, (16, 3, 4.0, 4, 4, 32), (16, 3, 3.0, 4, 4, 32), (16, 4, 4.0, 4, 4, 32), (16, 3, 2.0, 4, 4, 32),
           (16, 3, 4.0, 4, 4, 16), (16, 3, 6.0, 4, 4, 16)]


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--before", required=True, help="module paths, by ','")
    ap.add_argument("--reps", type=int, default=1, help="time each version this many times, interleaved")
    ap.add_argument("--unchecked", default="", help="versions wrong on purpose (diagnostics): timed, not checked")
    ap.add_argument("--ms", default="16,64")
    ap.add_argument("--defaults-only", action="store_true", help="time each version's own config only")
    ap.add_argument("--configs", help="configs instead of CONFIGS: 'default' or six comma-separated fields, by ';'")
    args = ap.parse_args()
    configs = ([None] if args.defaults_only else CONFIGS if not args.configs else
               [None if c == "default" else parse_config(c) for c in args.configs.split(";")])
    t0, meta = start_run(before=args.before)
    versions = {"now": affine_mma} | {Path(p).stem: load_module(p) for p in args.before.split(",")}
    results = []
    for model, layer, n, k, w4, st4, fp16 in w4_shapes(args.models):
        for m in map(int, args.ms.split(",")):
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
            ref = dense_reference(xs[0], w4)
            rec = {"model": model, "layer": layer, "n": n, "k": k, "m": m,
                   "fp16": round(dense_us(xs, fp16), 2)}
            for _ in range(args.reps):
                for name, mod in versions.items():
                    for cfg in configs:
                        cfg = cfg and (max(16, 1 << (m - 1).bit_length()),) + cfg[1:]
                        key = name + "_" + ("default" if cfg is None else "_".join(map(str, cfg)))
                        if name not in args.unchecked.split(","):
                            check_close(mod.matmul(xs[0], st4[0], config=cfg), ref, key)
                        us = bench(lambda x, st: mod.matmul(x, st, config=cfg), xs, st4, w4.nbytes)
                        rec.setdefault(key, []).append(round(us, 2))
            results.append(rec)
            print(f"{model} {layer:8s} M={m:3d} fp16 {rec['fp16']:7.2f} | "
                  + " ".join(f"{key} {'/'.join(map(str, v))}" for key, v in rec.items() if isinstance(v, list)),
                  flush=True)
    write_run(args.out, meta, t0, configs=configs, results=results)


if __name__ == "__main__":
    main()
