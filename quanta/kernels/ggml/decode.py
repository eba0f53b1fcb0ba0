"""Bit-level decoding of ggml blocks in Triton, one small function per type family, mirroring blocks.py.

`decode` turns part of a tile (256 values of each of BLOCK_N rows, see layout.py) into (f, scale, minus): f
[BLOCK_N, AP, B, C, D] float32 and scale / minus [BLOCK_N, AP, B] (or broadcastable to it), each value being
(f - center) * scale (- minus for the types with mins). The axes are chosen per type so that code words load whole
and contiguous (D is the byte within a word), a sub-block is whole values of B (a dot product sums over C and D
before its scale), and their row-major flattening is the values' order along K. An integer code becomes f without an
int-to-float conversion (`_one_plus`); its offset (Q6_K's -32, ...) and 2**bits go exactly into `center` and the
scale, so that each value rounds as ggml's does. IQ4 codes index the 16-value table (f the value, center 0).
"""
from __future__ import annotations

from quanta.kernels.ggml.layout import LAYOUTS
from quanta.kernels.triton_support import tl, triton

Q4_0 = tl.constexpr(LAYOUTS["q4_0"].id)
Q4_1 = tl.constexpr(LAYOUTS["q4_1"].id)
Q5_0 = tl.constexpr(LAYOUTS["q5_0"].id)
Q5_1 = tl.constexpr(LAYOUTS["q5_1"].id)
Q8_0 = tl.constexpr(LAYOUTS["q8_0"].id)
Q2_K = tl.constexpr(LAYOUTS["q2_K"].id)
Q3_K = tl.constexpr(LAYOUTS["q3_K"].id)
Q4_K = tl.constexpr(LAYOUTS["q4_K"].id)
Q5_K = tl.constexpr(LAYOUTS["q5_K"].id)
Q6_K = tl.constexpr(LAYOUTS["q6_K"].id)
IQ4_NL = tl.constexpr(LAYOUTS["iq4_nl"].id)
IQ4_XS = tl.constexpr(LAYOUTS["iq4_xs"].id)


# --- placing vectors on the axes of a tile (5-d: rows, A, B, C, D) and of its scales (3-d: rows, A, B) --------
@triton.jit
def _r5(v):
    return v[:, None, None, None, None]


@triton.jit
def _a5(v):
    return v[None, :, None, None, None]


@triton.jit
def _b5(v):
    return v[None, None, :, None, None]


@triton.jit
def _c5(v):
    return v[None, None, None, :, None]


@triton.jit
def _d5(v):
    return v[None, None, None, None, :]


@triton.jit
def _r3(v):
    return v[:, None, None]


@triton.jit
def _a3(v):
    return v[None, :, None]


@triton.jit
def _b3(v):
    return v[None, None, :]


# --- loads and bit fields --------------------------------------------------------------------------------------
@triton.jit
def _words(ptr, off, mask):
    """Code words at `off` as uint32 (0 where masked): shifts are logical and rotations funnel shifts."""
    return tl.load(ptr + off, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _f16(ptr, off, mask):
    """An fp16 field of the blocks at `off` as float32 (0 where masked)."""
    return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _u8(ptr, off, mask):
    """A byte field of the blocks at `off` as int32 (0 where masked)."""
    return tl.load(ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(bits):
    """The fp16 in the low 16 bits of integer `bits`, as float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _to(u, at, to):
    """Word u rotated so that its bit `at` lands on bit `to` (one funnel shift on the GPU)."""
    r = ((at - to) & 31).to(tl.uint32)
    return (u >> r) | (u << ((32 - r) & 31))


@triton.jit
def _one_plus(bits):
    """The float 1 + m / 2**23 for mantissa bits `bits` (uint32, bits 0..22 only).

    A code q of b bits rotated (`_to`) to bits 23-b..22 gives 1 + q / 2**b exactly: one funnel shift and a logic op
    a code, where an int-to-float conversion runs at a fraction of the FMA rate. (f - center) * 2**b * scale is then
    the code's value times ggml's scale, both exact before the one rounding of the product."""
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


# --- K-quants: one 256-value super-block a tile -------------------------------------------------------------
@triton.jit
def _q2_k(sc_ptr, qs_ptr, dm_ptr, n, mask_n, j, a0, N, AP: tl.constexpr):
    """scales[16] (low nibble scale, high nibble min), qs 2-bit [64], d, dmin: d*sc*q - dmin*m per 16 values.
    Axes (a 4, b 4, w 4, e 4): value 16s + 4w + e of sub-block s = 4a + b (s = 8g + 2t + v: g = a // 2,
    t = 2(a % 2) + b // 2, v = b % 2) is bits 2t of qs byte 32g + 16v + 4w + e. Column-major planes (layout.py) of
    int32 words: the scales four a word, qs, d | dmin << 16."""
    a = a0 + tl.arange(0, AP)
    b, w, e = tl.arange(0, 4), tl.arange(0, 4), tl.arange(0, 4)
    words = _words(qs_ptr, (j * 16 + _a5((a // 2) * 8) + _b5((b % 2) * 4) + _c5(w)) * N + _r5(n), _r5(mask_n))
    f = _one_plus(_to(words, _d5(e * 8) + _a5((a % 2) * 4) + _b5((b // 2) * 2), 21) & 0x600000)    # 1 + q / 4
    m3 = _r3(mask_n)
    sc = tl.load(sc_ptr + (j * 4 + _a3(a)) * N + _r3(n), mask=m3, other=0) >> (_b3(b) * 8)
    dm = tl.load(dm_ptr + j * N + _r3(n), mask=m3, other=0)
    return f, _half(dm) * (sc & 0xF).to(tl.float32) * 4.0, _half(dm >> 16) * ((sc >> 4) & 0xF).to(tl.float32)


@triton.jit
def _q3_k(hm_ptr, qs_ptr, sc_ptr, d_ptr, n, mask_n, j, a0, N, AP: tl.constexpr):
    """hmask[32], qs 2-bit [64], scales 6-bit [12] (-32), d: d*sc*(q2 - 4 * !hbit) per 16 values. Axes and q2 as
    Q2_K's; the third bit of value i is bit i // 32 (4g + t) of hmask byte i % 32 (16v + 4w + e), set meaning no -4:
    q2 + 4 * hbit - 4. Column-major planes (layout.py): hmask, qs and the scales (four bytes a word) as int32
    words, d as fp16."""
    a = a0 + tl.arange(0, AP)
    b, w, e = tl.arange(0, 4), tl.arange(0, 4), tl.arange(0, 4)
    m5 = _r5(mask_n)
    word = _b5((b % 2) * 4) + _c5(w)
    t = _a5((a % 2) * 2) + _b5(b // 2)
    low = _to(_words(qs_ptr, (j * 16 + _a5((a // 2) * 8) + word) * N + _r5(n), m5), _d5(e * 8) + t * 2, 20)
    high = _to(_words(hm_ptr, (j * 8 + word) * N + _r5(n), m5), _d5(e * 8) + _a5((a // 2) * 4) + t, 22)
    f = _one_plus((low & 0x300000) | (high & 0x400000))                          # 1 + (q2 + 4 * hbit) / 8
    s = _a3(a * 4) + _b3(b)
    m3 = _r3(mask_n)
    cols = _r3(n)
    lo = tl.load(sc_ptr + (j * 3 + (s % 8) // 4) * N + cols, mask=m3, other=0)
    hi = tl.load(sc_ptr + (j * 3 + 2) * N + cols, mask=m3, other=0)
    scale = _f16(d_ptr, j * N + cols, m3) * (q3k_scale(lo, hi, s) - 32).to(tl.float32) * 8.0
    return f, scale, scale


@triton.jit
def q3k_scale(lo, hi, s):
    """The 6-bit scale (0..63, before its -32) of Q3_K sub-block s from its block's scale words (three a block in
    the column-major plane): `lo` word (s % 8) // 4 gives the low 4 bits (byte s % 8, nibble s // 8), `hi` word 2
    the high 2 bits (byte 8 + s % 4, bits 2 * (s // 4))."""
    lo4 = (lo >> ((s % 4) * 8 + (s // 8) * 4)) & 0xF
    hi2 = (hi >> ((s % 4) * 8 + (s // 4) * 2)) & 3
    return lo4 | (hi2 << 4)


@triton.jit
def _q45_k(dm_ptr, sc_ptr, qh_ptr, qs_ptr, n, mask_n, j, a0, N, AP: tl.constexpr, Q5: tl.constexpr):
    """d, dmin, scales[12] (8 six-bit scales and mins, get_scale_min_k4; held as 16 bytes, scale and min of
    sub-block s at 2s and 2s + 1, layout.k4_scale_pairs), [qh[32] for Q5_K], qs 4-bit [128]:
    d*sc*q - dmin*m per 32 values. Axes (c 4, h 2, w 8, e 4): value 64c + 32h + 4w + e is nibble h of byte 32c + 4w
    + e of qs; Q5_K's fifth bit is bit 2c + h (the sub-block) of qh byte 4w + e. Column-major planes (layout.py)
    of int32 words: d | dmin << 16, the scale pairs four bytes a word, qh, qs."""
    c = a0 + tl.arange(0, AP)
    h, w, e = tl.arange(0, 2), tl.arange(0, 8), tl.arange(0, 4)
    m5 = _r5(mask_n)
    words = _words(qs_ptr, (j * 32 + _a5(c * 8) + _c5(w)) * N + _r5(n), m5)
    if Q5:
        low = _to(words, _d5(e * 8) + _b5(h * 4), 18)
        high = _to(_words(qh_ptr, (j * 8 + _c5(w)) * N + _r5(n), m5), _d5(e * 8) + _a5(c * 2) + _b5(h), 22)
        f = _one_plus((low & 0x3C0000) | (high & 0x400000))                      # 1 + q / 32
        unit = 32.0
    else:
        f = _one_plus(_to(words, _d5(e * 8) + _b5(h * 4), 19) & 0x780000)        # 1 + q / 16
        unit = 16.0
    s = _a3(c * 2) + _b3(h)                                                       # the 32-value sub-block, 0..7
    m3 = _r3(mask_n)
    pair = tl.load(sc_ptr + (j * 4 + s // 2) * N + _r3(n), mask=m3, other=0) >> ((s % 2) * 16)
    dm = tl.load(dm_ptr + j * N + _r3(n), mask=m3, other=0)
    return f, _half(dm) * (pair & 0xFF).to(tl.float32) * unit, _half(dm >> 16) * ((pair >> 8) & 0xFF).to(tl.float32)


@triton.jit
def _q6_k(ql_ptr, qh_ptr, sc_ptr, d_ptr, n, mask_n, j, a0, N, AP: tl.constexpr):
    """ql[128] low nibbles, qh[64] high 2 bits, scales int8 [16], d: d*sc*(q - 32) per 16 values. Axes (a 4, b 4,
    w 4, e 4): value 16s + 4w + e of sub-block s = 4a + b (s = 8g + 4h + b: g = a // 2, h = a % 2) is nibble h of ql
    byte 64g + 16b + 4w + e with bits 2(2h + b // 2) of qh byte 32g + 16(b % 2) + 4w + e. Column-major planes
    (layout.py): ql, qh and the scales (four a word) as int32 words, d as fp16."""
    a = a0 + tl.arange(0, AP)
    b, w, e = tl.arange(0, 4), tl.arange(0, 4), tl.arange(0, 4)
    m5 = _r5(mask_n)
    g, h = _a5(a // 2), _a5(a % 2)
    low = _to(_words(ql_ptr, (j * 32 + g * 16 + _b5(b * 4) + _c5(w)) * N + _r5(n), m5), _d5(e * 8) + h * 4, 17)
    high = _to(_words(qh_ptr, (j * 16 + g * 8 + _b5((b % 2) * 4) + _c5(w)) * N + _r5(n), m5),
               _d5(e * 8) + h * 4 + _b5((b // 2) * 2), 21)
    f = _one_plus((low & 0x1E0000) | (high & 0x600000))                          # 1 + q / 64
    m3 = _r3(mask_n)
    word = tl.load(sc_ptr + (j * 4 + _a3(a)) * N + _r3(n), mask=m3, other=0)
    sc = ((word >> (_b3(b) * 8)) & 0xFF).to(tl.int8).to(tl.float32)
    scale = _f16(d_ptr, j * N + _r3(n), m3) * sc * 64.0
    return f, scale, scale


@triton.jit
def _iq4_xs(d_ptr, sc_ptr, qs_ptr, lut_ptr, n, mask_n, j, a0, NB, AP: tl.constexpr):
    """d, scales_h u16, scales_l[4] (eight 6-bit scales, -32), qs 4-bit [128] into the IQ4_NL table. Axes (s 8,
    h 2, w 4, e 4): value 32s + 16h + 4w + e is nibble h of qs byte 16s + 4w + e."""
    s = a0 + tl.arange(0, AP)
    h, w, e = tl.arange(0, 2), tl.arange(0, 4), tl.arange(0, 4)
    blk = n * NB + j
    words = _words(qs_ptr, _r5(blk * 32) + _a5(s * 4) + _c5(w), _r5(mask_n))
    f = tl.load(lut_ptr + ((words >> (_d5(e * 8) + _b5(h * 4)).to(tl.uint32)) & 0xF))
    s3 = _a3(s)
    m3 = _r3(mask_n)
    base = _r3(blk * 6)                                                           # scales_h (2 bytes), scales_l (4)
    lo4 = (_u8(sc_ptr, base + 2 + s3 // 2, m3) >> ((s3 % 2) * 4)) & 0xF
    hi2 = (_u8(sc_ptr, base + s3 // 4, m3) >> ((s3 % 4) * 2)) & 3
    scale = _f16(d_ptr, _r3(blk), m3) * ((lo4 | (hi2 << 4)) - 32).to(tl.float32)
    return f, scale, scale


# --- 32-value blocks: eight a tile, one a value of axis A ----------------------------------------------------
@triton.jit
def _block32(d_ptr, qh_ptr, qs_ptr, lut_ptr, n, mask_n, j, a0, NB, AP: tl.constexpr, TYPE: tl.constexpr):
    """Q4_0 (q - 8)d, Q4_1 qd + m, Q5_0 (q - 16)d, Q5_1 qd + m (fifth bit t of the block's u32 qh), IQ4_NL
    table[q]d, Q8_0 int8 q * d. Axes (a 8, h 2, w 4, e 4): value 16h + 4w + e of block a is nibble h of qs byte
    4w + e; Q8_0's (a 8, 1, w 8, e 4): byte 4w + e. Blocks past the row's NB are masked (K not a multiple of 256)."""
    a = j * 8 + a0 + tl.arange(0, AP)
    ok = a < NB
    blk = n * NB
    m5 = _r5(mask_n) & _a5(ok)
    m3 = _r3(mask_n) & _a3(ok)
    if TYPE == Q8_0:
        w, e = tl.arange(0, 8), tl.arange(0, 4)
        words = _words(qs_ptr, (_r5(blk) + _a5(a)) * 8 + _c5(w), m5)
        # byte b + 128 (b signed) at bits 15..22: f = 1 + (b + 128) / 256 = 1.5 + b / 256
        f = ((_to(words, _d5(e * 8), 15) & 0x7F8000) ^ 0x3FC00000).to(tl.float32, bitcast=True)
        unit = 256.0
    else:
        h, w, e = tl.arange(0, 2), tl.arange(0, 4), tl.arange(0, 4)
        words = _words(qs_ptr, (_r5(blk) + _a5(a)) * 4 + _c5(w), m5)
        at = _d5(e * 8) + _b5(h * 4)
        if TYPE == IQ4_NL:
            f = tl.load(lut_ptr + ((words >> at.to(tl.uint32)) & 0xF))
            unit = 1.0
        elif TYPE == Q5_0 or TYPE == Q5_1:
            high = _to(_words(qh_ptr, _r5(blk) + _a5(a), m5), _b5(h * 16) + _c5(w * 4) + _d5(e), 22)
            f = _one_plus((_to(words, at, 18) & 0x3C0000) | (high & 0x400000))  # 1 + q / 32
            unit = 32.0
        else:
            f = _one_plus(_to(words, at, 19) & 0x780000)                         # 1 + q / 16
            unit = 16.0
    if TYPE == Q4_1 or TYPE == Q5_1:                # d and m, two fp16 a block
        at2 = (_r3(blk) + _a3(a)) * 2
        scale, minus = _f16(d_ptr, at2, m3) * unit, -_f16(d_ptr, at2 + 1, m3)
    else:
        scale = _f16(d_ptr, _r3(blk) + _a3(a), m3) * unit
        minus = scale
    return f, scale, minus


@triton.jit
def decode(p0, p1, p2, p3, lut_ptr, n, mask_n, j, a0, NB, N, TYPE: tl.constexpr, AP: tl.constexpr):
    """(f, scale, minus) of values a0 * B*C*D ... (a0 + AP) * B*C*D - 1 of tile j of rows n of N (module docstring);
    minus is meaningful only for the types with mins (layout.GgmlLayout.has_min)."""
    if TYPE == Q2_K:
        f, scale, minus = _q2_k(p0, p1, p2, n, mask_n, j, a0, N, AP)
    elif TYPE == Q3_K:
        f, scale, minus = _q3_k(p0, p1, p2, p3, n, mask_n, j, a0, N, AP)
    elif TYPE == Q4_K:
        f, scale, minus = _q45_k(p0, p1, p2, p2, n, mask_n, j, a0, N, AP, False)
    elif TYPE == Q5_K:
        f, scale, minus = _q45_k(p0, p1, p2, p3, n, mask_n, j, a0, N, AP, True)
    elif TYPE == Q6_K:
        f, scale, minus = _q6_k(p0, p1, p2, p3, n, mask_n, j, a0, N, AP)
    elif TYPE == IQ4_XS:
        f, scale, minus = _iq4_xs(p0, p1, p2, lut_ptr, n, mask_n, j, a0, NB, AP)
    elif TYPE == Q5_0 or TYPE == Q5_1:
        f, scale, minus = _block32(p0, p1, p2, lut_ptr, n, mask_n, j, a0, NB, AP, TYPE)
    else:                                           # Q4_0, Q4_1, Q8_0, IQ4_NL: scale plane, code plane
        f, scale, minus = _block32(p0, p0, p1, lut_ptr, n, mask_n, j, a0, NB, AP, TYPE)
    return f, scale, minus
