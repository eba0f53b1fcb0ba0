"""Probe (issue 4, M = 2-64), kept as the evidence for the next layout step: a swap-AB W4A16 GEMM whose packed
words are pre-permuted (4 KB per 64 x 128 tile, in the wgmma A fragment's thread order) so that the decoded
weight lands in the operand registers with 16-byte loads (frag_kernel), and variants on quanta's own layout.

    python benchmarks/probes/fragment_probe.py --out fragment-probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton
import triton.language as tl

from quanta.kernels.affine_gemm import load_scales



@triton.jit
def frag_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, tiles_per_split, stride_xm, stride_ym,
                BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_kt = K // 128
    offs_a = tl.arange(0, 1024)
    offs_n = pid_n * 64 + tl.arange(0, 64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    mask_m = offs_m < M
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, num_kt)
    s = tl.load(s_ptr + t0 * N + offs_n)
    for t in range(t0, t1):
        s_next = tl.load(s_ptr + tl.minimum(t + 1, t1 - 1) * N + offs_n)
        p = tl.load(w_ptr + (pid_n * num_kt + t) * 1024 + offs_a)
        # address bits (msb first): n3 n5 n4 n2 n1 n0 kw1 kw0 kw3 kw2
        p = tl.reshape(p, (2, 2, 2, 2, 2, 2, 2, 2, 2, 2))
        p = tl.permute(p, (1, 2, 0, 3, 4, 5, 8, 9, 6, 7))
        p = tl.reshape(p, (64, 16))
        c0 = p & 15
        c1 = (p >> 4) & 15
        c2 = (p >> 8) & 15
        c3 = (p >> 12) & 15
        c4 = (p >> 16) & 15
        c5 = (p >> 20) & 15
        c6 = (p >> 24) & 15
        c7 = (p >> 28) & 15
        j = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))
        q = (j | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        w = (q - 1032.0) * s[:, None, None, None, None]
        w = tl.reshape(w, (64, 2, 2, 2, 2, 2, 2, 2))
        w = tl.permute(w, (0, 1, 2, 7, 6, 3, 4, 5))
        w = tl.reshape(w, (64, 128))
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (t * 128 + offs_k)[None, :], mask=mask_m[:, None],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        s = s_next
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :])
    else:
        tl.atomic_add(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :], sem="relaxed")


@triton.jit
def frag2_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, GS, tiles_per_split, stride_xm, stride_ym, stride_wn,
                 BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, ZERO: tl.constexpr = 8):
    """The same swap-AB product on quanta's existing packed layout (word row r of a tile: k = i*16 + r)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_kt = K // 128
    b = tl.arange(0, 2)
    r1 = b[:, None, None, None, None, None, None, None, None, None]
    r2 = b[None, :, None, None, None, None, None, None, None, None]
    n0 = b[None, None, :, None, None, None, None, None, None, None]
    n1 = b[None, None, None, :, None, None, None, None, None, None]
    n2 = b[None, None, None, None, :, None, None, None, None, None]
    n4 = b[None, None, None, None, None, :, None, None, None, None]
    n5 = b[None, None, None, None, None, None, :, None, None, None]
    n3 = b[None, None, None, None, None, None, None, :, None, None]
    r3 = b[None, None, None, None, None, None, None, None, :, None]
    r0 = b[None, None, None, None, None, None, None, None, None, :]
    N_IDX = n0 + 2 * n1 + 4 * n2 + 8 * n3 + 16 * n4 + 32 * n5
    R_IDX = r0 + 2 * r1 + 4 * r2 + 8 * r3
    offs_n = pid_n * 64 + tl.arange(0, 64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, 128)
    mask_m = offs_m < M
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, num_kt)
    s, zb = load_scales(sz_ptr, (t0 * 128) // GS, offs_n, offs_n < N, N, ZERO, False, tl.float16)
    for t in range(t0, t1):
        s_next, zb = load_scales(sz_ptr, (tl.minimum(t + 1, t1 - 1) * 128) // GS, offs_n, offs_n < N, N, ZERO,
                                 False, tl.float16)
        # [r1 r2 n0 n1 n2 | n4 n5 | n3 r3 r0]: with no contiguity known (stride_wn), Triton gives the leading
        # dims to lanes, then warps, then registers: the wgmma A fragment's thread map
        p = tl.load(w_ptr + (t * 16 + R_IDX) * N + (pid_n * 64 + N_IDX) * stride_wn)
        p = tl.permute(p, (6, 5, 7, 4, 3, 2, 8, 1, 0, 9))                # [n5 n4 n3 n2 n1 n0, r3 r2 r1 r0]
        p = tl.reshape(p, (64, 16))
        c0 = p & 15
        c1 = (p >> 4) & 15
        c2 = (p >> 8) & 15
        c3 = (p >> 12) & 15
        c4 = (p >> 16) & 15
        c5 = (p >> 20) & 15
        c6 = (p >> 24) & 15
        c7 = (p >> 28) & 15
        j = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7)))
        q = (j | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        w = (q - 1032.0) * s[:, None, None, None, None]                  # [n, r, i0, i1, i2]
        w = tl.permute(w, (0, 4, 3, 2, 1))                               # [n, i2, i1, i0, r]: k = i * 16 + r
        w = tl.reshape(w, (64, 128))
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (t * 128 + offs_k)[None, :], mask=mask_m[:, None],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        s = s_next
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :])
    else:
        tl.atomic_add(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :], sem="relaxed")


def pack_frag(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] (N % 64 == 0, K % 128 == 0) -> int32 words in the kernel's fragment order."""
    n_, k_ = codes.shape
    a = torch.arange(1024, device=codes.device)
    kw2, kw3, kw0, kw1, n0, n1, n2, n4, n5, n3 = (((a >> i) & 1) for i in range(10))
    n = n0 + 2 * n1 + 4 * n2 + 8 * n3 + 16 * n4 + 32 * n5
    c = codes.view(n_ // 64, 64, k_ // 128, 128).permute(0, 2, 1, 3)
    out = torch.zeros(n_ // 64, k_ // 128, 1024, dtype=torch.int64, device=codes.device)
    for jj in range(8):
        j0, j1, j2 = jj & 1, (jj >> 1) & 1, (jj >> 2) & 1
        k = j0 + 2 * kw0 + 4 * kw1 + 8 * j1 + 16 * j2 + 32 * kw2 + 64 * kw3
        out |= c[:, :, n, k].long() << (4 * jj)
    out = torch.where(out >= 2 ** 31, out - 2 ** 32, out)
    return out.to(torch.int32).reshape(-1)


def frag_matmul(x, w, s, n, splits, stages, warps=4):
    m, k = x.shape
    kt = k // 128
    per = triton.cdiv(kt, splits)
    splits = triton.cdiv(kt, per)
    bm = max(16, triton.next_power_of_2(m)) if m <= 128 else 128
    y = torch.zeros(m, n, device=x.device, dtype=torch.float16) if splits > 1 else \
        torch.empty(m, n, device=x.device, dtype=torch.float16)
    frag_kernel[(n // 64, splits, triton.cdiv(m, bm))](x, w, s, y, m, n, k, per, x.stride(0), y.stride(0),
                                                       BLOCK_M=bm, SPLIT_K=splits, num_warps=warps,
                                                       num_stages=stages)
    return y


SHAPES = {"8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
          "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)}}


def main() -> None:
    from kernels import bench, copies, copy_bandwidth
    from quanta.kernels import affine_gemm
    from quanta.quant.kinds import Affine
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fragment-probe.json")
    ap.add_argument("--ms", default="16,32,64")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    out = {"meta": {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "copy_GBps": round(copy_bandwidth(), 1)}, "results": []}
    print(out["meta"], flush=True)
    for model, layers in SHAPES.items():
        for layer, (n, k) in layers.items():
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
            scales = (torch.rand(n, k // 128, device="cuda") * 0.01 + 0.001).half()
            aff = Affine(codes=codes, scales=scales, bits=4, group_size=128, zeros=8)
            nbytes = n * k // 2 + 2 * n * k // 128
            st = copies(lambda: affine_gemm.prepare(aff, "cuda", torch.float16), nbytes)
            fw = copies(lambda: (pack_frag(codes), scales.t().contiguous()), nbytes)
            fp16 = copies(lambda: (torch.randn(n, k, device="cuda") * 0.02).half(), 2 * n * k)
            wdq = ((codes.float() - 8) * scales.float().repeat_interleave(128, 1))
            for m in ms:
                xs = [torch.randn(m, k, device="cuda").half() for _ in range(4)]
                ref = xs[0].float() @ wdq.t()
                rec = {"model": model, "layer": layer, "m": m, "n": n, "k": k}
                rec["fp16"] = bench(lambda x, w: x @ w.t(), xs, fp16, 2 * n * k)
                rec["quanta"] = bench(affine_gemm.matmul, xs, st, nbytes)
                for splits in (1, 2, 4):
                    for stages in (3, 4):
                        got = frag_matmul(xs[0], *fw[0], n, splits, stages).float()
                        err = ((got - ref).abs().max() / ref.abs().max()).item()
                        us = bench(lambda x, w: frag_matmul(x, *w, n, splits, stages), xs, fw, nbytes)
                        rec[f"frag_s{splits}_st{stages}"] = us
                        rec[f"err_s{splits}_st{stages}"] = err
                best = min((v, key) for key, v in rec.items() if key.startswith("frag"))
                rec["best"] = best[1]
                rec["speedup_best"] = rec["fp16"] / best[0]
                rec["speedup_quanta"] = rec["fp16"] / rec["quanta"]
                out["results"].append(rec)
                print(f"{model} {layer:8s} M={m:3d} fp16 {rec['fp16']:7.1f} quanta {rec['quanta']:7.1f} "
                      f"({rec['speedup_quanta']:.2f}x) frag {best[0]:7.1f} ({rec['speedup_best']:.2f}x) {best[1]} "
                      f"err {max(v for kk, v in rec.items() if kk.startswith('err')):.2e}", flush=True)
            del st, fw, fp16
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()


@triton.jit
def frag3_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, GS, tiles_per_split, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, ZERO: tl.constexpr = 8):
    """Existing layout, one K=16 dot per code i so that the operand conversion can climb to the words."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_kt = K // 128
    offs_r = tl.arange(0, 16)
    offs_n = pid_n * 64 + tl.arange(0, 64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, num_kt)
    s, zb = load_scales(sz_ptr, (t0 * 128) // GS, offs_n, offs_n < N, N, ZERO, False, tl.float16)
    for t in range(t0, t1):
        s_next, zb = load_scales(sz_ptr, (tl.minimum(t + 1, t1 - 1) * 128) // GS, offs_n, offs_n < N, N, ZERO,
                                 False, tl.float16)
        p = tl.load(w_ptr + (t * 16 + offs_r)[None, :] * N + offs_n[:, None])      # [64 n, 16 r]
        for i in tl.static_range(8):
            c = (p >> (4 * i)) & 15
            q = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            w = (q - 1032.0) * s[:, None]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (t * 128 + i * 16 + offs_r)[None, :],
                        mask=mask_m[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        s = s_next
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :])
    else:
        tl.atomic_add(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :], sem="relaxed")


@triton.jit
def frag4_kernel(x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, GS, tiles_per_split, stride_xm, stride_ym,
                 BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, ZERO: tl.constexpr = 8):
    """Existing layout; words moved into the MMA accumulator layout (same thread map as operand A)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    num_kt = K // 128
    offs_r = tl.arange(0, 16)
    offs_n = pid_n * 64 + tl.arange(0, 64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros((64, BLOCK_M), dtype=tl.float32)
    zmma = tl.dot(tl.zeros((64, 16), dtype=tl.float16), tl.zeros((16, 16), dtype=tl.float16)).to(tl.int32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, num_kt)
    s, zb = load_scales(sz_ptr, (t0 * 128) // GS, offs_n, offs_n < N, N, ZERO, False, tl.float16)
    for t in range(t0, t1):
        s_next, zb = load_scales(sz_ptr, (tl.minimum(t + 1, t1 - 1) * 128) // GS, offs_n, offs_n < N, N, ZERO,
                                 False, tl.float16)
        p = tl.load(w_ptr + (t * 16 + offs_r)[None, :] * N + offs_n[:, None])      # [64 n, 16 r]
        p = p | zmma
        for i in tl.static_range(8):
            c = (p >> (4 * i)) & 15
            q = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            w = (q - 1032.0) * s[:, None]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (t * 128 + i * 16 + offs_r)[None, :],
                        mask=mask_m[:, None], other=0.0)
            acc = tl.dot(w, tl.trans(x), acc)
        s = s_next
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :])
    else:
        tl.atomic_add(y_ptrs, acc.to(tl.float16), mask=mask_m[None, :], sem="relaxed")
