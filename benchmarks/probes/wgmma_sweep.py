"""Launch configs of the Gluon wgmma kernel (affine_wgmma.py) against the MMA kernel (affine_mma.py) that plan()
gave these M before, at the Llama-3-8B / 70B shapes (issue 4: the M = 16 and M >= 256 lines).

    python benchmarks/probes/wgmma_sweep.py --out results/wgmma.json [--ms 16] [--models 8b,70b] [--dtype bf16] \
        [--gemv] [--before saved_affine_wgmma.py[,...] [--unchecked saved_affine_wgmma]] \
        [--cublas] [--configs "default;16,3,2.0,2,256,2,4;16,3,2.0,2,256,2,4,168;128,4,None,2,256,3,8"]
    fields: BLOCK_M, stages, waves (None: whole waves), least K tiles a split, weight rows a program, wgmmas in
    flight, warps (affine_wgmma.default_config), and an optional register cap (maxnreg). A config of BLOCK_M 16
    or 32 runs at the M of its bucket (16: M <= 16, 32: M = 17..32), a larger one at every M above 32. Each point
    also times the path plan() gives it (key 'path', its name 'path_name') and, up to M = 512, the MMA kernel.
    Saved versions of the module (--before, as in mma_variants.py) are timed on the same configs (key
    '<file name>_<config>', the kernel's own 'wg_<config>'), their own default_config for 'default'.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (DTYPES, add_dtype_arg, add_versions_args, checked_bench, dense_reference,  # noqa: E402
                     load_versions, parse_config, start_run, sweep_parser, w4_points, write_run)

from quanta.kernels import affine_gemm, affine_gemv, affine_mma, affine_wgmma  # noqa: E402


def runs_at(cfg: tuple, m: int) -> bool:
    """Whether a config runs at M: BLOCK_M 16 or 32 at the M of its bucket, a larger one above 32."""
    if cfg[0] <= 32:
        return m <= 32 and cfg[0] == (16 if m <= 16 else 32)
    return m > 32


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--ms", default="16")
    add_dtype_arg(ap)
    ap.add_argument("--configs", default="default")
    ap.add_argument("--gemv", action="store_true", help="also time the GEMV (key 'gemv') at M = 1")
    ap.add_argument("--cublas", action="store_true", help="also time dequantize + cuBLAS (key 'cublas') from M = 256")
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

        rec["path_name"] = affine_gemm.plan(rec["m"], st4[0])[0]
        timed("path", lambda x, st: affine_gemm.matmul(x, st))
        if rec["m"] <= affine_mma.MMA_MAX_M:
            timed("mma_default", lambda x, st: affine_mma.matmul(x, st))
        if args.cublas and rec["m"] >= 256:
            timed("cublas", lambda x, st: affine_gemm.cublas(x, st))
        if args.gemv and rec["m"] == 1:
            timed("gemv", lambda x, st: affine_gemv.gemv(x, st))
        for name, mod in {"wg": affine_wgmma, **saved}.items():
            for cfg in configs:
                if cfg is not None and not runs_at(cfg, rec["m"]):
                    continue
                key = f"{name}_" + ("default" if cfg is None else "_".join(map(str, cfg)))
                timed(key, lambda x, st: mod.matmul(x, st, config=cfg and cfg[:7],
                                                    maxnreg=cfg[7] if cfg and len(cfg) > 7 else None),
                      check=name not in unchecked)
        print(rec, flush=True)
        results.append(rec)
    write_run(args.out, meta, t0, results=results)


if __name__ == "__main__":
    main()
