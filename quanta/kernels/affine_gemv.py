"""The M <= 2 path of affine_gemm: a bandwidth-bound GEMV over the same packed layout, no tensor cores.

At M = 1 a 4-bit weight must stream at ~3 TB/s, i.e. ~6e12 codes/s; on an H100 that leaves about four
instructions per code, so the arithmetic, not the loads, limits a Triton GEMV. Per code it spends three
(LOP3, FADD, FFMA; the compiled inner loop is checked with `compile_check --sass gemv`):
  - no shift and no int->float conversion (a quarter-rate instruction): code i of a word is masked in
    place and OR-ed into the float 2**(23 - bits*j) (j = i mod PACK/2), whose unit in the last place is
    2**-(bits*j), so the float is 2**(23 - bits*j) + code exactly; one FADD removes the magic (and the
    symmetric zero point). The upper half of the word is reached with one shift per word.
  - scales leave the inner loop when a tile lies inside one group (group >= TILE_K, e.g. g128):
    sum_k x*(q*s + zb) = s * sum_k x*q + zb * sum_k x, applied once per tile per column.
  - a program's step covers RS word rows by BLOCK_N columns with the warps along N, so each thread holds
    8+ columns per row: each activation (one load, one convert) serves 8+ codes.
"""
from __future__ import annotations

import torch

from quanta.kernels.affine_gemm import R, AffineState, load_scales, reference  # noqa: F401  (the oracle)
from quanta.kernels.fp8_bits import fp8_to_f16
from quanta.kernels.triton_support import cdiv, num_sms, split_k, tl, triton


@triton.jit
def _affine_gemv_kernel(
    # pointers
    x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr,
    # sizes
    N, K, GS, tiles_per_split, num_tiles, magic,
    # strides
    stride_xm, stride_ym,
    # meta
    BITS: tl.constexpr, R: tl.constexpr, RS: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ZB: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    TILE_SCALE: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr,
):
    """y[m, n] (+)= sum_k x[m, k] * W[n, k]; program (row m, BLOCK_N columns, split of K tiles).

    MODE as in affine_gemm: AFFINE (magic numbers), LUT (a table gather per code), FP8_* (bit conversion).
    """
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    TILE_K: tl.constexpr = PACK * R
    MASK: tl.constexpr = (1 << BITS) - 1
    DT: tl.constexpr = x_ptr.dtype.element_ty
    # --- which row, columns and K range
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, RS)
    mask_n = offs_n < N
    x_row = x_ptr + pid_m * stride_xm
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros((RS, BLOCK_N), dtype=tl.float32)
    # --- main loop over tiles of TILE_K input columns, RS word rows at a time
    for t in range(t_begin, t_end):
        kt = t * TILE_K
        part = tl.zeros((RS, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((RS,), dtype=tl.float32)
        for a in tl.static_range(R // RS):
            rows = t * R + a * RS + offs_r
            p = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0,
                        eviction_policy="evict_first")
            p_hi = p.to(tl.uint32, bitcast=True) >> 16
            for i in tl.static_range(PACK):
                k = kt + i * R + a * RS + offs_r
                kx = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
                if EVEN_K:
                    x = tl.load(x_row + kx, eviction_policy="evict_last").to(tl.float32)
                else:
                    x = tl.load(x_row + kx, mask=k < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
                word = p if i < HALF else p_hi.to(tl.int32, bitcast=True)
                if MODE == 0:
                    # the float 2**(23 - bits*j) + code, exactly (magic = 0x4B000000, the float 2**23, is a
                    # run-time argument so that the compiler keeps it in a register: one LOP3 per code)
                    f = ((word & (MASK << (BITS * (i % HALF)))) | (magic - ((BITS * (i % HALF)) << 23))).to(
                        tl.float32, bitcast=True)
                else:
                    code = (word >> (BITS * (i % HALF))) & MASK
                    if MODE == 1:
                        f = tl.load(lut_ptr + code)
                    else:
                        f = fp8_to_f16(code, MODE - 2).to(tl.float32)
                if MODE != 0:                                # w = f * s: no magic, no zero point
                    if TILE_SCALE:
                        part += x[:, None] * f
                    else:
                        s, zb = load_scales(sz_ptr, (kt + i * R) // GS, offs_n[None, :], mask_n[None, :], N,
                                            ZERO, HAS_ZB, DT)
                        acc += x[:, None] * (f * s.to(tl.float32))
                elif TILE_SCALE:
                    if HAS_ZB:
                        part += x[:, None] * (f - (1 << (23 - BITS * (i % HALF))))
                        xsum += x
                    else:
                        part += x[:, None] * (f - ((1 << (23 - BITS * (i % HALF))) + ZERO))
                else:                                        # the group changes inside the tile
                    s, zb = load_scales(sz_ptr, (kt + i * R) // GS, offs_n[None, :], mask_n[None, :], N,
                                        ZERO, HAS_ZB, DT)
                    q = f - (1 << (23 - BITS * (i % HALF)))
                    acc += x[:, None] * (q * s.to(tl.float32) + zb.to(tl.float32))
        # --- once per tile: scale, and the zero point times the activations' sum
        if TILE_SCALE:
            s, zb = load_scales(sz_ptr, kt // GS, offs_n[None, :], mask_n[None, :], N, ZERO, HAS_ZB, DT)
            if HAS_ZB:
                acc += part * s.to(tl.float32) + xsum[:, None] * zb.to(tl.float32)
            else:
                acc += part * s.to(tl.float32)
    # --- epilogue: reduce the RS rows, add bias once, store or accumulate
    y = tl.sum(acc, axis=0)
    if HAS_BIAS:
        if pid_k == 0:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + pid_m * stride_ym + offs_n
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n, sem="relaxed")


# N -> (BLOCK_N, RS, num_warps); split-K then aims at WAVES programs per SM. Measured on the H100
# (benchmarks/RESULTS.md, sweep of 6 configs on the 8 Llama shapes): 256 columns x 4 rows on 2 warps with
# 8 waves was within 6% of the best config on every shape (1024 x 4 on 8 warps with 2 waves next).
GEMV_CONFIGS = ((1 << 30, (256, 4, 2)),)
WAVES = 8.0


def gemv(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None,
         config: tuple | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias), one program row per activation row (M small)."""
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    bn, rs, warps, waves = config or (*next(c for top, c in GEMV_CONFIGS if st.n <= top), WAVES)
    splits, per = split_k(m * cdiv(st.n, bn), st.num_tiles, num_sms(x2.device), waves, 2)
    atomic_dtype = torch.float16 if st.dtype == torch.float16 else torch.float32
    y = (torch.zeros(m, st.n, device=x2.device, dtype=atomic_dtype) if splits > 1
         else torch.empty(m, st.n, device=x2.device, dtype=st.dtype))
    tile_k = (32 // st.bits) * R
    _affine_gemv_kernel[(m, cdiv(st.n, bn), splits)](
        x2, st.packed, st.sz, st.perm if st.perm is not None else st.packed,
        st.lut if st.lut is not None else st.sz, bias if bias is not None else x2, y,
        st.n, st.k, st.group_size, per, st.num_tiles, 0x4B000000,
        x2.stride(0), y.stride(0), BITS=st.bits, R=R, RS=rs, ZERO=st.zero, BLOCK_N=bn, HAS_ZB=st.has_zb,
        HAS_PERM=st.perm is not None, HAS_BIAS=bias is not None, SPLIT_K=splits,
        TILE_SCALE=st.group_size % tile_k == 0, EVEN_K=st.k == st.k_pad, MODE=st.mode, num_warps=warps)
    return y if y.dtype == st.dtype else y.to(st.dtype)
