"""The MMA path of the ggml kernels for Q4_K, Q5_K and Q6_K: the affine MMA kernel's register operand (affine/mma.py),
decoded straight from ggml's own code planes, for the small and middle M between the GEMV and dequantize + cuBLAS
where the Gluon kernel (wgmma.py, which decodes by this module's PTX) cannot run.

The product is computed transposed, yᵀ = W · xᵀ, so that the decoded weight is the MMA's A operand, read from
registers (wgmma on sm90); x, operand B, goes through shared memory. A K step is half a super-block, 128 values of
each of BLOCK_N rows. Its words are loaded in the MMA accumulator's layout, whose thread map is operand A's, so each
thread holds the code words 2q, 2q + 1, 2q + 8, 2q + 9 of its rows and decodes them in place (_q4k_slice,
_q6k_slice); the MMA's K order is therefore not the file's, and x is permuted into it instead (_in_mma_order).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import H2_PAIR_F16
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.layout import GgmlState, split_output, word_planes
from quanta.kernels.triton_support import cdiv, split_k, tl, triton

TYPES = ("q4_K", "q5_K", "q6_K")
CAPABILITY = (9, 0)         # the register operand is Hopper's wgmma (as the affine MMA kernel's)
STEP = 128                  # values of a row a K step: half a super-block (16 Q4_K code words, 16 + 8 Q6_K ones)


# PTX of a pair of Q5_K codes (pack 2), H2_PAIR_F16's with the fifth bits: $3 $4 the qh words of the pair's
# values, $7 the bit (2 chunk + HIGH) that holds theirs, moved to 16 (16 * 16 for a high nibble) and ORed in.
def _q5k_pair_ptx(high: bool) -> tl.constexpr:
    mask, shift = ("0x00F000F0", 8) if high else ("0x000F000F", 4)
    return tl.constexpr(f"{{ .reg .b32 t, h; prmt.b32 t, $1, $2, $5; prmt.b32 h, $3, $4, $5; shr.u32 h, h, $7; "
                        f"and.b32 h, h, 0x00010001; shl.b32 h, h, {shift}; lop3.b32 t, t, {mask}, 0x64006400, 0xEA; "
                        "lop3.b32 t, t, h, 0, 0xFC; fma.rn.f16x2 t, t, $9, $10; fma.rn.f16x2 $0, t, $11, $12; }")


Q5K_LOW, Q5K_HIGH = _q5k_pair_ptx(False), _q5k_pair_ptx(True)


@triton.jit
def _q4k_slice(p, qh, bit, t: tl.constexpr, HIGH: tl.constexpr, s, zb, Q5: tl.constexpr, H2: tl.constexpr,
               BN: tl.constexpr):
    """Weights [BN, 16] of MMA slice 4 HIGH + t (its 16 K columns) from the step's words p [BN, 8, 2] (word pairs
    2q', 2q' + 1) and the pairs' (scale, zbias) s, zb [BN, 8, 2]; Q5_K's fifth bits from qh [BN, 8, 2] (the pair's
    qh words 2 qb, 2 qb + 1), bit `bit` [BN, 8, 2] (2 chunk + HIGH) of the same bytes.

    Column 2q' + e of the slice is nibble HIGH of byte 2 (t % 2) + e of word 2q' + t // 2: Q4_K's word i of a chunk
    holds values 4i..4i+3 of one sub-block in its low nibbles and of the next in its high ones, so the slice's pair
    is two adjacent values of x. With H2 one `prmt` gathers the two bytes of either word, and affine/layout.py's
    H2_PAIR_F16 makes the halves 1024 + q (1024 + 16q for a high nibble), takes off the magic exactly and applies
    scale and zbias in packed fp16; else (the interpreter) the same values by integer ops and float32."""
    BYTE: tl.constexpr = 4 * (t // 2) + 2 * (t % 2)                  # of the pair's 8 bytes: word a's 0-3, b's 4-7
    if H2:
        SEL: tl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 1) << 8) | ((BYTE + 1) << 12)
        MASK: tl.constexpr = 0x00F000F0 if HIGH else 0x000F000F
        FACTOR: tl.constexpr = 0.0625 if HIGH else 1.0
        ADDEND: tl.constexpr = -64.0 if HIGH else -1024.0
        shape: tl.constexpr = (BN, 8, 2)
        factor = tl.full(shape, FACTOR, tl.float32).to(tl.float16)
        addend = tl.full(shape, ADDEND, tl.float32).to(tl.float16)
        if Q5:
            args = [p, qh, tl.full(shape, SEL, tl.int32), bit, factor, addend, s, zb]
            w = tl.inline_asm_elementwise(Q5K_HIGH if HIGH else Q5K_LOW, "=r" + ",r" * 12, args, dtype=tl.float16,
                                          is_pure=True, pack=2)
        else:
            args = [p, tl.full(shape, SEL, tl.int32), tl.full(shape, MASK, tl.int32), factor, addend, s, zb]
            w = tl.inline_asm_elementwise(H2_PAIR_F16, "=r,r,r,r,r,r,r,r,r,r,r", args, dtype=tl.float16,
                                          is_pure=True, pack=2)
    else:
        word, hw, at = _slice_words(p, qh, t)
        q = (word[:, :, None] >> (at + 4 * HIGH)) & 15
        if Q5:
            q += ((hw[:, :, None] >> (at + bit)) & 1) << 4
        w = (q.to(tl.float32) * s.to(tl.float32) + zb.to(tl.float32)).to(tl.float16)
    return tl.reshape(w, (BN, 16))


@triton.jit
def _slice_words(p, qh, t: tl.constexpr):
    """For the interpreter's decode of slice t: the word [BN, 8] of each pair of p and of qh ([BN, 8, 2]) that holds
    the slice's two bytes (word t // 2), and those bytes' bit offsets [1, 1, 2]."""
    a, b = tl.split(p)
    ha, hb = tl.split(qh)
    if t >= 2:
        word = b
        hw = hb
    else:
        word = a
        hw = ha
    return word, hw, (8 * (2 * (t % 2) + tl.arange(0, 2)))[None, None, :]


# PTX of a sub-block's (scale, zbias) in fp16, as one register's low and high halves, from its scale word's pair of
# bytes (scale, min) $1 selected by $3 and the block's halves (d, -dmin) $2: the bytes join 0x64 bytes into the
# halves 1024 + byte (prmt), 1024 comes off exactly, and one packed multiply gives d * scale and -dmin * min, each
# rounded once as float32's product would be. The wgmma kernel (wgmma.py) decodes its scales by it too.
SCALE_PAIR = tl.constexpr("{ .reg .b32 c; mov.b32 c, 0x64006400; prmt.b32 $0, $1, c, $3; sub.rn.f16x2 $0, $0, c; "
                          "mul.rn.f16x2 $0, $0, $2; }")


@triton.jit
def _scale_pair(word, dm, HIGH: tl.constexpr, H2: tl.constexpr):
    """(d * scale, -dmin * min) in fp16 of the sub-block whose byte pair HIGH of `word` holds its scale and min;
    `dm` the block's (d, dmin) halves as one int32."""
    if H2:
        SEL: tl.constexpr = 0x5352 if HIGH else 0x5150      # bytes 2, 3 or 0, 1 of word; c's 0x64
        v = tl.inline_asm_elementwise(SCALE_PAIR, "=r,r,r,r", [word, dm ^ -2147483648, tl.full(word.shape, SEL,
                                      tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
        s = (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        zb = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        d = (dm & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dm >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        pair = (word >> (16 * HIGH)) & 0xFFFF
        s = (d * (pair & 0xFF).to(tl.float32)).to(tl.float16)
        zb = (-dmin * (pair >> 8).to(tl.float32)).to(tl.float16)
    return s, zb


@triton.jit
def _pair_scales(dm, first, second, HIGH: tl.constexpr, H2: tl.constexpr, BN: tl.constexpr):
    """(scale, zbias) [BN, 8, 2] of the word pairs of a step's slices of nibble HIGH: pairs 0-3 lie in the step's
    first chunk, sub-block 2 chunk + HIGH (scale word `first`), pairs 4-7 in the next (`second`)."""
    s0, z0 = _scale_pair(first, dm, HIGH, H2)
    s1, z1 = _scale_pair(second, dm, HIGH, H2)
    later = (tl.arange(0, 8) >= 4)[None, :, None]
    shape: tl.constexpr = (BN, 8, 2)
    return (tl.where(later, s1[:, None, None], s0[:, None, None]).broadcast_to(shape),
            tl.where(later, z1[:, None, None], z0[:, None, None]).broadcast_to(shape))


@triton.jit
def _in_mma_order(x, Q6: tl.constexpr, BM: tl.constexpr):
    """x's step [BM, 128], loaded in K order, in the MMA's column order: column 64 HIGH + 16 t + 2 q' + e
    (q' = 4 qa + qb) is value 64 qa + 32 HIGH + 8 qb + 2 t + e of the half super-block for Q4_K (_q4k_slice's
    map), 64 HIGH + 32 qa + 8 qb + 2 t + e for Q6_K (_q6k_slice's). Loaded whole (16-byte copies) and permuted on
    its way to shared memory: a load gathered in the MMA's order moves 4 bytes a copy, which was slower at every M."""
    if Q6:
        return tl.reshape(tl.permute(tl.reshape(x, (BM, 2, 2, 4, 4, 2)), (0, 1, 4, 2, 3, 5)), (BM, 128))
    return tl.reshape(tl.permute(tl.reshape(x, (BM, 2, 2, 4, 4, 2)), (0, 2, 4, 1, 3, 5)), (BM, 128))


@triton.jit
def _q4k_tile(p, qh, bits, dm, first, second, Q5: tl.constexpr, H2: tl.constexpr, BN: tl.constexpr):
    """The step's Q4_K (Q5_K) weight tile [BN, 128] in the MMA's column order; dm, first, second: the block's
    (d, dmin) word and the step's two scale words; bits: Q5_K's fifth-bit index of the low nibbles."""
    s, zb = _pair_scales(dm, first, second, 0, H2, BN)
    w0 = _q4k_slice(p, qh, bits, 0, 0, s, zb, Q5, H2, BN)
    w1 = _q4k_slice(p, qh, bits, 1, 0, s, zb, Q5, H2, BN)
    w2 = _q4k_slice(p, qh, bits, 2, 0, s, zb, Q5, H2, BN)
    w3 = _q4k_slice(p, qh, bits, 3, 0, s, zb, Q5, H2, BN)
    s, zb = _pair_scales(dm, first, second, 1, H2, BN)
    w4 = _q4k_slice(p, qh, bits + 1, 0, 1, s, zb, Q5, H2, BN)
    w5 = _q4k_slice(p, qh, bits + 1, 1, 1, s, zb, Q5, H2, BN)
    w6 = _q4k_slice(p, qh, bits + 1, 2, 1, s, zb, Q5, H2, BN)
    w7 = _q4k_slice(p, qh, bits + 1, 3, 1, s, zb, Q5, H2, BN)
    return _joined(w0, w1, w2, w3, w4, w5, w6, w7)


@triton.jit
def _joined(w0, w1, w2, w3, w4, w5, w6, w7):
    """Slices i = 0..7 [BN, 16] as one tile [BN, 128] (column 16 i + r), joined along register dims: where the
    slices are in operand A's layout, so is the tile."""
    j = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
    return tl.reshape(tl.permute(j, (0, 4, 3, 2, 1)), (w0.shape[0], 128))     # i = 4 i2 + 2 i1 + i0


# PTX of a pair of Q6_K codes (pack 2): $1 $2 the ql words and $3 $4 the qh words of columns 2q', 2q' + 1; $5 the
# prmt selector of the pair's two bytes (to bytes 0 and 2); $7 the shift of the qh byte's 2-bit field; $9 the scale
# pair. The nibble (shifted down first for the high one: NIBBLE) and the field at bit 4 join 0x6400 as the halves
# 1024 + q; 1056 comes off exactly (q - 32) and one multiply applies the scale.
def _q6k_pair_ptx(high: bool) -> tl.constexpr:
    nibble = "shr.u32 t, t, 4; " if high else ""
    return tl.constexpr(f"{{ .reg .b32 t, h; prmt.b32 t, $1, $2, $5; {nibble}prmt.b32 h, $3, $4, $5; "
                        "shr.u32 h, h, $7; shl.b32 h, h, 4; lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; "
                        "lop3.b32 t, t, h, 0x00300030, 0xF8; mov.b32 h, 0x64206420; sub.rn.f16x2 t, t, h; "
                        "mul.rn.f16x2 $0, t, $9; }")


Q6K_LOW, Q6K_HIGH = _q6k_pair_ptx(False), _q6k_pair_ptx(True)
# PTX of a pair's scale (pack 2) from its scale word ($1, or $2 for the high nibbles' slices: WORD), the shift of
# its int8 byte $3 and d's bits $5: the byte, flipped to offset 128, joins 0x6400 in both halves as
# 1024 + 128 + scale, 1152 comes off exactly, and one multiply by (d, d) gives d * scale rounded once.
_Q6K_SCALE = ("{{ .reg .b32 s, c; shr.u32 s, {word}, $3; and.b32 s, s, 0xFF; shl.b32 c, s, 16; "
              "lop3.b32 s, s, c, 0x00800080, 0x56; lop3.b32 s, s, 0x64006400, 0, 0xFC; mov.b32 c, 0x64806480; "
              "sub.rn.f16x2 s, s, c; prmt.b32 c, $5, $5, 0x1010; mul.rn.f16x2 $0, s, c; }}")
Q6K_SCALE_LOW, Q6K_SCALE_HIGH = tl.constexpr(_Q6K_SCALE.format(word="$1")), tl.constexpr(_Q6K_SCALE.format(word="$2"))


@triton.jit
def _q6k_scales(sc, d, HIGH: tl.constexpr, H2: tl.constexpr, BN: tl.constexpr):
    """Scales [BN, 8, 2] in fp16 of the pairs of a step's slices of nibble HIGH. sc [BN, 8, 2]: each pair's scale
    words (the step's first four int8 scales, then its last four); d [BN, 8, 2] the block's d bits. Pair q'
    (qa = q' // 4, qb = q' % 4) covers values l + 32 qa + 64 HIGH with l = 8 qb .. 8 qb + 7: scale
    (qb // 2) + 2 qa + 4 HIGH of the step's eight."""
    q = tl.arange(0, 8)[None, :, None]
    shift = 8 * ((q % 4) // 2 + 2 * (q // 4))
    if H2:
        args = [sc, tl.broadcast_to(shift, (BN, 8, 2)), d]
        s = tl.inline_asm_elementwise(Q6K_SCALE_HIGH if HIGH else Q6K_SCALE_LOW, "=r,r,r,r,r,r,r", args,
                                      dtype=tl.float16, is_pure=True, pack=2)
    else:
        first, last = tl.split(sc)
        if HIGH:
            word = last
        else:
            word = first
        scale = ((word[:, :, None] >> shift) & 0xFF).to(tl.int8).to(tl.float32)
        dv = (d & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        s = (scale * dv).to(tl.float16)
    return s


@triton.jit
def _q6k_slice(ql, qh, t: tl.constexpr, HIGH: tl.constexpr, s, H2: tl.constexpr, BN: tl.constexpr):
    """Weights [BN, 16] of MMA slice 4 HIGH + t from the step's ql and qh words [BN, 8, 2] (pair q' holds ql words
    2q', 2q' + 1 and qh words 2 qb, 2 qb + 1) and the pairs' scales s. Column 2q' + e is nibble HIGH of byte
    b = 2 (t % 2) + e of ql word 2q' + t // 2, joined by bits 2 (qa + 2 HIGH) of the same byte of qh: value
    l + 32 qa + 64 HIGH, l = 8 qb + 2 t + e, of ggml's dequantize_row_q6_K."""
    BYTE: tl.constexpr = 4 * (t // 2) + 2 * (t % 2)
    shape: tl.constexpr = (BN, 8, 2)
    field = tl.broadcast_to(2 * (tl.arange(0, 8)[None, :, None] // 4) + 4 * HIGH, shape)
    if H2:
        SEL: tl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 1) << 8) | ((BYTE + 1) << 12)
        args = [ql, qh, tl.full(shape, SEL, tl.int32), field, s]
        w = tl.inline_asm_elementwise(Q6K_HIGH if HIGH else Q6K_LOW, "=r,r,r,r,r,r,r,r,r,r", args,
                                      dtype=tl.float16, is_pure=True, pack=2)
    else:
        lw, hw, at = _slice_words(ql, qh, t)
        nib = (lw[:, :, None] >> (at + 4 * HIGH)) & 15
        top = (hw[:, :, None] >> (at + field)) & 3
        w = (((nib | (top << 4)) - 32).to(tl.float32) * s.to(tl.float32)).to(tl.float16)
    return tl.reshape(w, (BN, 16))


@triton.jit
def _q6k_tile(ql, qh, sc, d, H2: tl.constexpr, BN: tl.constexpr):
    """The step's Q6_K weight tile [BN, 128] in the MMA's column order."""
    s = _q6k_scales(sc, d, 0, H2, BN)
    w0 = _q6k_slice(ql, qh, 0, 0, s, H2, BN)
    w1 = _q6k_slice(ql, qh, 1, 0, s, H2, BN)
    w2 = _q6k_slice(ql, qh, 2, 0, s, H2, BN)
    w3 = _q6k_slice(ql, qh, 3, 0, s, H2, BN)
    s = _q6k_scales(sc, d, 1, H2, BN)
    w4 = _q6k_slice(ql, qh, 0, 1, s, H2, BN)
    w5 = _q6k_slice(ql, qh, 1, 1, s, H2, BN)
    w6 = _q6k_slice(ql, qh, 2, 1, s, H2, BN)
    w7 = _q6k_slice(ql, qh, 3, 1, s, H2, BN)
    return _joined(w0, w1, w2, w3, w4, w5, w6, w7)


@triton.jit
def _acc_words(ptr, rows, at, mask_n, acc_layout, BN: tl.constexpr):
    """int32 words [BN, 8, 2] at ptr + rows * ... + at [16] per column, in operand A's thread map (acc_layout)."""
    return tl.reshape(tl.load(ptr + rows[:, None] + at[None, :], mask=mask_n[:, None], other=0) | acc_layout,
                      (BN, 8, 2))


@triton.jit(do_not_specialize=["steps_per_split"])
def _ggml_mma_kernel(x_ptr, p0, p1, p2, p3, bias_ptr, y_ptr, M, N, steps_per_split, num_steps,
                     stride_xm, stride_ym, Q6: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, H2: tl.constexpr, Q5: tl.constexpr = False):
    """y[M, N] (+)= (W[BLOCK_N rows] @ x[BLOCK_M rows]ᵀ)ᵀ over the program's K steps; program (output tile, M
    fastest, split of K steps). The column-major planes (layout.py): Q4_K's p0..p2: (d, dmin) as one int32 a block,
    the scale pairs as int32 words, the code words; Q5_K's p0..p3: the same (d, dmin) and scale words, the qh words,
    the code words. Q6_K's p0..p3: ql and qh words, the int8 scales four a word, and the fp16 d's as int32 words."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = rows < N
    s_begin = tl.program_id(1) * steps_per_split
    s_end = tl.minimum(s_begin + steps_per_split, num_steps)
    offs_k = tl.arange(0, 128)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # zeros in the MMA accumulator's layout: OR-ed into the words they put them in operand A's thread map
    acc_layout = tl.dot(tl.zeros((BLOCK_N, 16), dtype=tl.float16), tl.zeros((16, 16), dtype=tl.float16)).to(tl.int32)
    # Q6_K: whether each row's d of block 0 sits in the high half of its int32 word, in operand A's thread map
    row_odd = tl.reshape((rows % 2)[:, None] + acc_layout, (BLOCK_N, 8, 2))
    # Q5_K: the bit of a qh byte that holds a low nibble's fifth bit in the step's first half (2 chunk: pairs 4-7
    # lie in the next chunk)
    fifth = tl.broadcast_to(2 * (tl.arange(0, 8)[None, :, None] // 4), (BLOCK_N, 8, 2))
    for step in range(s_begin, s_end):
        cols = tl.arange(0, 16)
        # the column-major planes (layout.py): word row r of every weight row at r * N
        if Q6:      # per column: its ql word, its pair's qh word, the step's scale word (4 scales) of its slice
            blk = step // 2
            ql = _acc_words(p0, rows, (step * 16 + cols) * N, mask_n, acc_layout, BLOCK_N)
            qh = _acc_words(p1, rows, (blk * 16 + (step % 2) * 8 + cols % 8) * N, mask_n, acc_layout, BLOCK_N)
            sc = _acc_words(p2, rows, (blk * 4 + (step % 2) * 2 + cols % 2) * N, mask_n, acc_layout, BLOCK_N)
            # d: the int32 word of the fp16 d plane [blocks, N] that holds d[blk, row], shifted down
            d = _acc_words(p3, (blk * N + rows) // 2, cols * 0, mask_n, acc_layout, BLOCK_N) >> (
                16 * ((row_odd + blk * N) % 2))
            w = _q6k_tile(ql, qh, sc, d, H2, BLOCK_N)
        else:
            dm = tl.load(p0 + (step // 2) * N + rows, mask=mask_n, other=0)
            at = p1 + ((step // 2) * 4 + 2 * (step % 2)) * N + rows     # the step's two scale words
            first, second = tl.load(at, mask=mask_n, other=0), tl.load(at + N, mask=mask_n, other=0)
            if Q5:      # the block's eight qh words, word i of a pair's (2 qb + e) for its columns
                p = _acc_words(p3, rows, (step * 16 + cols) * N, mask_n, acc_layout, BLOCK_N)
                qh = _acc_words(p2, rows, ((step // 2) * 8 + cols % 8) * N, mask_n, acc_layout, BLOCK_N)
            else:
                p = _acc_words(p2, rows, (step * 16 + cols) * N, mask_n, acc_layout, BLOCK_N)
                qh = p
            w = _q4k_tile(p, qh, fifth + 4 * (step % 2), dm, first, second, Q5, H2, BLOCK_N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (step * 128 + offs_k)[None, :], mask=mask_m[:, None],
                    other=0.0)
        acc = tl.dot(w, tl.trans(_in_mma_order(x, Q6, BLOCK_M)), acc)
    if HAS_BIAS:
        if s_begin == 0:
            acc += tl.load(bias_ptr + rows, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out = tl.trans(acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + rows[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, out, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


class MmaConfig(NamedTuple):
    """A launch: BLOCK_M rows of x and `rows_a_warp` x `warps` weight rows a program, `stages` of the pipelined
    loads, the K loop split for about `waves` programs an SM, each split at least `min_steps` K steps."""
    block_m: int
    rows_a_warp: int
    warps: int
    stages: int
    waves: float
    min_steps: int


# M bucket -> config, from sweeps on the H200 over the Llama-3-8B shapes: 32 weight rows a warp in 4 warps up to
# M = 32 (64 rows a warp, the affine kernel's choice, spills here beside the scales and x's permutation), 128-row
# programs in 8 warps above; the K loop split for two waves of programs up to M = 64, one above
MMA_CONFIGS = ((16, MmaConfig(16, 32, 4, 3, 2.0, 4)), (32, MmaConfig(32, 32, 4, 3, 2.0, 4)),
               (64, MmaConfig(64, 16, 8, 3, 2.0, 4)), (1 << 62, MmaConfig(128, 16, 8, 3, 1.0, 8)))


def refusal(st: GgmlState, caps: DeviceCaps, decoder: str) -> str | None:
    """Why a tensor-core kernel decoding by this module's PTX (`decoder`: its name) cannot run this weight on a
    device of these caps, or None: this kernel's and the wgmma kernel's rule."""
    if st.name not in TYPES:
        return f"{st.name}: no {decoder} decoder (it takes {', '.join(TYPES)})"
    if st.name == "q6_K" and st.n * st.blocks % 2:
        return f"q6_K {[st.n, st.k]}: an odd number of blocks (its d plane is read as int32 words)"
    if st.dtype != torch.float16:
        return f"{str(st.dtype).removeprefix('torch.')} activations (the decode is packed fp16)"
    if caps.capability != CAPABILITY:
        return f"{caps.name}: the register operand is sm90's wgmma"
    return None


def applies(st: GgmlState, caps: DeviceCaps) -> str | None:
    """None if the kernel runs this weight on a device of these caps, else why not."""
    return refusal(st, caps, "MMA")


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> MmaConfig:
    """M's bucket of MMA_CONFIGS."""
    return next(c for top, c in MMA_CONFIGS if m <= top)


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, h2: bool | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias); `config` (MmaConfig's fields) and `h2` (decode in PTX; default on CUDA)
    forced by tests and benchmarks."""
    m = x2.shape[0]
    assert st.name in TYPES and x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1
    caps = caps or device_caps(x2.device)
    bm, rows, warps, stages, waves, min_steps = config or default_config(st, caps, m)
    bn = rows * warps
    steps = st.k // STEP
    tiles = cdiv(m, bm) * cdiv(st.n, bn)
    splits, per = split_k(tiles, steps, caps.sm_count, waves, min_steps)
    y = split_output(x2, st, splits)
    planes = word_planes(st)
    _ggml_mma_kernel[(tiles, splits)](
        x2, *planes, bias if bias is not None else x2, y, m, st.n, per, steps, x2.stride(0), y.stride(0),
        Q6=st.name == "q6_K", Q5=st.name == "q5_K", BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None,
        ATOMIC=splits > 1, H2=x2.is_cuda if h2 is None else h2, num_warps=warps, num_stages=stages)
    return y.to(x2.dtype)

