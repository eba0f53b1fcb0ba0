"""FP8 W8A8 by parts at M >= 1024 on the Llama-3 shapes: the per-token quantization kernel alone, and
torch._scaled_mm (row-wise scales) with and without fast accumulation, against bf16 cuBLAS; plus the error
of each against an fp64 product of the same fp8 operands.

    python benchmarks/fp8_by_parts.py [--ms 1024,2048] [--out probe.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linears import SHAPES, bench, copies  # noqa: E402

from quanta.kernels import fp8_gemm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1024,2048")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for model in ("8b", "70b"):
        for layer, (n, k) in SHAPES[model].items():
            wb = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).bfloat16(), 2 * n * k)
            w8 = copies(lambda: (torch.randn(n, k, device="cuda") * 30).clamp(-440, 440).to(torch.float8_e4m3fn),
                        n * k)
            ws = (torch.rand(1, n, device="cuda") * 1e-3 + 1e-4)
            for m in map(int, args.ms.split(",")):
                xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(4)]
                qs = [fp8_gemm.quantize_rows(x) for x in xs]
                rec = {"model": model, "layer": layer, "m": m, "n": n, "k": k}
                rec["bf16"] = bench(lambda x, w: x @ w.t(), xs, wb, 2 * n * k)
                rec["quant"] = bench(fp8_gemm.quantize_rows, xs)
                for fast in (False, True):
                    mm = lambda q, w, fast=fast: torch._scaled_mm(q[0], w.t(), scale_a=q[1], scale_b=ws,
                                                                  out_dtype=torch.bfloat16, use_fast_accum=fast)
                    rec[f"mm_fast{int(fast)}"] = bench(mm, qs, w8, n * k)
                    y = mm(qs[0], w8[0]).double()
                    ref = (qs[0][0].double() * qs[0][1].double()) @ (w8[0].double() * ws.double().t()).t()
                    rec[f"err_fast{int(fast)}"] = ((y - ref).norm() / ref.norm()).item()
                for key in ("mm_fast0", "mm_fast1"):
                    rec[f"x_{key}"] = round(rec["bf16"] / (rec["quant"] + rec[key]), 3)
                rows.append(rec)
                print(json.dumps({a: (round(b, 5) if isinstance(b, float) else b) for a, b in rec.items()}), flush=True)
            del wb, w8
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| shape | M | bf16 µs | quant µs | mm µs (fast) | vs bf16 | err | err (fast) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} {r['layer']} | {r['m']} | {r['bf16']:.1f} | {r['quant']:.1f} | {r['mm_fast0']:.1f} "
              f"({r['mm_fast1']:.1f}) | {r['x_mm_fast0']}× ({r['x_mm_fast1']}×) | {r['err_fast0']:.1e} | {r['err_fast1']:.1e} |")


if __name__ == "__main__":
    main()
