"""The MMA path of the affine kernels: a tensor-core GEMM whose decoded weight tile is the MMA's A operand, straight
from registers (sm90: Hopper's wgmma reads operand A from registers).

The product is computed transposed, yᵀ = W · xᵀ, so that the weight is the operand read from registers
(_affine_mma_kernel says why). No layout of its own: the kernel reads layout.py's packed words and decodes them
into the operand in place (_partial). The launcher (matmul) splits K or balances the output tiles by stream-K;
MMA_CONFIGS and default_config choose a program's shape by M.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import (
    AFFINE,
    H2_PAIR_BF16,
    H2_PAIR_BF16_HIGH,
    H2_PAIR_F16,
    LUT,
    AffineState,
    R,
    decode,
    load_lut_words,
    load_scales,
    lut_lookup4_ptx,
    split_k_output,
)
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.triton_support import (
    cdiv,
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    split_k,
    stream_k,
    tl,
    triton,
    wave_steps,
    whole_wave_split_k,
)

# PTX of one table lookup (NF4 / FP4), four codes: $0 $1 the pairs of codes 2j and 2j + 1 of words $2 $3 (columns
# 2q, 2q+1); $4 (and $5) the prmt selector of byte j of both words; $6, $8, .. $20 the table's bytes
# (layout.lut_byte_words; each input comes twice under pack 2); $22 $23 the scale pairs of codes 2j and 2j + 1.
# The gathered nibbles go through layout.lut_lookup4_ptx, whose interleave here pairs the same code of the two
# words (bytes 0 and 2, then 1 and 3) instead of two codes of one word. fp16 scales with mul.rn.f16x2; bf16 (no
# bf16x2 mul before sm90) with fma.rn.bf16x2 and an addend of -0, which leaves every product as it is.
_TABLE_LOOKUP = (".reg .b32 g, t, sel, m, lo, lo2, hi, hi2, e0, e1, z;\nprmt.b32 g, $2, $3, $4;\n"
                 + lut_lookup4_ptx("g", 6, "e0", "e1", step=2, pairs=(0x6240, 0x7351)))
_TABLE_CONSTRAINTS = tl.constexpr("=r,=r" + ",r" * 22)
_TABLE_F16 = tl.constexpr("{" + _TABLE_LOOKUP + "mul.rn.f16x2 $0, e0, $22;\nmul.rn.f16x2 $1, e1, $23;\n}")
_TABLE_BF16 = tl.constexpr("{" + _TABLE_LOOKUP + "mov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, e0, $22, z;\n"
                           "fma.rn.bf16x2 $1, e1, $23, z;\n}")


@triton.jit
def _h2_codes(p, i: tl.constexpr, s, zb, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZB: tl.constexpr,
              R: tl.constexpr, DT: tl.constexpr, BN: tl.constexpr):
    """Weights [BN, R] in DT (fp16, or bf16 with 4-bit codes) of code i of words p [BN, R] (column i * R + r), two
    columns per instruction.

    fp16 affine codes decode two columns at a time: `prmt` gathers the same code of the words r and r + 1 (columns
    2q and 2q + 1) into the two halves, `lop3` masks it and ORs in the exponent of 1024, one exact `fma.f16x2`
    takes off the magic and the zero point (for a high nibble, which `lop3` leaves 16x, it also divides by 16),
    and one more applies the scale (and zbias): layout.H2_PAIR_*. bf16 4-bit codes decode the same way around 128,
    the exponent of which leaves a 7-bit mantissa: a high nibble is shifted down first, and the scale is an fma
    with -0 (5 instructions a pair)."""
    BYTE: tl.constexpr = i // 2 if BITS == 4 else i
    SEL: tl.constexpr = BYTE | (BYTE << 4) | ((4 + BYTE) << 8) | ((4 + BYTE) << 12)
    HIGH: tl.constexpr = BITS == 4 and i % 2 == 1
    F16: tl.constexpr = DT == tl.float16
    SHIFTED: tl.constexpr = HIGH and not F16                        # bf16: shifted down in the PTX
    MASK: tl.constexpr = 0x00F000F0 if HIGH and F16 else (0x000F000F if BITS == 4 else 0x00FF00FF)
    FACTOR: tl.constexpr = 0.0625 if HIGH and F16 else 1.0          # an fp16 high nibble comes out 16x
    Z: tl.constexpr = 0 if HAS_ZB else ZERO
    ADDEND: tl.constexpr = -(128.0 + Z) if not F16 else (-(64.0 + Z) if HIGH else -(1024.0 + Z))
    pairs = tl.reshape(p, (BN, R // 2, 2))                          # columns 2q, 2q+1: one pack of two
    shape: tl.constexpr = (BN, R // 2, 2)
    if HAS_ZB:
        addend = tl.broadcast_to(zb[:, None, None], shape)
    else:                                        # -0 by its bits: a float -0.0 constant reaches ptxas as +0
        addend = tl.full(shape, -32768, tl.int16).to(DT, bitcast=True)
    # (constants made in fp32: the interpreter has no bf16 constants)
    args = [pairs, tl.full(shape, SEL, tl.int32), tl.full(shape, MASK, tl.int32),
            tl.full(shape, FACTOR, tl.float32).to(DT), tl.full(shape, ADDEND, tl.float32).to(DT),
            tl.broadcast_to(s[:, None, None], shape), addend]
    # pack 2: a 32-bit input is two operands, a 16-bit one one; dtype a literal (Triton 3.6 refuses a constexpr DT)
    w = tl.inline_asm_elementwise(H2_PAIR_F16 if F16 else (H2_PAIR_BF16_HIGH if SHIFTED else H2_PAIR_BF16),
                                  "=r,r,r,r,r,r,r,r,r,r,r", args, dtype=tl.float16 if F16 else tl.bfloat16,
                                  is_pure=True, pack=2)
    return tl.reshape(w, (BN, R))


@triton.jit
def _table_pairs(p, j: tl.constexpr, lut, s0, s1, R: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
    """Weights [BN, R] of codes 2j and 2j + 1 of words p [BN, R] (columns 2j * R + r, (2j + 1) * R + r), looked up in
    the 16-entry table `lut` (8 words of its bytes) and scaled by s0, s1 [BN], two columns per instruction.

    4-bit table codes (NF4 / FP4, fp16 or bf16) are looked up four at a time by byte permutes in registers
    (_TABLE_LOOKUP: 14 instructions for 4 codes, the affine pairs' 8), not gathered from memory per code."""
    pairs = tl.reshape(p, (BN, R // 2, 2))                          # columns 2q, 2q+1: one pack of two
    shape: tl.constexpr = (BN, R // 2, 2)
    SEL: tl.constexpr = j | ((4 + j) << 4) | (j << 8) | ((4 + j) << 12)
    args = [pairs, tl.full(shape, SEL, tl.int32), lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7],
            tl.broadcast_to(s0[:, None, None], shape), tl.broadcast_to(s1[:, None, None], shape)]
    if DT == tl.float16:
        w0, w1 = tl.inline_asm_elementwise(_TABLE_F16, _TABLE_CONSTRAINTS, args, dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=2)
    else:
        w0, w1 = tl.inline_asm_elementwise(_TABLE_BF16, _TABLE_CONSTRAINTS, args, dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=2)
    return tl.reshape(w0, (BN, R)), tl.reshape(w1, (BN, R))


@triton.jit
def _by_row(v, BN: tl.constexpr):
    """[1, 8W, C] values of the columns y_cols as [BN], one per MMA row (16 W) j + 16 w + 8 h + g (the row map:
    row (j, w, h, g) is column C (8 w + g) + 2 j + h of the block)."""
    WARPS: tl.constexpr = v.shape[1] // 8
    C: tl.constexpr = v.shape[2]
    return tl.reshape(tl.permute(tl.reshape(v, (WARPS, 8, C // 2, 2)), (2, 0, 3, 1)), (BN,))


@triton.jit
def _by_column(acc, WARPS: tl.constexpr):
    """The inverse of _by_row for a [BN, BM] tile of MMA rows: [BM, BN] in the block's column order."""
    BN: tl.constexpr = acc.shape[0]
    BM: tl.constexpr = acc.shape[1]
    C: tl.constexpr = BN // (8 * WARPS)
    return tl.reshape(tl.permute(tl.reshape(acc, (C // 2, WARPS, 2, 8, BM)), (4, 1, 3, 0, 2)), (BM, BN))


@triton.jit
def _row_scales(sz_ptr, g, y_cols, N, ZERO: tl.constexpr, HAS_ZB: tl.constexpr, DT: tl.constexpr,
                BN: tl.constexpr):
    """(scale, zbias) [BN] of group g for the MMA rows: read at y_cols (adjacent columns a thread), then mapped."""
    s, zb = load_scales(sz_ptr, g, y_cols, y_cols < N, N, ZERO, HAS_ZB, DT)
    return _by_row(s, BN), _by_row(zb, BN)


@triton.jit
def _codes(p, i: tl.constexpr, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS: tl.constexpr,
           ZERO: tl.constexpr, HAS_ZB: tl.constexpr, MODE: tl.constexpr, TILE_SCALE: tl.constexpr,
           H2: tl.constexpr, R: tl.constexpr, DT: tl.constexpr, BN: tl.constexpr):
    """(weights [BN, R] in DT of code i of words p: columns kt + i * R + r; the scales they took). With H2 two
    columns an instruction (_h2_codes); other modes (bf16 8-bit codes, fp8) decode per element through
    layout.decode. Groups narrower than the tile: s, zb are code i - 1's, read again only where a group begins
    when groups tile the K tile in whole codes (a group of 32 spans two codes; a scale read is a load and a map to
    the MMA rows); else every code's."""
    WHOLE_CODES: tl.constexpr = GS % R == 0 and ((32 // BITS) * R) % GS == 0
    if not TILE_SCALE and (not WHOLE_CODES or (i * R) % GS == 0):
        s, zb = _row_scales(sz_ptr, (kt + i * R) // GS, y_cols, N, ZERO, HAS_ZB, DT, BN)
    if H2:
        w = _h2_codes(p, i, s, zb, BITS, ZERO, HAS_ZB, R, DT, BN)
    else:
        w = decode((p >> (BITS * i)) & ((1 << BITS) - 1), s[:, None], zb[:, None], lut_ptr, ZERO, HAS_ZB, MODE,
                   DT == tl.float16, DT)
    return w, s, zb


@triton.jit
def _pair_scales(sz_ptr, kt, j: tl.constexpr, s, s0, GS, y_cols, N, TILE_SCALE: tl.constexpr, R: tl.constexpr,
                 DT: tl.constexpr, BN: tl.constexpr, ZERO: tl.constexpr = 0):
    """Scales [BN] of codes 2j and 2j + 1 of the tile at column kt: the tile's s with TILE_SCALE; else code 2j's row,
    loaded where its group begins (s0, code 2j - 2's, kept while the group runs on: every group begins at a code
    when it divides the tile), and code 2j + 1's where the group changes inside the pair."""
    if TILE_SCALE:
        s0 = s
        s1 = s
    else:
        if j == 0 or (8 * R) % GS != 0 or (2 * j * R) % GS == 0:
            s0 = _row_scales(sz_ptr, (kt + 2 * j * R) // GS, y_cols, N, ZERO, False, DT, BN)[0]
        if GS % (2 * R) == 0:
            s1 = s0
        else:
            s1 = _row_scales(sz_ptr, (kt + (2 * j + 1) * R) // GS, y_cols, N, ZERO, False, DT, BN)[0]
    return s0, s1


@triton.jit
def _table_tile(p, lut, sz_ptr, kt, GS, y_cols, N, s, TILE_SCALE: tl.constexpr, R: tl.constexpr, DT: tl.constexpr,
                BN: tl.constexpr, ZERO: tl.constexpr):
    """The 8 codes' weights [BN, R] of 4-bit table codes p, two codes a _table_pairs."""
    s0, s1 = _pair_scales(sz_ptr, kt, 0, s, s, GS, y_cols, N, TILE_SCALE, R, DT, BN, ZERO)
    w0, w1 = _table_pairs(p, 0, lut, s0, s1, R, BN, DT)
    s0, s1 = _pair_scales(sz_ptr, kt, 1, s, s0, GS, y_cols, N, TILE_SCALE, R, DT, BN, ZERO)
    w2, w3 = _table_pairs(p, 1, lut, s0, s1, R, BN, DT)
    s0, s1 = _pair_scales(sz_ptr, kt, 2, s, s0, GS, y_cols, N, TILE_SCALE, R, DT, BN, ZERO)
    w4, w5 = _table_pairs(p, 2, lut, s0, s1, R, BN, DT)
    s0, s1 = _pair_scales(sz_ptr, kt, 3, s, s0, GS, y_cols, N, TILE_SCALE, R, DT, BN, ZERO)
    w6, w7 = _table_pairs(p, 3, lut, s0, s1, R, BN, DT)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _decoded_tile(p, sz_ptr, lut_ptr, lut, kt, GS, y_cols, N, s, zb, BITS: tl.constexpr, ZERO: tl.constexpr,
                  HAS_ZB: tl.constexpr, MODE: tl.constexpr, TILE_SCALE: tl.constexpr, H2: tl.constexpr,
                  R: tl.constexpr, DT: tl.constexpr, BN: tl.constexpr):
    """The weight tile [BN, PACK * R] of words p (column i * R + r from code i of word r), in operand A's layout
    when p is in the accumulator's: the codes' joins become register dims, which is where the operand holds
    its 16-column slices; one tl.dot per tile keeps Triton's wgmma asynchronous (one per code waits for each).
    `lut`: the table's 8 byte words (MODE LUT with H2), else unused."""
    if MODE == 1 and H2:                                            # table codes, four a lookup
        w0, w1, w2, w3, w4, w5, w6, w7 = _table_tile(p, lut, sz_ptr, kt, GS, y_cols, N, s, TILE_SCALE, R, DT, BN,
                                                     ZERO)
    else:
        w0, s, zb = _codes(p, 0, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE, TILE_SCALE,
                           H2, R, DT, BN)
        w1, s, zb = _codes(p, 1, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE, TILE_SCALE,
                           H2, R, DT, BN)
        w2, s, zb = _codes(p, 2, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE, TILE_SCALE,
                           H2, R, DT, BN)
        w3, s, zb = _codes(p, 3, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE, TILE_SCALE,
                           H2, R, DT, BN)
        if BITS == 4:
            w4, s, zb = _codes(p, 4, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE,
                               TILE_SCALE, H2, R, DT, BN)
            w5, s, zb = _codes(p, 5, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE,
                               TILE_SCALE, H2, R, DT, BN)
            w6, s, zb = _codes(p, 6, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE,
                               TILE_SCALE, H2, R, DT, BN)
            w7, s, zb = _codes(p, 7, sz_ptr, lut_ptr, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE,
                               TILE_SCALE, H2, R, DT, BN)
    if BITS == 8:
        j = tl.join(tl.join(w0, w1), tl.join(w2, w3))                 # [BN, R, i0, i1]
        tile = tl.reshape(tl.permute(j, (0, 3, 2, 1)), (BN, 4 * R))   # [BN, i1 i0 r]
    else:
        j = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
        tile = tl.reshape(tl.permute(j, (0, 4, 3, 2, 1)), (BN, 8 * R))   # [BN, i2 i1 i0 r]
    return tile


@triton.jit
def _partial(x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr, M, N, K, GS, tile, n_blocks, t_begin, t_end,
             num_tiles, stride_xm, stride_ym, BITS: tl.constexpr, R: tl.constexpr, ZERO: tl.constexpr,
             BLOCK_M: tl.constexpr, HAS_ZB: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
             ATOMIC: tl.constexpr, MODE: tl.constexpr, TILE_SCALE: tl.constexpr, H2: tl.constexpr,
             BLOCK_N: tl.constexpr, PDL: tl.constexpr, WARPS: tl.constexpr):
    """K tiles [t_begin, t_end) of output tile `tile` (BLOCK_N weight rows of column block tile % n_blocks, BLOCK_M
    rows of x of block tile // n_blocks): stored, or added to y (zeroed) when ATOMIC; nothing when the range is
    empty (a stream-K program's spare segment).

    In a tile, word row r holds the columns k = i * R + r (i = 0..PACK-1). The A fragment of an m64nNk16 MMA gives
    lane (g, q) = (lane // 4, lane % 4) of warp w the rows 64j + 16w + g and 64j + 16w + g + 8 (j the repetition)
    and the columns 2q, 2q+1, 2q+8, 2q+9 of every 16: that is, the words r = 2q, 2q+1, 2q+8, 2q+9 of those rows,
    whose codes are those columns in every 16-column slice. The MMA accumulator of a [rows, 16] product has that
    same thread map, so the words are OR-ed with zeros in the accumulator layout: Triton then reads them from the
    pipeliner's shared-memory buffer straight into it, the decoded codes are joined along register dims only, and
    the tile reaches the MMA without a conversion (sm90 SASS: no ldmatrix, no shared store of weights in the
    loop). One tl.dot per tile: a dot per code makes Triton wait for each wgmma.

    Which weight row an MMA row computes is the kernel's choice (the output is stored through the same map): MMA
    row (16 W) j + 16 w + 8 h + g takes weight row C (8 w + g) + 2 j + h of the block, C = 2 x repetitions. A
    thread's rows are then C adjacent columns of memory, so each word row arrives by C * 4-byte cp.async, and the
    outputs leave as vector stores or atomics. Loaded in the row-major order of an unswizzled shared buffer, [word
    row // 8, word row % 2, lane group, q, C columns], a phase of lanes reads 128 contiguous bytes (C <= 4; at
    C = 8, 4-way bank conflicts that Triton's choice of buffer order leaves). With identity rows the words would
    come by 4-byte copies."""
    PACK: tl.constexpr = 32 // BITS
    TILE_K: tl.constexpr = PACK * R
    DT: tl.constexpr = x_ptr.dtype.element_ty
    C: tl.constexpr = BLOCK_N // (8 * WARPS)                        # words per thread per word row (2 a rep)
    n0 = (tile % n_blocks) * BLOCK_N
    y_cols = n0 + tl.arange(0, 8 * WARPS)[None, :, None] * C + tl.arange(0, C)[None, None, :]   # [1, 8W, C]
    # the words as [r // 8, r % 2, 8W, r % 8 // 2, C]: a thread's C columns, then the lanes' q, then their g, in the
    # order of Triton's (unswizzled) shared buffer: with C <= 4 a phase of lanes reads 128 bytes, free of conflicts.
    # Built from aranges, not by reshaping y_cols: the reshape hid the columns' contiguity (4-byte copies)
    w_cols = n0 + tl.arange(0, 8 * WARPS)[None, None, :, None, None] * C + tl.arange(0, C)[None, None, None, None, :]
    word_rows = (8 * tl.arange(0, 2)[:, None, None, None, None] + tl.arange(0, 2)[None, :, None, None, None]
                 + 2 * tl.arange(0, 4)[None, None, None, :, None])
    offs_m = (tile // n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_kk = tl.arange(0, TILE_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # zeros in the MMA accumulator layout: OR-ing them into the words puts the words in that layout (read from
    # shared memory by the pipeliner), whose thread map is operand A's, so the decoded codes become the operand
    # without another conversion (Triton's accumulator-to-operand shortcut, as in attention's P @ V)
    acc_layout = tl.dot(tl.zeros((BLOCK_N, R), dtype=tl.float16), tl.zeros((R, 16), dtype=tl.float16)).to(tl.int32)
    s, zb = _row_scales(sz_ptr, (t_begin * TILE_K) // GS, y_cols, N, ZERO, HAS_ZB, DT, BLOCK_N)
    if MODE == 1 and H2:                 # the table's bytes, in registers for the whole loop
        lut = load_lut_words(lut_ptr)
    else:
        lut = (0,)
    # under programmatic dependent launch (sm90) the scales above are read before this wait; x (and y) belong to
    # the kernels before this one
    pdl_wait(PDL)
    # --- main loop: one tile of TILE_K columns per step; a tile-wide scale row is loaded one step ahead
    for t in range(t_begin, t_end):
        kt = t * TILE_K
        if TILE_SCALE:
            s_next, zb_next = _row_scales(sz_ptr, (tl.minimum(t + 1, t_end - 1) * TILE_K) // GS, y_cols, N, ZERO,
                                          HAS_ZB, DT, BLOCK_N)
        p = tl.load(w_ptr + (t * R + word_rows) * N + w_cols, mask=w_cols < N, other=0)
        p = tl.reshape(p, (2, 2, WARPS, 8, 4, C // 2, 2))
        p = tl.reshape(tl.permute(p, (5, 2, 6, 3, 0, 4, 1)), (BLOCK_N, R))   # [(j, w, h, g) rows, R word rows]
        p = p | acc_layout
        w = _decoded_tile(p, sz_ptr, lut_ptr, lut, kt, GS, y_cols, N, s, zb, BITS, ZERO, HAS_ZB, MODE,
                          TILE_SCALE, H2, R, DT, BLOCK_N)
        k = kt + offs_kk
        kx = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=mask_m[:, None] & (k < K)[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if TILE_SCALE:
            s = s_next
            zb = zb_next
    # the next kernel may launch once this one's programs are past their loops: launched at the start, the next
    # call's programs would launch the one after, and so on, and hold the SMs waiting
    pdl_launch_dependents(PDL)
    # --- epilogue: bias once (with K tile 0), then store or accumulate the transposed partial sum
    if HAS_BIAS:
        if t_begin == 0:
            acc += _by_row(tl.load(bias_ptr + y_cols, mask=y_cols < N, other=0.0), BLOCK_N).to(tl.float32)[:, None]
    # in y's column order, so stores and atomics are vectors
    out = _by_column(acc.to(y_ptr.dtype.element_ty), WARPS)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_n < N)[None, :] & mask_m[:, None] & (t_begin < t_end)
    if ATOMIC:
        tl.atomic_add(y_ptrs, out, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptrs, out, mask=mask)


# The launch's tile / step counts take many values in a serving engine (prefill chunks of any length): a variant
# compiled per value Triton would specialize on (1, multiples of 16), or per split count, would compile inside a
# serving run; the split count reaches the kernel only as ATOMIC (split or streamed partial sums are added). M stays
# specialized: its divisibility lets the loads of x vectorize, which is worth the variants (one per multiple of 16)
@triton.jit(do_not_specialize=["tiles_per_split", "tile0", "stream_iters"])
def _affine_mma_kernel(
    # pointers
    x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr,
    # sizes, and this launch's share of the output tiles
    M, N, K, tiles_per_split, num_tiles, n_blocks, tile0, stream_iters,
    # strides (x and y are row-major)
    stride_xm, stride_ym,
    # meta (the group size too: a run-time group size cost the loop an integer division per K tile)
    GS: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr, ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_ZB: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, MODE: tl.constexpr,
    H2: tl.constexpr, BLOCK_N: tl.constexpr, WARPS: tl.constexpr, STREAM_K: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """y[M, N] (+)= (W[BLOCK_N rows, K range] @ x[BLOCK_M rows]ᵀ)ᵀ over output tiles (tile = M block * n_blocks +
    column block; BLOCK_N weight rows in WARPS warps, 16, 32 or 64 a warp).

    Why transposed: the split-K `tl.dot` kernel (splitk.py) is bound by its decoded weight tile travelling through
    shared memory to the tensor cores (wgmma and mma.sync read operand B from shared memory). Here the product is
    computed transposed, yᵀ[N, M] = W[N, K] · xᵀ[K, M]: the weight is operand A, which both read from registers,
    and the activations are operand B, which the pipeliner loads into shared memory; the M rows of x are the MMA's
    N (16..256), so M = 3 wastes little.

    Split-K: program (tile0 + i, split j) takes K tiles [j * tiles_per_split, ...) of one output tile. Stream-K:
    program i takes the `stream_iters` (output tile, K tile) steps from (tile0 * num_tiles + i * stream_iters) in
    tile-major order, up to the last tile's: at most two partial tiles when stream_iters <= num_tiles, added to y.
    Stream-K balances large M where the output tiles are too few for whole waves of SMs (8B qkv at M = 256: 48
    tiles on 132 SMs): whole waves first, then equal runs of (tile, K tile) steps, each added to the zeroed output."""
    TILE_SCALE: tl.constexpr = GS % ((32 // BITS) * R) == 0         # one scale row per K tile: loaded once a tile
    if STREAM_K:
        it = tile0 * num_tiles + tl.program_id(0) * stream_iters
        it_end = tl.minimum(it + stream_iters, n_blocks * tl.cdiv(M, BLOCK_M) * num_tiles)
        for _ in range(2):
            tile = it // num_tiles
            t_begin = it - tile * num_tiles
            t_end = tl.minimum(num_tiles, t_begin + it_end - it)
            _partial(x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr, M, N, K, GS, tile, n_blocks,
                     t_begin, t_end, num_tiles, stride_xm, stride_ym, BITS, R, ZERO, BLOCK_M, HAS_ZB, HAS_PERM,
                     HAS_BIAS, True, MODE, TILE_SCALE, H2, BLOCK_N, PDL, WARPS)
            it += tl.maximum(t_end - t_begin, 0)
    else:
        t_begin = tl.program_id(1) * tiles_per_split
        _partial(x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr, M, N, K, GS, tile0 + tl.program_id(0),
                 n_blocks, t_begin, tl.minimum(t_begin + tiles_per_split, num_tiles), num_tiles, stride_xm, stride_ym,
                 BITS, R, ZERO, BLOCK_M, HAS_ZB, HAS_PERM, HAS_BIAS, ATOMIC, MODE, TILE_SCALE, H2, BLOCK_N,
                 PDL, WARPS)


# --- the launcher: check -> allocate -> launch ------------------------------------------------------

class MmaConfig(NamedTuple):
    """An MMA launch: BLOCK_M rows of x a program, the K loop split for about `waves` programs an SM (None: whole
    waves of one an SM, whole_wave_split_k, and stream-K where it expects that faster), `warps` x `rows_a_warp`
    weight rows a program.

    A program holds 16, 32 or 64 weight rows per warp (1, 2 or 4 m64 repetitions a warpgroup): 256 rows in 4 warps
    up to M = 64 (64 rows where 256-row blocks are too few for the SMs: default_config), 128 rows in 8 warps with
    128 or 256 rows of x for large M, where the decode is spread over 256 columns of output and the kernel is bound
    by the MMA."""
    block_m: int
    stages: int
    waves: float | None
    min_tiles: int              # least K tiles a split
    warps: int
    rows_a_warp: int            # 16, 32 or 64: 1, 2 or 4 m64 repetitions a warpgroup


# M bucket -> config, from sweeps on the H100 over the Llama-3 8B / 70B shapes: up to M = 64, 64 rows a warp in
# 4 warps with 2 waves (within a few percent of the best of the configs tried on most shape x M points; slower than
# 16 rows a warp only where the 256-row blocks are too few, which default_config gives 16 rows a warp); from M = 65,
# 128-row programs with 3 stages of 128 or 256 rows of x (2 stages starve the MMA), K split or stream-K as
# triton_support.wave_steps / stream_k expect faster
MMA_CONFIGS = ((16, MmaConfig(16, 3, 2.0, 2, 4, 64)), (32, MmaConfig(32, 3, 2.0, 2, 4, 64)),
               (64, MmaConfig(64, 3, 2.0, 4, 4, 64)), (128, MmaConfig(128, 3, None, 4, 8, 16)),
               (1 << 62, MmaConfig(256, 3, None, 4, 8, 16)))


def default_config(st: AffineState, caps: DeviceCaps, m: int) -> MmaConfig:
    """The config of M rows: MMA_CONFIGS' bucket, except where its blocks of 256 weight rows give fewer programs
    than 1.5 x the SMs or a program fewer than 3 K tiles (of the Llama shapes, 8B o up to M = 64 and 8B qkv at
    M = 33..64): there blocks of 64 rows (16 a warp) run in 4 waves. Table codes at M = 33..64 take 32 rows a warp:
    at 64 the lookup's registers spill."""
    config = next(c for top, c in MMA_CONFIGS if m <= top)
    if config.waves is None:
        return config
    if st.mode == LUT and m > 32:
        return config._replace(rows_a_warp=32)
    tiles = cdiv(st.n, config.rows_a_warp * config.warps) * cdiv(m, config.block_m)
    splits, per = split_k(tiles, st.num_tiles, caps.sm_count, config.waves, config.min_tiles)
    if tiles * splits < 1.5 * caps.sm_count or per < 3:
        return MmaConfig(config.block_m, config.stages, 4.0, config.min_tiles, 4, 16)
    return config


def weight_fits(st: AffineState) -> bool:
    """Whether the kernel computes this weight: affine codes, or 4-bit table codes (looked up by byte permutes).
    (fp8 weight-only codes are left to the split-K kernel.)"""
    return st.mode == AFFINE or st.table_lookup


def h2_applies(st: AffineState) -> bool:
    """Whether codes decode two at a time in PTX: fp16 affine codes, bf16 4-bit affine codes (8-bit codes do not
    fit bf16's 7-bit mantissa beside a magic number), or 4-bit table codes (fp16 or bf16; the per-element path
    gathers the table from memory once per code)."""
    return (st.mode == AFFINE and (st.dtype == torch.float16 or st.bits == 4)) or st.table_lookup


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, h2: bool | None = None, stream: bool | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) with the weight as the MMA's register operand; `config` (MmaConfig's
    fields), `h2` (decode in PTX, default where h2_applies) and `stream` (stream-K for the tiles past the whole
    waves, by default where configs of whole waves expect it faster than splitting K: triton_support.stream_k;
    forced on a config of `waves`, over that many programs an SM) are forced by tests and benchmarks; `caps`
    defaults to the device's."""
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    assert not h2 or h2_applies(st)
    caps = caps or device_caps(x2.device)
    sms = caps.sm_count
    bm, stages, waves, min_tiles, warps, rows = config or default_config(st, caps, m)
    assert rows in (16, 32, 64), rows               # 1, 2 or 4 m64 repetitions: C = rows / 8 adjacent columns
    n_blocks = cdiv(st.n, rows * warps)
    tiles = n_blocks * cdiv(m, bm)
    splits, per = (whole_wave_split_k(tiles, st.num_tiles, sms, min_tiles) if waves is None
                   else split_k(tiles, st.num_tiles, sms, waves, min_tiles))
    whole, iters, programs, steps = stream_k(tiles, st.num_tiles, sms if waves is None else round(waves * sms))
    if stream is None:
        stream = waves is None and steps < wave_steps(tiles, st.num_tiles, sms, splits)
    atomic = programs > 0 if stream else splits > 1
    y = split_k_output(m, st, atomic, x2.device)
    h2 = h2_applies(st) if h2 is None else h2
    table = st.lut_arg(h2 and st.mode == LUT)
    pdl = pdl_launch(caps)

    def launch(grid, tiles_per_split, tile0, stream_iters, add, streamed):
        _affine_mma_kernel[grid](
            x2, st.packed, st.sz, st.perm if st.perm is not None else st.packed,
            table, bias if bias is not None else x2, y,
            m, st.n, st.k, tiles_per_split, st.num_tiles, n_blocks, tile0, stream_iters,
            x2.stride(0), y.stride(0),
            GS=st.group_size, BITS=st.bits, R=R, ZERO=st.zero, BLOCK_M=bm, HAS_ZB=st.has_zb,
            HAS_PERM=st.perm is not None, HAS_BIAS=bias is not None, ATOMIC=add, MODE=st.mode,
            H2=h2, BLOCK_N=rows * warps, WARPS=warps, STREAM_K=streamed,
            num_warps=warps, num_stages=stages, **pdl)

    if not stream:
        launch((tiles, splits), per, 0, 0, splits > 1, False)
    else:
        if whole:                                   # whole waves of output tiles, each one program, stored
            launch((whole, 1), st.num_tiles, 0, 0, False, False)
        if programs:                                # the rest, equal runs of (tile, K tile) steps, added
            launch((programs,), st.num_tiles, whole, iters, True, True)
    return y.to(st.dtype)
