"""The split-K path of the affine kernels: a tiled `tl.dot` GEMM over the packed layout (layout.py), the weight
tile decoded in registers, then stored in shared memory for the tensor cores.

Where the register-operand kernels (mma.py, wgmma.py) do not run (before sm90, fp8 weight-only codes) it takes the
M between the GEMV and dequantize + cuBLAS; for small M the K loop is split over programs that add their partial
sums to a zeroed output, so that enough programs fill the SMs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import AFFINE, AffineState, R, decode, load_scales, split_k_output
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.triton_support import cdiv, split_k, tl, triton


@triton.jit
def _affine_gemm_kernel(
    # pointers
    x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr,
    # sizes
    M, N, K, GS, tiles_per_split, num_tiles,
    # strides (x and y are row-major; packed and scale-word rows are N long)
    stride_xm, stride_ym,
    # meta
    BITS: tl.constexpr, R: tl.constexpr, ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ZB: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    FP16_MAGIC: tl.constexpr, MODE: tl.constexpr,
):
    """y[M, N] (+)= x[M, K] @ dequant(packed)[K, N]; program (tile of M x N, split of K tiles).
    MODE: how a code becomes a number (see `decode`)."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = PACK * R
    MASK: tl.constexpr = (1 << BITS) - 1
    DT: tl.constexpr = x_ptr.dtype.element_ty
    # --- which tile and which K range
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m                       # M fastest: programs sharing a weight tile run together
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_i = tl.arange(0, PACK)
    offs_kk = tl.arange(0, TILE_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    shifts = (offs_i * BITS)[:, None, None]
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # --- main loop: one tile of TILE_K input columns per step
    for t in range(t_begin, t_end):
        kt = t * TILE_K
        p = tl.load(w_ptr + (t * R + offs_r)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        k = kt + offs_kk
        kx = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        g = ((kt + offs_i * R) // GS)[:, None, None]
        s, zb = load_scales(sz_ptr, g, offs_n[None, None, :], mask_n[None, None, :], N, ZERO, HAS_ZB, DT)
        code = (p[None, :, :] >> shifts) & MASK                       # [PACK, R, BLOCK_N]
        w = decode(code, s, zb, lut_ptr, ZERO, HAS_ZB, MODE, FP16_MAGIC, DT)
        acc = tl.dot(x, tl.reshape(w, (TILE_K, BLOCK_N)), acc)
    # --- epilogue: bias once (first split), then store or accumulate the split's partial sum
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")



class SplitKConfig(NamedTuple):
    """A split-K launch: BLOCK_M x BLOCK_N output tiles, the K loop split for about `waves` programs an SM."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    waves: float


# M bucket -> config on the chips with ~227 KB of shared memory a block (sm80, sm90)
SPLITK_CONFIGS = ((16, SplitKConfig(16, 128, 4, 3, 2.0)), (32, SplitKConfig(32, 64, 4, 3, 3.0)),
                  (64, SplitKConfig(64, 64, 4, 3, 2.0)), (128, SplitKConfig(64, 128, 4, 3, 1.5)),
                  (1 << 30, SplitKConfig(128, 256, 8, 3, 1.0)))
LARGE_SMEM = ((8, 0), (9, 0))       # the chips SPLITK_CONFIGS fit as they are; the others have ~100 KB or less


def default_config(st: AffineState, caps: DeviceCaps, m: int) -> SplitKConfig:
    """M's bucket of SPLITK_CONFIGS, cut to fit the shared memory of the chip: at most 64 x 128 tiles in 4 warps and
    2 stages where it has ~100 KB (sm86, sm89) or less; 128 columns for table and fp8 codes, whose decoding needs
    more registers and shared memory than a 128 x 256 tile leaves (227 KB)."""
    cfg = next(c for top, c in SPLITK_CONFIGS if m <= top)
    if caps.capability not in LARGE_SMEM:
        return SplitKConfig(min(cfg.block_m, 64), min(cfg.block_n, 128), min(cfg.warps, 4), 2, cfg.waves)
    if st.mode != AFFINE:
        return cfg._replace(block_n=min(cfg.block_n, 128))
    return cfg


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias); `config` (SplitKConfig's fields) is forced by tests and benchmarks."""
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    caps = caps or device_caps(x2.device)
    bm, bn, warps, stages, waves = config or default_config(st, caps, m)
    min_tiles = 4 if st.bits == 4 else 8
    splits, per = split_k(cdiv(m, bm) * cdiv(st.n, bn), st.num_tiles, caps.sm_count, waves, min_tiles)
    y = split_k_output(m, st, splits > 1, x2.device)
    grid = (cdiv(m, bm) * cdiv(st.n, bn), splits)
    _affine_gemm_kernel[grid](
        x2, st.packed, st.sz, st.perm if st.perm is not None else st.packed,
        st.lut_arg(False), bias if bias is not None else x2, y,
        m, st.n, st.k, st.group_size, per, st.num_tiles, x2.stride(0), y.stride(0),
        BITS=st.bits, R=R, ZERO=st.zero, BLOCK_M=bm, BLOCK_N=bn, HAS_ZB=st.has_zb,
        HAS_PERM=st.perm is not None, HAS_BIAS=bias is not None, SPLIT_K=splits,
        FP16_MAGIC=st.dtype == torch.float16, MODE=st.mode, num_warps=warps, num_stages=stages)
    return y.to(st.dtype)
