"""Launch configs of the Gluon wgmma kernel (affine_wgmma.py) against the MMA kernel (affine_mma.py) that plan()
gave these M before, at the Llama-3-8B / 70B shapes (issue 4, the M = 16 line).

    python benchmarks/probes/wgmma_sweep.py --out results/wgmma.json [--ms 16] [--models 8b,70b] [--dtype bf16] \
        [--gemv] [--before saved_affine_wgmma.py[,...] [--unchecked saved_affine_wgmma]] \
        [--configs "default;16,3,2.0,2,256,2;16,3,2.0,2,256,2,168"]
    fields: BLOCK_M, stages, waves, least K tiles a split, weight rows a program, wgmmas in flight
    (affine_wgmma.default_config), and an optional register cap (maxnreg). A config runs at the M of its
    BLOCK_M's bucket (16: M <= 16, 32: M = 17..32, 64: M = 33..64). Saved versions of the module (--before, as in
    mma_variants.py) are timed on their own default config (key '<file name>_default').
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (DTYPES, add_dtype_arg, add_versions_args, checked_bench, dense_reference,  # noqa: E402
                     load_versions, parse_config, start_run, sweep_parser, w4_points, write_run)

from quanta.kernels import affine_gemv, affine_mma, affine_wgmma  # noqa: E402


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--ms", default="16")
    add_dtype_arg(ap)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--gemv", action="store_true", help="also time the GEMV (key 'gemv') at M = 1")
    add_versions_args(ap, required=False)
    args = ap.parse_args()
    saved = {name: mod for name, mod in load_versions(affine_wgmma, args.before).items() if name != "now"}
    unchecked = set(args.unchecked.split(","))
    configs = [None if c == "default" else parse_config(c) for c in args.configs.split(";")]
    t0, meta = start_run(before=args.before)
    results = []
    for rec, xs, w4, st4 in w4_points(args.models, args.ms, "w4", DTYPES[args.dtype]):
        ref = dense_reference(xs[0], w4)

        def timed(key, run, check=True):
            try:
                rec[key] = checked_bench(run, xs, st4, w4.nbytes, ref, key, check)
            except Exception as e:  # noqa: BLE001
                rec[key] = f"error: {type(e).__name__}: {str(e)[:300]}"

        timed("mma_default", lambda x, st: affine_mma.matmul(x, st))
        if args.gemv and rec["m"] == 1:
            timed("gemv", lambda x, st: affine_gemv.gemv(x, st))
        for cfg in configs:
            if cfg is not None and cfg[0] != next(b for b in (16, 32, 64) if rec["m"] <= b):
                continue
            key = "wg_" + ("default" if cfg is None else "_".join(map(str, cfg)))
            timed(key, lambda x, st: affine_wgmma.matmul(x, st, config=cfg and cfg[:6],
                                                         maxnreg=cfg[6] if cfg and len(cfg) > 6 else None))
        for name, mod in saved.items():
            timed(f"{name}_default", lambda x, st: mod.matmul(x, st), check=name not in unchecked)
        print(rec, flush=True)
        results.append(rec)
    write_run(args.out, meta, t0, results=results)


if __name__ == "__main__":
    main()
