"""Affine int4 / int8 weights (AWQ, GPTQ, RTN, HQQ...) times fp16/bf16 activations, dequantized in registers.

Layout made once by `prepare()` (Marlin's lessons in Triton terms):
  packed [K_pad / PACK, N] int32, PACK = 32 // bits codes per word, packed along K so that every load is
  coalesced along N. Within each tile of TILE_K = PACK * R input columns (R = 16 rows of words), word
  row r holds the columns k = i * R + r for i = 0..PACK-1 (code i in bits [bits*i, bits*(i+1))), so that
  unpacking code i of a [R, BLOCK_N] tile is one shift and gives the contiguous K slice i of the tile.
  scales as int32 words [rows, N] of two 16-bit floats in the compute dtype, so that a scale row loads in
  the same register layout as a row of codes: with zero points, word g = (s_g | zbias_g << 16) where
  zbias = -s*z (or the float min) folds the zero into w = q*s + zbias; symmetric weights keep their one
  integer zero as a compile-time constant and word g holds (s_2g | s_2g+1 << 16).
  Act-order (g_idx): columns sorted by group once; activations are gathered through `perm` in-kernel.
Paths by M, chosen by `plan()` with the reason recorded: the GEMV in affine_gemv.py (no tensor cores, M <= 2; M = 1
on sm90 for fp16 and table codes), on sm90 the register-operand MMA kernel in affine_mma.py (M <= 512; 4-bit
affine codes with a scale row a K tile go to the Gluon wgmma kernel in affine_wgmma.py where it takes them: M =
2..16, or 32, M = 33..1024 (bf16 where its K loop is not split), and bf16 M = 1), elsewhere this file's split-K
`tl.dot` kernel (up to M = 255), and dequantize-to-fp16 + cuBLAS above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quanta.kernels import activation
from quanta.kernels.dequantized import reference  # noqa: F401  (the oracle of every path below)
from quanta.kernels.fp8_bits import fp8_to_f16
from quanta.kernels.triton_support import (
    capability,
    cdiv,
    num_sms,
    split_k,
    tl,
    triton,
    why_not_device,
    zero_,
)
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds.affine import Affine

NAME = "triton_affine"
AFFINE, LUT, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3       # how a code becomes a number (MODE of the kernels)
R = 16                      # word rows per tile: the K of one tensor-core step
GEMV_MAX_M = 2              # M at or below this runs the GEMV (see affine_gemv.py), 1 where the MMA kernel applies
CUBLAS_MIN_M = 256          # M at or above this dequantizes to fp16 and calls cuBLAS, where the MMA kernel does not
                            # apply (H100, M=256: the fused 128x256 tl.dot GEMM won on o/down but lost 30% on qkv)


@triton.jit
def load_scales(sz_ptr, g, cols, mask, N, ZERO: tl.constexpr, HAS_ZB: tl.constexpr, DT: tl.constexpr):
    """(scale, zbias) in dtype DT of groups g at columns cols (broadcastable), from the int32 scale words."""
    if HAS_ZB:
        v = tl.load(sz_ptr + g * N + cols, mask=mask, other=0)
        s = (v & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        zb = (v >> 16).to(tl.int16).to(DT, bitcast=True)
    else:
        v = tl.load(sz_ptr + (g // 2) * N + cols, mask=mask, other=0)
        s = ((v >> ((g % 2) * 16)) & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
        zb = (s.to(tl.float32) * -ZERO).to(DT)
    return s, zb


@triton.jit
def decode(code, s, zb, lut_ptr, ZERO: tl.constexpr, HAS_ZB: tl.constexpr, MODE: tl.constexpr,
           FP16_MAGIC: tl.constexpr, DT: tl.constexpr):
    """Weights in dtype DT from codes and their groups' (scale, zbias), in registers.

    MODE: AFFINE w = (code - zero) * s (+ zbias), the exact integer made through a magic-number float
    (2**23 + code in fp32, or 1024 + code in fp16 when FP16_MAGIC, i.e. DT is fp16) then one FMA;
    LUT w = lut[code] * s; FP8_* w = fp8(code) * s with the bytes converted by integer operations.
    """
    if MODE == 1:
        w = (tl.load(lut_ptr + code) * s.to(tl.float32)).to(DT)
    elif MODE >= 2:
        if FP16_MAGIC:
            w = (fp8_to_f16(code, MODE - 2) * s).to(DT)
        else:                                 # (the same product, exact in fp32, rounded once)
            w = (fp8_to_f16(code, MODE - 2).to(tl.float32) * s.to(tl.float32)).to(DT)
    elif FP16_MAGIC:
        q = (code | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)        # 1024 + code
        if HAS_ZB:
            w = (q - 1024.0) * s + zb
        else:
            w = (q - (1024.0 + ZERO)) * s
    else:
        q = (code | 0x4B000000).to(tl.float32, bitcast=True)                  # 2**23 + code
        if HAS_ZB:
            w = ((q - 8388608.0) * s.to(tl.float32) + zb.to(tl.float32)).to(DT)
        else:
            w = ((q - (8388608.0 + ZERO)) * s.to(tl.float32)).to(DT)
    return w


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


@triton.jit
def load_lut_words(lut_ptr):
    """The 8 int32 byte words of a 16-entry table (lut_byte_words), as scalars for the lookups' PTX operands."""
    return (tl.load(lut_ptr), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3), tl.load(lut_ptr + 4),
            tl.load(lut_ptr + 5), tl.load(lut_ptr + 6), tl.load(lut_ptr + 7))


def lut_lookup4_ptx(w: str, table: int, e01: str = "e01", e23: str = "e23", step: int = 1,
                    pairs: tuple[int, int] = (0x5140, 0x7362)) -> str:
    """PTX of a 16-entry table lookup of 4 codes, the nibbles 0-3 of the word register `w`, into two pairs of 16-bit
    entries `e01` (codes 0, 1) and `e23` (codes 2, 3) by byte permutes: the codes' low 3 bits select a byte from 8
    (prmt), once among entries 0-7 and once among 8-15, for the low and the high bytes; each code's bit 3, spread to a
    byte mask by a sign-replicating prmt, picks between the two; two more prmts interleave low and high bytes.
    `table`: the operand number of the first of the 8 table words (lut_byte_words), $table, $table + step, ...
    (step 2 under pack 2, where each input comes twice). `pairs`: the two interleaving selectors, (codes 0, 1) and
    (codes 2, 3) by default. Uses the registers sel, t, m, lo, lo2, hi, hi2 (declared by the caller)."""
    t = [f"${table + step * i}" for i in range(8)]
    return (f"and.b32 sel, {w}, 0x7777;\nprmt.b32 lo, {t[0]}, {t[1]}, sel;\nprmt.b32 lo2, {t[2]}, {t[3]}, sel;\n"
            f"prmt.b32 hi, {t[4]}, {t[5]}, sel;\nprmt.b32 hi2, {t[6]}, {t[7]}, sel;\nshl.b32 t, {w}, 4;\n"
            f"prmt.b32 m, t, {w}, 0xD9C8;\nlop3.b32 lo, lo, lo2, m, 0xD8;\nlop3.b32 hi, hi, hi2, m, 0xD8;\n"
            f"prmt.b32 {e01}, lo, hi, {pairs[0]:#06x};\nprmt.b32 {e23}, lo, hi, {pairs[1]:#06x};\n")


# A word's 8 table codes as four pairs of 16-bit entries ($0 codes 0, 1 .. $3 codes 6, 7), from the word $4 and the
# table words $5..$12: the dequantize kernel's lookup (no global gather per code)
_LUT_WORD = tl.constexpr("{\n.reg .b32 w, sel, t, m, lo, lo2, hi, hi2;\n" + lut_lookup4_ptx("$4", 5, "$0", "$1")
                         + "shr.u32 w, $4, 16;\n" + lut_lookup4_ptx("w", 5, "$2", "$3") + "}")


@triton.jit
def _affine_dequant_kernel(
    # pointers
    w_ptr, sz_ptr, lut_ptr, out_ptr,
    # sizes
    N, GS,
    # meta
    BITS: tl.constexpr, R: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZB: tl.constexpr,
    MODE: tl.constexpr, LOOKUP: tl.constexpr = False,
):
    """out[K_pad, N] = dequant(packed) in out's dtype (the transposed weight for cuBLAS). LOOKUP: 4-bit table codes
    looked up by byte permutes (lut_ptr: lut_byte_words in out's dtype), not gathered from memory per code."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    DT: tl.constexpr = out_ptr.dtype.element_ty
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_i = tl.arange(0, PACK)
    mask_n = offs_n < N
    # --- load one tile of words and its scales
    p = tl.load(w_ptr + (t * R + offs_r)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
    if LOOKUP:
        _store_table_codes(p, lut_ptr, sz_ptr, out_ptr, t, offs_r, offs_n, mask_n, N, GS, R, DT)
    else:
        g = ((t * PACK * R + offs_i * R) // GS)[:, None, None]
        s, zb = load_scales(sz_ptr, g, offs_n[None, None, :], mask_n[None, None, :], N, ZERO, HAS_ZB, DT)
        # --- dequantize (exact integer in fp32, then scale; or a table entry, gathered)
        code = (p[None, :, :] >> (offs_i * BITS)[:, None, None]) & MASK
        w = decode(code, s, zb, lut_ptr, ZERO, HAS_ZB, MODE, False, DT)
        # --- store rows k = t*TILE_K + i*R + r
        rows = t * PACK * R + offs_i[:, None, None] * R + offs_r[None, :, None]
        tl.store(out_ptr + rows * N + offs_n[None, None, :], w, mask=mask_n[None, None, :])


@triton.jit
def _store_table_codes(p, lut_ptr, sz_ptr, out_ptr, t, offs_r, offs_n, mask_n, N, GS, R: tl.constexpr,
                       DT: tl.constexpr):
    """The dequantize kernel's tile of 4-bit table codes: each word's 8 entries by _LUT_WORD (four pairs of 16-bit
    entries in DT), times their group's scale in fp32, rounded once to DT, stored at rows t * TILE_K + i * R + r."""
    lut = load_lut_words(lut_ptr)
    args = [p, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]]
    pairs = tl.inline_asm_elementwise(_LUT_WORD, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", args,
                                      dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    for j in tl.static_range(4):
        for h in tl.static_range(2):
            entry = ((pairs[j] >> (16 * h)) & 0xFFFF).to(tl.int16).to(DT, bitcast=True)
            k0 = t * 8 * R + (2 * j + h) * R                       # the code's K slice of the tile
            s = load_scales(sz_ptr, k0 // GS, offs_n[None, :], mask_n[None, :], N, 0, False, DT)[0]
            rows = k0 + offs_r
            tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], (entry.to(tl.float32) * s.to(tl.float32)).to(DT),
                     mask=mask_n[None, :])


@dataclass(slots=True)
class AffineState:
    """An affine weight in kernel layout (see the module docstring)."""
    packed: torch.Tensor            # int32 [K_pad // PACK, N]
    sz: torch.Tensor                # int32 [G_pad or G_pad / 2, N]: scale words (see the module docstring)
    has_zb: bool                    # words hold (scale, zbias) pairs; else pairs of symmetric scales
    perm: torch.Tensor | None       # int32 [K]: column k of the sorted weight reads x[:, perm[k]]
    n: int
    k: int
    k_pad: int
    bits: int
    group_size: int                 # group of column k is k // group_size (k_pad for per-channel)
    zero: int                       # the symmetric zero point (unused when zbias is given)
    dtype: torch.dtype
    mode: int = AFFINE              # AFFINE, LUT (codebook_gemm) or FP8_* (fp8_gemm)
    lut: torch.Tensor | None = None  # float32 [2**bits] for LUT
    lut_bytes: torch.Tensor | None = None  # int32 [8]: the fp16 table's low bytes, then high bytes (GEMV H2)

    @property
    def num_tiles(self) -> int:
        return self.k_pad // ((32 // self.bits) * R)

    @property
    def table_lookup(self) -> bool:
        """Whether the codes can be looked up by byte permutes: a 16-entry table (4-bit codes), whose byte words
        pack() made."""
        return self.lut_bytes is not None

    def lut_arg(self, lookup: bool) -> torch.Tensor:
        """The kernels' lut_ptr: the table's byte words for the byte-permute lookup, else the float table, else (no
        table) any tensor, never read."""
        return self.lut_bytes if lookup else self.lut if self.lut is not None else self.sz


# --- the launchers: check -> allocate -> launch ---------------------------------------------------

# M bucket -> (BLOCK_M, BLOCK_N, num_warps, num_stages, waves of split-K programs per SM)
GEMM_CONFIGS = ((16, (16, 128, 4, 3, 2.0)), (32, (32, 64, 4, 3, 3.0)), (64, (64, 64, 4, 3, 2.0)),
                (128, (64, 128, 4, 3, 1.5)), (1 << 30, (128, 256, 8, 3, 1.0)))


def plan(m: int, st: AffineState) -> tuple[str, str]:
    """Which path runs M rows of this weight, and why."""
    mma = affine_mma.applies(st)
    table_gather = st.mode == LUT and not affine_gemv.h2_applies(st)      # the GEMV's fp32 loop gathers per code
    if mma and affine_mma.h2_applies(st):                # (measured against the GEMV with PTX decoding)
        gemv_max = 0 if table_gather else 1
    else:
        gemv_max = 1 if table_gather else GEMV_MAX_M
    if affine_wgmma.takes(m, st):
        return "wgmma", (f"M={m}, 4-bit affine codes on sm90: one asynchronous wgmma per code, decoded into its "
                         "register operand while the previous ones run (Gluon; H100: 1.03-1.26x the MMA kernel at "
                         "M = 2..32, e.g. 8B gate_up M = 16 27.4 us against 30.4; bf16 M = 1 1.11-1.34x the GEMV on "
                         "the larger weights; above M = 32 two warpgroups share 128 rows of x, faster than the MMA "
                         "kernel and dequantize + cuBLAS up to M = 1024)")
    if m <= gemv_max:
        return "gemv", (f"M={m} <= {gemv_max}: bandwidth-bound GEMV without tensor cores "
                        "(packed-half FMAs for fp16, else fp32; M = 2 runs the MMA kernel where it decodes in PTX, "
                        "H100: 1.10-1.32x faster on the 8 Llama shapes, 1.3-2.5x for table codes; bf16 table codes "
                        "from M = 1, 2.1-32x faster than the GEMV's gather loop)")
    if m <= affine_mma.MMA_MAX_M and mma:
        return "mma", (f"M={m} <= {affine_mma.MMA_MAX_M}: yT = W xT with the decoded weight as the MMA's register "
                       "operand (no shared-memory round trip; H100: 1.1-1.5x the split-K GEMM at M=4..64, "
                       "1.1-1.9x dequantize + cuBLAS at M=256..512, stream-K where tiles leave a wave short; "
                       "table codes looked up by byte permutes)")
    if st.mode == LUT:
        return "cublas", (f"M={m}, table codes: the split-K kernel gathers the table per code; dequantize to "
                          f"{st.dtype} (by byte permutes on CUDA) + cuBLAS is faster (H100, 8B/70B shapes)")
    if m >= CUBLAS_MIN_M:
        return "cublas", f"M={m} >= {CUBLAS_MIN_M}: compute-bound; dequantize to {st.dtype} + cuBLAS"
    return "gemm", f"M={m}: split-K tl.dot GEMM with in-register dequantization"


def split_k_output(m: int, st: AffineState, added: bool, device: torch.device) -> torch.Tensor:
    """y [M, N] for a launch of this weight: where programs add partial sums (split-K, stream-K) zeroed, in fp16 or,
    for bf16, float32 (each bf16 addition would round at 8 bits); else uninitialised in the compute dtype. The
    launcher returns y.to(st.dtype)."""
    if not added:
        return torch.empty(m, st.n, device=device, dtype=st.dtype)
    sums = torch.float16 if st.dtype == torch.float16 else torch.float32
    return zero_(torch.empty(m, st.n, device=device, dtype=sums))


def gemm(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None,
         config: tuple | None = None) -> torch.Tensor:
    """The tl.dot path: y[M, N] = x2[M, K] @ W.T (+ bias); split-K for small M."""
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    bm, bn, warps, stages, waves = config or next(c for top, c in GEMM_CONFIGS if m <= top)
    if capability(x2.device) not in ((8, 0), (9, 0)):     # ~100 KB of shared memory (sm86, sm89) or less
        bm, bn, warps, stages = min(bm, 64), min(bn, 128), min(warps, 4), 2
    elif st.mode != AFFINE:                                # table / fp8 decoding: 128x256 overflows 227 KB
        bn = min(bn, 128)
    min_tiles = 4 if st.bits == 4 else 8
    splits, per = split_k(cdiv(m, bm) * cdiv(st.n, bn), st.num_tiles, num_sms(x2.device), waves, min_tiles)
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


def dequantize_t(st: AffineState, block_n: int = 128, warps: int = 4, lookup: bool | None = None) -> torch.Tensor:
    """The weight transposed, [K, N] in the compute dtype (rows in sorted order when act-ordered); `block_n` and
    `warps` (columns and warps a program) are swept by benchmarks/probes/dequant_sweep.py. `lookup`: 4-bit table
    codes by byte permutes (default on CUDA, where PTX runs; the interpreter's tests force it with an emulator)."""
    if lookup is None:
        lookup = st.packed.device.type == "cuda"
    lookup = lookup and st.table_lookup
    out = torch.empty(st.k_pad, st.n, device=st.packed.device, dtype=st.dtype)
    _affine_dequant_kernel[(st.num_tiles, cdiv(st.n, block_n))](
        st.packed, st.sz, st.lut_arg(lookup), out, st.n, st.group_size, BITS=st.bits, R=R, ZERO=st.zero,
        BLOCK_N=block_n, HAS_ZB=st.has_zb, MODE=st.mode, LOOKUP=lookup, num_warps=warps)
    return out[: st.k]


def cublas(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to the compute dtype, then cuBLAS: wins once the GEMM is compute-bound."""
    if st.perm is not None:
        x2 = x2.index_select(1, st.perm)
    w_t = dequantize_t(st)
    return torch.addmm(bias, x2, w_t) if bias is not None else x2 @ w_t


def matmul(x: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None,
           path: str | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K]; `path` forces one of plan()'s paths (benchmarks, tests)."""
    x2 = x.reshape(-1, st.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    path = path or plan(x2.shape[0], st)[0]
    if path == "gemv":
        y = affine_gemv.gemv(x2, st, bias)
    elif path == "wgmma":
        y = affine_wgmma.matmul(x2, st, bias)
    elif path == "mma":
        y = affine_mma.matmul(x2, st, bias)
    elif path == "cublas":
        y = cublas(x2, st, bias)
    else:
        y = gemm(x2, st, bias)
    return y.reshape(*x.shape[:-1], st.n)


# --- registry protocol ----------------------------------------------------------------------------

def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if not isinstance(weight, Affine):
        return "not an affine weight"
    if weight.bits not in (4, 8):
        return f"int{weight.bits}: only 4- and 8-bit codes are packed"
    if weight.num_groups > 1 and weight.group_size % R:
        return f"group size {weight.group_size} is not a multiple of {R}"
    return why_not_device(device, dtype)


def prepare(weight: Affine, device: torch.device, dtype: torch.dtype) -> AffineState:
    """Repack once: sort act-order columns, pack codes along K, fold zero points into scale words."""
    w = weight.to(device)
    n, k = w.shape
    codes, perm = w.codes, None
    if w.g_idx is not None:
        order = torch.argsort(w.g_idx.long(), stable=True)
        if not torch.equal(w.g_idx.long()[order], torch.arange(k, device=order.device) // w.group_size):
            raise UnsupportedError(f"{w.describe()} {list(w.shape)}: g_idx groups are not "
                                   f"{w.group_size} columns each once sorted")
        if not torch.equal(order, torch.arange(k, device=order.device)):
            codes, perm = codes[:, order], order.to(torch.int32)
    group = w.group_size if w.num_groups > 1 else None
    scales = w.effective_scales()           # bnb int8's post_scale (1/127) folded in
    if w.mins is not None:
        mins = w.mins.float() if w.post_scale is None else w.mins.float() * w.post_scale
        return pack(codes, w.bits, group, scales, dtype, zbias=mins, perm=perm)
    if isinstance(w.zeros, torch.Tensor):
        return pack(codes, w.bits, group, scales, dtype, zbias=-scales * w.zeros.float(), perm=perm)
    return pack(codes, w.bits, group, scales, dtype, zero=int(w.zeros), perm=perm)


def pack(codes: torch.Tensor, bits: int, group: int | None, scales: torch.Tensor, dtype: torch.dtype,
         zbias: torch.Tensor | None = None, zero: int = 0, perm: torch.Tensor | None = None,
         mode: int = AFFINE, lut: torch.Tensor | None = None) -> AffineState:
    """Kernel layout of codes [N, K] (uint8) with scales [N, G] over groups of `group` columns (None: one
    group per row); shared by the affine, codebook and FP8 weight-only kernels."""
    n, k = codes.shape
    pack_n = 32 // bits
    tile_k = pack_n * R
    k_pad = cdiv(k, tile_k) * tile_k
    group = group or k_pad
    # codes [N, K_pad] -> [tiles, PACK, R, N] -> words [tiles * R, N]
    c = F.pad(codes, (0, k_pad - k)).view(n, k_pad // tile_k, pack_n, R).permute(1, 2, 3, 0)
    words = torch.zeros(k_pad // tile_k, R, n, dtype=torch.int64, device=codes.device)
    for i in range(pack_n):
        words |= c[:, i].to(torch.int64) << (bits * i)
    packed = _int32(words).reshape(-1, n)
    g_pad = cdiv(k_pad, group)

    def by_group(t: torch.Tensor) -> torch.Tensor:       # [N, G] float -> 16-bit patterns [G_pad, N], int64
        out = torch.zeros(g_pad, n, dtype=torch.float32, device=t.device)
        out[: t.shape[1]] = t.float().t()
        return out.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF

    s = by_group(scales)
    if zbias is not None:
        sz = s | by_group(zbias) << 16
    else:                                                # two groups' scales per word
        s = F.pad(s, (0, 0, 0, g_pad % 2))
        sz = s[0::2] | s[1::2] << 16
    return AffineState(packed.contiguous(), _int32(sz).contiguous(), zbias is not None, perm, n, k, k_pad,
                       bits, group, zero, dtype, mode, lut.float().contiguous() if lut is not None else None,
                       lut_byte_words(lut, dtype) if lut is not None and lut.numel() == 16 else None)


def lut_byte_words(lut: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A 16-entry table in a 16-bit float dtype, byte-sliced for PTX `prmt` lookups: int32 [8], words 0-3 holding
    the low bytes of entries 0-3, 4-7, 8-11, 12-15 and words 4-7 their high bytes."""
    h = lut.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    planes = torch.stack([h & 0xFF, h >> 8]).view(2, 4, 4)                    # [byte, word, entry]
    words = (planes << torch.tensor([0, 8, 16, 24], device=lut.device)).sum(-1).reshape(8)
    return _int32(words).contiguous()


def _int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit patterns held in int64 -> the same bits as int32."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None = None) -> torch.Tensor:
    return matmul(x, state, bias)


def apply_glu(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = x @ W.T + bias, W stacking the MLP's gate and up: on the GEMV
    path the kernel's epilogue makes it (one launch fewer per decode layer); else matmul, then
    activation.silu_and_mul."""
    x2 = x.reshape(-1, state.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if plan(x2.shape[0], state)[0] == "gemv":
        y = affine_gemv.gemv(x2, state, bias, glu=True)
    else:
        y = activation.silu_and_mul(matmul(x2, state, bias))
    return y.reshape(*x.shape[:-1], state.n // 2)


from quanta.kernels import affine_gemv, affine_mma, affine_wgmma  # noqa: E402  (import this module's names: kept last)
