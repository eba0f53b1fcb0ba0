"""Versions of the MMA kernel module (affine_mma.py: the working tree's, and saved ones given by path, named by
their file names) at the Llama-3-8B / 70B shapes, W4A16 g128, over a few configs, with torch fp16 in the same run
(issue 4, M = 16).

    python benchmarks/probes/mma_variants.py --before benchmarks/probes/_variants/affine_mma_before.py[,...] \
        --out results/mma-variants.json [--ms 16,64] [--models 8b,70b] [--defaults-only] [--reps 2] [--dtype bf16]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (DTYPES, add_dtype_arg, checked_bench, dense_reference, load_versions,  # noqa: E402
                     parse_configs, start_run, variants_parser, w4_points, with_m_bucket, write_run)

from quanta.kernels import affine_mma  # noqa: E402

# (BLOCK_M, stages, waves, least K tiles, warps, rows a warp); BLOCK_M is replaced by M's bucket; None = default
CONFIGS = [None, (16, 3, 4.0, 4, 4, 32), (16, 3, 3.0, 4, 4, 32), (16, 4, 4.0, 4, 4, 32), (16, 3, 2.0, 4, 4, 32),
           (16, 3, 4.0, 4, 4, 16), (16, 3, 6.0, 4, 4, 16)]


def main() -> None:
    ap = variants_parser(__doc__, reps=1)
    ap.add_argument("--ms", default="16,64")
    ap.add_argument("--defaults-only", action="store_true", help="time each version's own config only")
    ap.add_argument("--configs", help="configs instead of CONFIGS: 'default' or six comma-separated fields, by ';' "
                    "('stream:' before the fields for stream-K)")
    add_dtype_arg(ap)
    args = ap.parse_args()
    configs = ([(None, False)] if args.defaults_only else parse_configs(args.configs) if args.configs else
               [(c, False) for c in CONFIGS])
    t0, meta = start_run(before=args.before)
    versions = load_versions(affine_mma, args.before)
    results = []
    for rec, xs, w4, st4 in w4_points(args.models, args.ms, dtype=DTYPES[args.dtype]):
        ref = dense_reference(xs[0], w4)
        for _ in range(args.reps):
            for name, mod in versions.items():
                for cfg, stream in configs:
                    cfg = with_m_bucket(cfg, rec["m"])
                    key = (name + "_" + ("default" if cfg is None else "_".join(map(str, cfg)))
                           + ("_stream" if stream else ""))
                    run = lambda x, st: mod.matmul(x, st, config=cfg, stream=stream or None)  # noqa: E731
                    rec.setdefault(key, []).append(checked_bench(run, xs, st4, w4.nbytes, ref, key,
                                                                 name not in args.unchecked.split(",")))
        results.append(rec)
        print(f"{rec['model']} {rec['layer']:8s} M={rec['m']:3d} fp16 {rec['fp16']:7.2f} | "
              + " ".join(f"{key} {'/'.join(map(str, v))}" for key, v in rec.items() if isinstance(v, list)),
              flush=True)
    write_run(args.out, meta, t0, dtype=args.dtype, configs=[c for c, s in configs], results=results)

if __name__ == "__main__":
    main()
