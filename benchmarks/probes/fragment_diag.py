"""Probe (H100, 2026-11-23; figures in RESULTS.md): at M = 16 / 64, the swap-AB kernel on a layout of its own
(fragment_probe.frag_kernel, 4 KB of words per 64x128 tile in the A fragment's thread order) against the same
product on quanta's packed layout loaded 4 bytes per lane (frag2_kernel) and affine_mma as it then was.

    python benchmarks/probes/fragment_diag.py
"""
import sys, torch, triton
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2])); sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import bench, copies
import fragment_probe as P
from quanta.kernels import affine_gemm, affine_mma
from quanta.quant.kinds import Affine
for (n, k) in ((6144, 4096), (28672, 4096), (4096, 14336)):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 128, device="cuda") * 0.01 + 0.001).half()
    aff = Affine(codes=codes, scales=scales, bits=4, group_size=128, zeros=8)
    nb = n * k // 2
    st = copies(lambda: affine_gemm.prepare(aff, "cuda", torch.float16), nb)
    fw = copies(lambda: (P.pack_frag(codes), scales.t().contiguous()), nb)
    for m in (16, 64):
        xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
        ref = xs[0].float() @ ((codes.float() - 8) * scales.float().repeat_interleave(128, 1)).t()
        out = {}
        for splits in (2, 4, 8):
            out[f"A_custom_s{splits}"] = bench(lambda x, w: P.frag_matmul(x, *w, n, splits, 3), xs, fw, nb)
            def f2(x, st):
                kt = k // 128; per = triton.cdiv(kt, splits); sp = triton.cdiv(kt, per)
                y = torch.zeros(m, n, device="cuda", dtype=torch.float16)
                P.frag2_kernel[(n // 64, sp, triton.cdiv(m, 16 if m <= 16 else 64))](x, st.packed, st.sz, y, m, n, k, 128, per, x.stride(0), y.stride(0), 1, BLOCK_M=16 if m <= 16 else 64, SPLIT_K=sp, num_warps=4, num_stages=3)
                return y
            out[f"B_existing_plain_s{splits}"] = bench(f2, xs, st, nb)
            waves = splits * (n // 64) / 132
            for h2 in (True, False):
                cfg = (16 if m <= 16 else 64, 3, waves, 1, 4, 16)
                out[f"C_mma_h2{int(h2)}_s{splits}"] = bench(lambda x, s_: affine_mma.matmul(x, s_, config=cfg, h2=h2), xs, st, nb)
                y = affine_mma.matmul(xs[0], st[0], config=cfg, h2=h2).float()
                out[f"err_h2{int(h2)}_s{splits}"] = ((y - ref).abs().max() / ref.abs().max()).item()
        out["gemm"] = bench(lambda x, s_: affine_gemm.matmul(x, s_, path="gemm"), xs, st, nb)
        print(n, k, m, {a: round(b, 4 if a.startswith("err") else 1) for a, b in out.items()}, flush=True)
    del st, fw
