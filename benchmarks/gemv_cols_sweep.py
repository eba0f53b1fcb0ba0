"""gemv_cols launch configs at M = 1 on the shapes of a Q4_K_M mix (k/v and Q6_K included), the default beside each.
   usage: python3 benchmarks/gemv_cols_sweep.py
"""
import sys
sys.path.insert(0, "benchmarks")
import torch
from ggml_gemm import random_gguf
from linears import bench, copies
from quanta.kernels import ggml_gemm
from quanta.kernels.ggml import gemv_cols
from quanta.kernels.device_caps import device_caps
CFGS = [(256, 2, 16.0, 1), (256, 2, 8.0, 2), (256, 2, 32.0, 1), (128, 1, 16.0, 1), (128, 1, 32.0, 1),
        (128, 2, 16.0, 1), (256, 4, 16.0, 1), (256, 4, 32.0, 1), (512, 4, 16.0, 1), (128, 4, 32.0, 1)]
for name, n, k in [("q4_K", 1024, 4096), ("q6_K", 1024, 4096), ("q4_K", 4096, 4096), ("q4_K", 6144, 4096),
                   ("q4_K", 4096, 14336), ("q6_K", 4096, 14336), ("q4_K", 28672, 4096)]:
    w = random_gguf(n, k, name)
    st = copies(lambda: ggml_gemm.prepare(w, torch.device("cuda"), torch.float16), w.nbytes)
    xs = [torch.randn(1, k, device="cuda").half() for _ in range(4)]
    d = gemv_cols.default_config(st[0], device_caps("cuda"), 1)
    row = [f"{name} [{n},{k}] {w.nbytes/1e6:.1f}MB default {tuple(d)}: {bench(lambda x, s: gemv_cols.matmul(x, s), xs, st, w.nbytes):.1f}"]
    for c in CFGS:
        try:
            row.append(f"{c[0]}/{c[1]}/{c[2]:g}/{c[3]} {bench(lambda x, s: gemv_cols.matmul(x, s, None, c), xs, st, w.nbytes):.1f}")
        except Exception as e:
            row.append(f"{c} ERR {type(e).__name__}")
    print(" | ".join(row), flush=True)
    del st
    torch.cuda.empty_cache()
