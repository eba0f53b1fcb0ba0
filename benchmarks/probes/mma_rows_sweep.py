"""Rows a warp in the register-operand MMA kernel (affine_mma.py): 16, 32 or 64 weight rows per warp (16-, 32-,
64-byte word runs per thread and word row, see the kernel's row map), split-K or stream-K over several
programs an SM, at the Llama-3-8B / 70B shapes, against torch fp16 (issue 4, the M = 16 line).

    python benchmarks/probes/mma_rows_sweep.py --out results/mma-rows.json [--ms 16] [--models 8b,70b] \
        [--weights nf4] [--dtype bf16] [--gemv] [--per-element] \
        [--configs "default;16,3,2.0,2,4,64,1;..."]   (a seventh field 1: SYNC, mma.sync with one dot a code,
                                                        from probes/mma-sync-per-code.patch)
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (DTYPES, add_dtype_arg, checked_bench, dense_reference, parse_configs,  # noqa: E402
                     start_run, sweep_parser, w4_points, with_m_bucket, write_run)

from quanta.kernels import affine_gemm, affine_mma  # noqa: E402

# (BLOCK_M, num_stages, waves, least K tiles per split, num_warps, rows a warp), stream-K or split-K
CONFIGS = [((16, 3, 4.0, 4, 4, 16), False), ((16, 3, 2.0, 4, 4, 64), False), ((16, 2, 2.0, 4, 4, 64), False),
           ((16, 4, 2.0, 4, 4, 64), False), ((16, 3, 3.0, 4, 4, 64), False), ((16, 3, 1.5, 4, 4, 64), False),
           ((16, 3, 2.0, 2, 4, 64), False), ((16, 3, 2.0, 4, 8, 32), False), ((16, 3, 4.0, 4, 8, 32), False),
           ((16, 3, 2.0, 4, 8, 64), False), ((16, 3, 2.0, 1, 4, 64), True), ((16, 4, 2.0, 1, 4, 64), True)]


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--ms", default="16")
    ap.add_argument("--weights", default="w4", choices=["w4", "nf4"], help="W4A16 g128 (default) or bnb NF4 codes")
    add_dtype_arg(ap)
    ap.add_argument("--configs", help="configs instead of CONFIGS: 'default' or comma-separated fields, by ';' "
                    "(split-K; 'stream:' before the fields for stream-K)")
    ap.add_argument("--gemv", action="store_true", help="also time the GEMV path (key 'gemv_'), at small M")
    ap.add_argument("--per-element", action="store_true",
                    help="also time the default config decoding per element (key 'per_element_'; h2=False)")
    args = ap.parse_args()
    configs = parse_configs(args.configs) if args.configs else CONFIGS
    t0, meta = start_run()
    results = []
    for rec, xs, w4, st4 in w4_points(args.models, args.ms, args.weights, DTYPES[args.dtype]):
        ref = dense_reference(xs[0], w4)

        def timed(key, run):
            rec[key] = checked_bench(run, xs, st4, w4.nbytes, ref, key)

        for cfg, stream in configs:
            cfg = with_m_bucket(cfg, rec["m"])
            timed(("_".join(map(str, cfg)) if cfg else "default_") + ("_stream" if stream else ""),
                  lambda x, st: affine_mma.matmul(x, st, config=cfg, stream=stream if cfg else None))
        if args.per_element:
            timed("per_element_", lambda x, st: affine_mma.matmul(x, st, h2=False))
        if args.gemv:
            timed("gemv_", lambda x, st: affine_gemm.matmul(x, st, path="gemv"))
        best = min((v, key) for key, v in rec.items() if "_" in key)
        results.append(rec)
        print(f"{rec['model']} {rec['layer']:8s} M={rec['m']:3d} fp16 {rec['fp16']:7.1f} | "
              + " ".join(f"{v:6.1f}" for key, v in rec.items() if "_" in key)
              + f" | best {best[0]:.1f} {rec['fp16'] / best[0]:.2f}x {best[1]}", flush=True)
    write_run(args.out, meta, t0, weights=args.weights, dtype=args.dtype, gemv=args.gemv,
              per_element=args.per_element,
              configs=[(list(c) if c else "default") for c, s in configs],
              streamed=[s for c, s in configs], results=results)

if __name__ == "__main__":
    main()
