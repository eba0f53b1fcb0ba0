"""The dequantize kernel of the M >= 256 path (affine_gemm._affine_dequant_kernel: packed int4 -> fp16 [K, N] for
cuBLAS) over column blocks and warps, at the Llama-3-8B / 70B shapes, as GB/s on the bytes it moves (issue 4,
the M >= 256 line: its time is what dequantize + cuBLAS adds to fp16).

    python benchmarks/probes/dequant_sweep.py --out results/dequant-sweep.json [--models 8b,70b] [--weights nf4]

With --weights nf4 (bnb NF4, blocks of 64) each config runs the byte-permute lookup, and "gather" the per-code table
gather it replaced (default config).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import bench, check_close, start_run, sweep_parser, w4_shapes, write_run  # noqa: E402

from quanta.kernels import affine_gemm  # noqa: E402

CONFIGS = [(128, 4), (64, 4), (256, 4), (256, 8), (512, 8), (128, 2)]     # (BLOCK_N, num_warps)


def main() -> None:
    ap = sweep_parser(__doc__)
    ap.add_argument("--weights", default="w4", choices=["w4", "nf4"], help="W4A16 g128 (default) or bnb NF4 codes")
    args = ap.parse_args()
    t0, meta = start_run()
    results = []
    for model, layer, n, k, w4, st4, _ in w4_shapes(args.models, args.weights):
        ref = affine_gemm.dequantize_t(st4[0])
        nbytes = w4.nbytes + 2 * n * k
        rec = {"model": model, "layer": layer, "n": n, "k": k}
        for block_n, warps in CONFIGS:
            assert torch.equal(affine_gemm.dequantize_t(st4[0], block_n, warps), ref)
            us = bench(lambda x, st: affine_gemm.dequantize_t(st, block_n, warps), [None], st4, w4.nbytes)
            rec[f"{block_n}_{warps}"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
        if args.weights == "nf4":                   # the gather the lookup replaced: the same weight, rounded once
            check_close(affine_gemm.dequantize_t(st4[0], lookup=False).float(), ref.float(), "gather")
            us = bench(lambda x, st: affine_gemm.dequantize_t(st, lookup=False), [None], st4, w4.nbytes)
            rec["gather"] = {"us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)}
        results.append(rec)
        print(model, layer, " ".join(f"{key} {v['us']} us {v['GBps']} GB/s" for key, v in rec.items()
                                     if isinstance(v, dict)), flush=True)
        del ref
    write_run(args.out, meta, t0, weights=args.weights, configs=CONFIGS, results=results)


if __name__ == "__main__":
    main()
