"""W4A16 g128 at large M: the warp-specialized wgmma kernel (affine/wgmma_ws.py) in each forced config beside the
wgmma kernel it would replace (wgmma.py's large_m_config) and cuBLAS fp16, on the Llama-3 8B / 70B shapes.

    python3 benchmarks/wgmma_ws_sweep.py --out ws.json [--models 8b,70b] [--ms 64,256,1024] \
        [--configs default,128:2:256:3,64:4:256:2]

A config is BLOCK_M:STAGES:ROWS:LAG (the split is large_m_config's whole waves), or "default" (the plan's). Every
variant's output is checked against the float reference before it is timed (linears.check_close).
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linears import checked_bench, dense_reference, start_run, sweep_parser, w4_points, write_run  # noqa: E402

from quanta.kernels.affine import wgmma, wgmma_ws  # noqa: E402
from quanta.kernels.device_caps import device_caps  # noqa: E402


def ws_config(spec: str, st, caps, m: int) -> wgmma.WgmmaConfig:
    """The config of `spec` ("default" or BLOCK_M:STAGES:ROWS:LAG) for this weight and M."""
    base = wgmma_ws.default_config(st, caps, m)
    if spec == "default":
        return base
    bm, stages, rows, lag = map(int, spec.split(":"))
    return base._replace(block_m=bm, stages=stages, rows=rows, lag=lag)


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--ms", default="64,128,256,512,1024")
    ap.add_argument("--configs", default="default")
    args = ap.parse_args()
    t0, meta = start_run()
    caps = device_caps("cuda")
    rows = []
    for rec, xs, w4, st4 in w4_points(args.models, args.ms):
        m = rec["m"]
        ref = dense_reference(xs[0], w4)
        nbytes = w4.nbytes
        config = wgmma.large_m_config(st4[0], caps, m)
        rec["wgmma"] = checked_bench(lambda x, s: wgmma.matmul(x, s, config=config), xs, st4, nbytes, ref, "wgmma")
        for spec in args.configs.split(","):
            c = ws_config(spec, st4[0], caps, m)
            rec[f"ws {spec}"] = checked_bench(lambda x, s, c=c: wgmma_ws.matmul(x, s, config=c), xs, st4, nbytes,
                                              ref, f"ws {spec}")
        rows.append(rec)
        print(rec, flush=True)
    write_run(args.out, meta, t0, rows=rows)
    keys = [k for k in rows[0] if k == "wgmma" or k.startswith("ws ")]
    print("\n| model | layer | M | fp16 µs | " + " | ".join(f"{k} (× fp16)" for k in keys) + " |")
    for r in rows:
        print(f"| {r['model']} | {r['layer']} | {r['m']} | {r['fp16']} | "
              + " | ".join(f"{r[k]} ({r['fp16'] / r[k]:.2f}×)" for k in keys) + " |")


if __name__ == "__main__":
    main()
