"""Sweep of the register-operand MMA kernel (quanta/kernels/affine/mma.py) against torch fp16 (cuBLAS) and
the paths it replaces, at the Llama-3-8B / 70B linear shapes, to place the affine plan's thresholds
(quanta/kernels/affine/plan.py) and mma.MMA_CONFIGS (issue 4, M = 3..1024).

    python benchmarks/mma_sweep.py --out results/mma-sweep.json [--ms 4,16,64,256,1024] [--models 8b]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402
from kernels import (bench, dense_us, nf4_w, prepared_copies, start_run, sweep_parser, w4_shapes,  # noqa: E402
                     write_run)

from quanta.kernels.affine import mma, plan  # noqa: E402

# M -> configs (BLOCK_M, num_stages, waves (None: whole waves, timed split and stream-K), least K tiles per split,
# num_warps, weight rows a warp) tried
SWEEP = {4: ((16, 3, 8.0, 4, 4, 16), (16, 4, 8.0, 4, 4, 16), (16, 3, 16.0, 2, 4, 16)),
         16: ((16, 3, 8.0, 4, 4, 16), (16, 4, 8.0, 4, 4, 16), (16, 3, 16.0, 2, 4, 16), (16, 3, 4.0, 4, 4, 16),
              (16, 5, 4.0, 4, 4, 16), (16, 3, 4.0, 4, 8, 16), (16, 4, 2.0, 4, 8, 16), (16, 3, 8.0, 2, 8, 16)),
         32: ((32, 3, 8.0, 4, 4, 16), (32, 4, 8.0, 4, 4, 16), (32, 3, 16.0, 2, 4, 16), (32, 3, 4.0, 4, 4, 16)),
         64: ((64, 3, 4.0, 4, 4, 16), (64, 3, 8.0, 4, 4, 16), (64, 4, 4.0, 4, 4, 16), (64, 2, 16.0, 2, 4, 16)),
         128: ((128, 4, 1.0, 4, 8, 16), (128, 3, 2.0, 4, 8, 16), (128, 4, None, 4, 8, 16), (128, 3, None, 4, 8, 16)),
         256: ((256, 3, None, 4, 8, 16), (128, 3, None, 4, 8, 16), (256, 3, 2.0, 2, 8, 16)),
         512: ((256, 3, None, 4, 8, 16), (128, 4, None, 4, 8, 16)),
         1024: ((256, 3, 1.0, 4, 8, 16), (256, 3, None, 4, 8, 16), (128, 4, None, 4, 8, 16))}


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--ms", default="4,16,32,64,128,256")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    t0, meta = start_run()
    results = []
    for model, layer, n, k, w4, st4, fp16 in w4_shapes(args.models):
        nf4 = nf4_w(n, k)
        st_nf4 = prepared_copies(nf4)
        for m in ms:
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
            rec = {"model": model, "layer": layer, "n": n, "k": k, "m": m}
            rec["fp16"] = round(dense_us(xs, fp16), 2)
            for path in ("splitk", "cublas"):
                rec[f"w4_{path}"] = round(bench(lambda x, st: plan.matmul(x, st, path=path), xs, st4,
                                                w4.nbytes), 2)
            for cfg in SWEEP.get(m, ((min(256, max(16, triton.next_power_of_2(m))), 3, 4.0, 4, 4, 16),)):
                for stream in (False, True) if cfg[2] is None else (False,):   # stream-K: whole-wave configs
                    rec["w4_mma_" + "_".join(map(str, cfg)) + ("_stream" if stream else "")] = round(
                        bench(lambda x, st: mma.matmul(x, st, config=cfg, stream=stream), xs, st4,
                              w4.nbytes), 2)
            rec["w4_mma_default"] = round(bench(lambda x, st: mma.matmul(x, st), xs, st4, w4.nbytes), 2)
            rec["nf4_cublas"] = round(bench(lambda x, st: plan.matmul(x, st, path="cublas"), xs, st_nf4,
                                            nf4.nbytes), 2)
            rec["nf4_mma"] = round(bench(lambda x, st: mma.matmul(x, st), xs, st_nf4, nf4.nbytes), 2)
            mma = min((v, key) for key, v in rec.items() if key.startswith("w4_mma"))
            rec["best_mma"] = mma[1]
            results.append(rec)
            print(f"{model} {layer:8s} M={m:4d} fp16 {rec['fp16']:7.1f} splitk {rec['w4_splitk']:7.1f} cublas "
                  f"{rec['w4_cublas']:7.1f} mma {mma[0]:7.1f} ({rec['fp16'] / mma[0]:.2f}x, {mma[1]}) default "
                  f"{rec['w4_mma_default']:7.1f} | nf4 cublas {rec['nf4_cublas']:7.1f} mma {rec['nf4_mma']:7.1f}",
                  flush=True)
        del st4, st_nf4, fp16
    write_run(args.out, meta, t0, results=results)


if __name__ == "__main__":
    main()
