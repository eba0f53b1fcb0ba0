"""One shape of the MMA kernel (affine_mma.py, or with --kernel wgmma affine_wgmma.py's), W4A16 g128, called a few
times for Nsight Compute to profile:

    ncu --clock-control none -k regex:_affine_mma_kernel --launch-skip 3 -c 1 --set full \
        python benchmarks/probes/mma_ncu.py --n 4096 --k 14336 --m 16 [--kernel wgmma]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import affine_w, parse_config  # noqa: E402

from quanta.kernels import affine_gemm, affine_mma, affine_wgmma  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--config", help="comma-separated config tuple (the kernel's default_config fields), default the "
                    "launcher's")
    ap.add_argument("--kernel", choices=["mma", "wgmma"], default="mma")
    args = ap.parse_args()
    st = affine_gemm.prepare(affine_w(args.n, args.k, 4, 128), "cuda", torch.float16)
    x = torch.randn(args.m, args.k, device="cuda").half()
    config = args.config and parse_config(args.config)
    kernel = affine_wgmma if args.kernel == "wgmma" else affine_mma
    for _ in range(6):
        kernel.matmul(x, st, config=config)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
