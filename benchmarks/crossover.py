"""Where each quantized weight's GEMM paths cross: every path that takes the weight, forced, at each M, on the
Llama-3 8B (or 70B) shapes, beside cuBLAS fp16 on the dequantized weight; the plan's choice and the fastest path.

GGUF types run on the kernels the registry gives them: the K-quants and IQ4 on the ggml kernels (paths wgmma, mma, gemm,
cublas), Q4_0 and Q8_0 on the affine ones (mma, cublas, splitk), and W4A16 g128 weights for comparison (w4g128,
and w4g128-act with a GPTQ act-order column order, on the affine paths and wgmma).
   usage: python3 benchmarks/crossover.py --out crossover.json [--types q4_K,q4_0] [--ms 16,64,256] [--model 70b]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggml_gemm import random_gguf  # noqa: E402
from linears import SHAPES, affine_w, bench, check_close, copies, start_run, write_run  # noqa: E402

from quanta.kernels import affine, ggml_gemm  # noqa: E402
from quanta.kernels.affine import plan as affine_plan  # noqa: E402
from quanta.kernels.device_caps import device_caps  # noqa: E402
from quanta.kernels.ggml import plan as ggml_plan  # noqa: E402
from quanta.loaders.synthetic import quantized_weight  # noqa: E402

MS = "16,32,48,64,96,128,192,256,384"
TYPES = "q4_K,q5_K,q6_K,q4_0,q8_0,w4g128"
AFFINE_TYPES = ("q4_0", "q8_0", "w4g128", "w4g128-act")
PATHS = {"ggml": ("wgmma", "mma", "gemm", "cublas"), "affine": ("wgmma", "mma", "cublas", "splitk")}


def weight_of(name: str, n: int, k: int):
    """(kernels' kind, the weight, its dequantized fp16 form) for type `name` at [n, k]."""
    if name == "w4g128":
        w = affine_w(n, k, 4, 128)
    elif name == "w4g128-act":          # the synthetic loader's GPTQ desc_act weight (a random g_idx order)
        w = quantized_weight("w4g128act", (n, k), k ** -0.5, torch.Generator("cuda").manual_seed(0), "cuda")
    else:
        w = random_gguf(n, k, name)
    return ("affine" if name in AFFINE_TYPES else "ggml"), w, w.dequantize(torch.float16).cuda()


def run(name: str, model: str, layers: list[str], ms: list[int], results: list[dict]) -> None:
    """Time each path of `name` forced at every layer of `model` and M; one record per (layer, M)."""
    for layer in layers:
        n, k = SHAPES[model][layer]
        kind, w, dense = weight_of(name, n, k)
        kernels, plan = (affine, affine_plan) if kind == "affine" else (ggml_gemm, ggml_plan)
        states = copies(lambda: kernels.prepare(w, torch.device("cuda"), torch.float16), w.nbytes)
        denses = copies(dense.clone, 2 * n * k)
        for m in ms:
            xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
            ref = xs[0].float() @ dense.float().t()
            rec = {"type": name, "model": model, "layer": layer, "n": n, "k": k, "m": m,
                   "planned": plan.choose(states[0], device_caps("cuda"), m).path.name,
                   "fp16_us": round(bench(lambda x, d: x @ d.t(), xs, denses, 2 * n * k), 2)}
            for path in PATHS[kind]:
                def fn(x, s, path=path):
                    return plan.matmul(x, s, path=path)
                try:
                    check_close(fn(xs[0], states[0]), ref, f"{name} {layer} M={m} {path}")
                    rec[f"{path}_us"] = round(bench(fn, xs, states, w.nbytes), 2)
                except Exception as e:          # a path that refuses the weight or is wrong: recorded, not timed
                    rec[f"{path}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            results.append(rec)
            print(rec, flush=True)
        del states, denses, dense
        torch.cuda.empty_cache()


def summary(results: list[dict]) -> None:
    """Per type and M: each path's µs summed over the layers (one decoder layer's GEMMs), × cuBLAS fp16, and the
    plan's path against the fastest."""
    print("\ntype      M  planned  fastest   paths: µs summed over the layers, x cuBLAS fp16")
    order = list(dict.fromkeys(r["type"] for r in results))
    keys = sorted({(r["type"], r["m"]) for r in results}, key=lambda t: (order.index(t[0]), t[1]))
    for name, m in keys:
        rows = [r for r in results if r["type"] == name and r["m"] == m]
        fp16 = sum(r["fp16_us"] for r in rows)
        paths = PATHS["affine" if name in AFFINE_TYPES else "ggml"]
        tot = {p: sum(r[f"{p}_us"] for r in rows) for p in paths if all(f"{p}_us" in r for r in rows)}
        fastest = min(tot, key=tot.get) if tot else "-"
        cells = [f"{p} {tot[p]:8.1f} {fp16 / tot[p]:4.2f}x" if p in tot else f"{p} -" for p in paths]
        print(f"{name:7} {m:4}  {rows[0]['planned']:7}  {fastest:7}   " + "  ".join(f"{c:>14}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--types", default=TYPES)
    ap.add_argument("--model", default="8b", choices=("8b", "70b"))
    ap.add_argument("--layers", default=",".join(SHAPES["8b"]))
    ap.add_argument("--ms", default=MS)
    args = ap.parse_args()
    torch.manual_seed(0)
    t0, meta = start_run()
    results: list[dict] = []
    for name in args.types.split(","):
        run(name, args.model, args.layers.split(","), [int(m) for m in args.ms.split(",")], results)
        write_run(args.out, meta, t0, results=results)
    summary(results)


if __name__ == "__main__":
    main()
