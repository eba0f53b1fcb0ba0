"""FP8 weights at M = 1: the e4m3 GEMV (fp8_gemv.py) against the W8A8 path it replaces there, cuBLAS fp16 and the
W8A16 int8 GEMV, on the Llama-3 8B and 70B shapes; the share of copy bandwidth its bytes reach; `--sweep` times
launch configs too.
   usage: python3 benchmarks/fp8_gemv.py --out fp8-gemv.json [--sweep]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linears import SHAPES, affine_w, bench, check_close, copies, prepared_copies, start_run, write_run  # noqa: E402

from quanta.kernels import fp8_gemm, fp8_gemv  # noqa: E402
from quanta.kernels.affine import plan as affine_plan  # noqa: E402
from quanta.quant.kinds.fp8 import Fp8  # noqa: E402

# (block_n, block_k, warps, waves, min_steps) --sweep tries beside the default
SWEEP = ((16, 512, 4, 4.0, 2), (16, 512, 4, 16.0, 2), (32, 512, 4, 8.0, 2), (16, 1024, 4, 8.0, 2),
         (16, 512, 2, 8.0, 2), (32, 1024, 8, 8.0, 2), (64, 256, 4, 8.0, 2), (16, 2048, 8, 8.0, 1),
         (32, 512, 8, 16.0, 1), (16, 256, 2, 16.0, 2))


def fp8_weight(n: int, k: int) -> Fp8:
    data = (torch.randn(n, k, device="cuda") * 40).clamp(-400, 400).to(torch.float8_e4m3fn)
    return Fp8(data=data, scale=torch.rand(n, device="cuda") * 0.003 + 0.001)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0, meta = start_run()
    bw = meta["copy_GBps"]
    results = []
    for model in args.models.split(","):
        for layer, (n, k) in SHAPES[model].items():
            w = fp8_weight(n, k)
            # each copy its own bytes (prepare keeps a view of them), so that no replay reads a weight from L2
            states = copies(lambda: fp8_gemm.prepare(Fp8(data=w.data.clone(), scale=w.scale), "cuda",
                                                     torch.float16), n * k)
            xs = [torch.randn(1, k, device="cuda").half() for _ in range(4)]
            ref = xs[0].double() @ w.dequantize().double().t()
            rec = {"model": model, "layer": layer, "n": n, "k": k, "bytes": n * k}
            check_close(fp8_gemm.apply(xs[0], states[0]).double(), ref, f"fp8 gemv {layer}")
            rec["gemv_us"] = round(bench(fp8_gemm.apply, xs, states, n * k), 2)
            rec["w8a8_us"] = round(bench(lambda x, s: fp8_gemm.w8a8(x, s), xs, states, n * k), 2)
            dense = copies(lambda: w.dequantize().half(), 2 * n * k)
            rec["fp16_us"] = round(bench(lambda x, d: x @ d.t(), xs, dense, 2 * n * k), 2)
            del dense
            w8 = affine_w(n, k, 8, 0)
            st8 = prepared_copies(w8)
            rec["w8a16_us"] = round(bench(affine_plan.matmul, xs, st8, n * k), 2)
            del st8, w8
            if args.sweep:
                for cfg in SWEEP:
                    def fn(x, s, cfg=cfg):
                        return fp8_gemv.matmul(x, s.w_t.t(), s.w_scale.reshape(-1), None, cfg)
                    rec["cfg_" + "_".join(map(str, cfg))] = round(bench(fn, xs, states, n * k), 2)
            rec["gemv_share"] = round(n * k / rec["gemv_us"] / 1e3 / bw, 3)
            results.append(rec)
            print(rec, flush=True)
            del states
            torch.cuda.empty_cache()
    write_run(args.out, meta, t0, results=results)
    print(f"\n{meta['device']}  copy {bw:.0f} GB/s; µs at M = 1 (x fp16 = cuBLAS fp16 µs / µs)")
    print(f"{'shape':>12} {'gemv':>7} {'share':>6} {'x fp16':>7} {'w8a8':>7} {'fp16':>7} {'w8a16':>7}  best sweep")
    for r in results:
        sweeps = {key: v for key, v in r.items() if key.startswith("cfg_")}
        best = min(sweeps, key=sweeps.get) if sweeps else ""
        print(f"{r['model'] + ' ' + r['layer']:>12} {r['gemv_us']:7.1f} {r['gemv_share']:6.1%} "
              f"{r['fp16_us'] / r['gemv_us']:7.2f} {r['w8a8_us']:7.1f} {r['fp16_us']:7.1f} {r['w8a16_us']:7.1f}  "
              f"{best} {sweeps.get(best, '')}")


if __name__ == "__main__":
    main()
