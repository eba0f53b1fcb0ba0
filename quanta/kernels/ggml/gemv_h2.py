"""Packed-half GEMVs for Q4_K, Q5_K and Q6_K (fp16 activations, CUDA): code words become pairs of halves with a logic
op each and meet the activations in packed-half FMAs (PTX), as the affine kernels' H2 loop does.

The fp32 GEMV (gemv.py) spends a funnel shift, two logic ops and an FMA on each value. Here a 32-bit word yields two
pairs of halves per LOP3 (Marlin's trick: (code | 0x6400) is the half 1024 + code), one FMA a pair maps them to
(q - center) / 16 exactly, two packed FMAs a pair take the dot product, and a lane sums at most eight products in
fp16; scales and mins apply in float32. Each step loads the next super-block while it computes this one.

Q4_K: word i of a 64-value chunk j holds values 4i..4i+3 of sub-block 2j in its low nibbles and of 2j + 1 in its high
ones; its scales are read repacked (layout.k4_scale_pairs). Q5_K: the same, and bits 2j, 2j + 1 of qh word i's bytes
join those nibbles as 16 with one more LOP3 a pair, as Q6_K's qh bits do: per 128-value half h, ql words i and 8 + i
and qh word i hold values 4i..4i+3 of the four 32-value quarters, qh's 2-bit fields joining ql's nibbles.
"""
from __future__ import annotations

import torch

from quanta.kernels.affine.gemv import _pair
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.gemv import GemvConfig, Launch, store_row
from quanta.kernels.ggml.layout import GgmlState
from quanta.kernels.triton_support import tl, triton

TYPES = ("q4_K", "q5_K", "q6_K")

_LANES_TO_F32 = """mov.b32 {{h0, h1}}, {acc};
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 {out}, f0, f1;
"""
_CONSTANTS = """mov.b32 c_lo, 0x2C002C00;
mov.b32 b_lo, {b_lo};
mov.b32 c_hi, 0x1C001C00;
mov.b32 b_hi, {b_hi};
"""
Q4K_WORDS = 4               # code words a Q4_K asm call takes (i = 4g .. 4g + 3 of a chunk): one fp16 sum a lane


def _q4k_word(word: str, xa02: str, xa13: str, xb02: str, xb13: str, first: bool, qh: tuple[str, str] = ()) -> str:
    """One Q4_K word into the packed sums a (low nibbles) and b (high nibbles). (1024 + q)/16 - 64 = q/16 and
    (1024 + 16q)/256 - 4 = q/16, exact in fp16. Q5_K's qh: its qh word and the rotation 4 - 2j (chunk j) that takes
    the fifth bits of bytes 0 and 2 to bits 4 (low nibble's) and 5 (high's), of bytes 1 and 3 to 12 and 13."""
    start = "mul.rn.f16x2 a, lo, {xa02};\nmul.rn.f16x2 b, hi, {xb02};\n" if first else \
        "fma.rn.f16x2 a, lo, {xa02}, a;\nfma.rn.f16x2 b, hi, {xb02}, b;\n"
    fifth02 = f"shf.l.wrap.b32 q, {qh[0]}, {qh[0]}, {qh[1]};\nshl.b32 u, q, 3;\n" if qh else ""
    fifth13 = "shr.u32 u, q, 8;\nshr.u32 v, q, 5;\n" if qh else ""
    return (_halves("{w}", fifth02, "q", "u") + """fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
""" + start + "shr.u32 t, {w}, 8;\n" + _halves("t", fifth13, "u", "v") + """fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
fma.rn.f16x2 a, lo, {xa13}, a;
fma.rn.f16x2 b, hi, {xb13}, b;
""").format(w=word, xa02=xa02, xa13=xa13, xb02=xb02, xb13=xb13)


def _halves(src: str, fifth: str, lo5: str, hi5: str) -> str:
    """lo / hi: the low / high nibbles of bytes 0 and 2 of src as the halves 1024 + q and 1024 + 16q; with Q5_K's
    `fifth` (PTX leaving the fifth bits at bits 4, 20 of lo5 and 8, 24 of hi5) those ORed in at 16 first."""
    if not fifth:
        return f"lop3.b32 lo, {src}, 0x000F000F, 0x64006400, 0xEA;\nlop3.b32 hi, {src}, 0x00F000F0, 0x64006400, 0xEA;\n"
    return (fifth + f"lop3.b32 lo, {lo5}, 0x00100010, 0x64006400, 0xEA;\n"
            f"lop3.b32 hi, {hi5}, 0x01000100, 0x64006400, 0xEA;\n"
            f"lop3.b32 lo, {src}, 0x000F000F, lo, 0xEA;\nlop3.b32 hi, {src}, 0x00F000F0, hi, 0xEA;\n")


# $0 / $1: the low / high nibbles' sums; $2..$5 the words; then per word the pairs (A 0,2), (A 1,3), (B 0,2), (B 1,3)
_Q4K_DOT = tl.constexpr("{\n.reg .b32 t, lo, hi, a, b, c_lo, b_lo, c_hi, b_hi;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n"
                        + _CONSTANTS.format(b_lo="0xD400D400", b_hi="0xC400C400")
                        + "".join(_q4k_word(f"${2 + c}", *(f"${2 + Q4K_WORDS + 4 * c + e}" for e in range(4)), c == 0)
                                  for c in range(Q4K_WORDS))
                        + _LANES_TO_F32.format(acc="a", out="$0") + _LANES_TO_F32.format(acc="b", out="$1") + "}")
Q4K_CONSTRAINTS = tl.constexpr("=f,=f," + ",".join(["r"] * (Q4K_WORDS * 5)))

# Q5_K: as _Q4K_DOT, then $6..$9 the words' qh words, $10 the rotation 4 - 2j; the pairs from $11
_Q5K_DOT = tl.constexpr(
    "{\n.reg .b32 t, q, u, v, lo, hi, a, b, c_lo, b_lo, c_hi, b_hi;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n"
    + _CONSTANTS.format(b_lo="0xD400D400", b_hi="0xC400C400")
    + "".join(_q4k_word(f"${2 + c}", *(f"${3 + 2 * Q4K_WORDS + 4 * c + e}" for e in range(4)), c == 0,
                        (f"${2 + Q4K_WORDS + c}", f"${2 + 2 * Q4K_WORDS}")) for c in range(Q4K_WORDS))
    + _LANES_TO_F32.format(acc="a", out="$0") + _LANES_TO_F32.format(acc="b", out="$1") + "}")
Q5K_CONSTRAINTS = tl.constexpr("=f,=f," + ",".join(["r"] * (Q4K_WORDS * 6 + 1)))

Q6K_WORDS = 2               # word columns a Q6_K asm call takes (i = 2g, 2g + 1): both in one 16-value sub-block


def _q6k_word(ql0: str, ql1: str, qh: str, pairs: list[str], first: bool) -> str:
    """One column of Q6_K words (ql word i, ql word 8 + i, qh word i) into the four quarters' packed sums a0..a3.
    qh << 4 brings quarter 0's bits to 4-5 and quarter 2's to 8-9, qh << 2 quarters 1 and 3's (for bytes 1 and 3:
    qh >> 4 and qh >> 6, which keep byte 3's top bits that a shift of qh << 4 would drop); (1024 + q)/16 - 66
    = (q - 32)/16 and (1024 + 16q)/256 - 6 = (q - 32)/16, exact in fp16. pairs: quarters 0..3 x (0,2), (1,3)."""
    def codes(a, b, h4, h2):
        return f"""lop3.b32 q0, {a}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q0, {h4}, 0x00300030, q0, 0xEA;
lop3.b32 q2, {a}, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 q2, {h4}, 0x03000300, q2, 0xEA;
lop3.b32 q1, {b}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q1, {h2}, 0x00300030, q1, 0xEA;
lop3.b32 q3, {b}, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 q3, {h2}, 0x03000300, q3, 0xEA;
fma.rn.f16x2 q0, q0, c_lo, b_lo;
fma.rn.f16x2 q1, q1, c_lo, b_lo;
fma.rn.f16x2 q2, q2, c_hi, b_hi;
fma.rn.f16x2 q3, q3, c_hi, b_hi;
"""

    def dots(half, start):
        return "".join((f"mul.rn.f16x2 a{q}, q{q}, {pairs[2 * q + half]};\n" if start else
                        f"fma.rn.f16x2 a{q}, q{q}, {pairs[2 * q + half]}, a{q};\n") for q in range(4))
    return (f"shl.b32 h4, {qh}, 4;\nshl.b32 h2, {qh}, 2;\n" + codes(ql0, ql1, "h4", "h2") + dots(0, first)
            + f"shr.u32 s0, {ql0}, 8;\nshr.u32 s1, {ql1}, 8;\nshr.u32 s4, {qh}, 4;\nshr.u32 s2, {qh}, 6;\n"
            + codes("s0", "s1", "s4", "s2") + dots(1, False))


# $0..$3 the quarters' sums; then per word column c: ql word, ql word + 8, qh word (3c + 4..6), then its 8 pairs
_Q6K_DOT = tl.constexpr(
    "{\n.reg .b32 h4, h2, s0, s1, s4, s2, q0, q1, q2, q3, a0, a1, a2, a3, c_lo, b_lo, c_hi, b_hi;\n"
    ".reg .f16 h0, h1;\n.reg .f32 f0, f1;\n" + _CONSTANTS.format(b_lo="0xD420D420", b_hi="0xC600C600")
    + "".join(_q6k_word(*(f"${4 + 3 * c + e}" for e in range(3)),
                        [f"${4 + 3 * Q6K_WORDS + 8 * c + e}" for e in range(8)], c == 0) for c in range(Q6K_WORDS))
    + "".join(_LANES_TO_F32.format(acc=f"a{q}", out=f"${q}") for q in range(4)) + "}")
Q6K_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * (Q6K_WORDS * 11)))


@triton.jit
def _x_pairs(x_at):
    """The activation pairs of a word's four bytes at x_at (values 0, 2 and 1, 3), and their float32 sum."""
    x0 = tl.load(x_at, eviction_policy="evict_last")
    x1 = tl.load(x_at + 1, eviction_policy="evict_last")
    x2 = tl.load(x_at + 2, eviction_policy="evict_last")
    x3 = tl.load(x_at + 3, eviction_policy="evict_last")
    xs = x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32)
    return _pair(x0, x2), _pair(x1, x3), xs


@triton.jit
def _lane(p, SHIFT: tl.constexpr):
    """Lane SHIFT // 16 of a pair (_pair) as float32."""
    return ((p >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_dot(q_even, q_odd, p02, p13):
    """q0 x0 + q2 x2 + q1 x1 + q3 x3 in float32, q_even / q_odd the codes of bytes (0, 2) / (1, 3)."""
    return ((q_even & 0xFF).to(tl.float32) * _lane(p02, 0) + (q_even >> 16).to(tl.float32) * _lane(p02, 16)
            + (q_odd & 0xFF).to(tl.float32) * _lane(p13, 0) + (q_odd >> 16).to(tl.float32) * _lane(p13, 16))


@triton.jit
def _q4k_word_f32(w, a02, a13, b02, b13):
    """The float32 twin of one word of _Q4K_DOT: (sum q/16 x over the low nibbles, over the high nibbles)."""
    w = w.to(tl.int32)
    return (_pair_dot(w & 0x000F000F, (w >> 8) & 0x000F000F, a02, a13) / 16.0,
            _pair_dot((w >> 4) & 0x000F000F, (w >> 12) & 0x000F000F, b02, b13) / 16.0)


@triton.jit
def _q4k_dots(w0, w1, w2, w3, x0, x1, x2, x3, PTX: tl.constexpr):
    """Sums q/16 * x over four words' low nibbles and over their high nibbles; x_c the word's pairs
    (A 0,2; A 1,3; B 0,2; B 1,3). The PTX on CUDA, its float32 twin in the interpreter."""
    if PTX:
        dot_a, dot_b = tl.inline_asm_elementwise(
            _Q4K_DOT, Q4K_CONSTRAINTS, [w0, w1, w2, w3, x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3],
                                        x2[0], x2[1], x2[2], x2[3], x3[0], x3[1], x3[2], x3[3]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        a0, b0 = _q4k_word_f32(w0, x0[0], x0[1], x0[2], x0[3])
        a1, b1 = _q4k_word_f32(w1, x1[0], x1[1], x1[2], x1[3])
        a2, b2 = _q4k_word_f32(w2, x2[0], x2[1], x2[2], x2[3])
        a3, b3 = _q4k_word_f32(w3, x3[0], x3[1], x3[2], x3[3])
        dot_a, dot_b = a0 + a1 + a2 + a3, b0 + b1 + b2 + b3
    return dot_a, dot_b


@triton.jit
def _q5k_word_f32(w, qh, rot, a02, a13, b02, b13):
    """The float32 twin of one word of _Q5K_DOT: qh rotated left by rot, as the PTX does, holds the fifth bits of
    bytes 0, 2 (low, high nibble) at bits 4, 5 (and 20, 21), of bytes 1, 3 at 12, 13 (and 28, 29)."""
    u, w = qh.to(tl.uint32, bitcast=True), w.to(tl.int32)
    q = ((u << rot) | (u >> ((32 - rot) & 31))).to(tl.int32, bitcast=True)
    return (_pair_dot((w & 0xF000F) | (q & 0x100010), ((w >> 8) & 0xF000F) | ((q >> 8) & 0x100010), a02, a13) / 16.0,
            _pair_dot(((w >> 4) & 0xF000F) | ((q >> 1) & 0x100010), ((w >> 12) & 0xF000F) | ((q >> 9) & 0x100010),
                      b02, b13) / 16.0)


@triton.jit
def _q5k_dots(w0, w1, w2, w3, h0, h1, h2, h3, rot, x0, x1, x2, x3, PTX: tl.constexpr):
    """As _q4k_dots for Q5_K: h_c word c's qh word, rot = 4 - 2j (mod 32) for chunk j; the codes q are 5-bit."""
    if PTX:
        dot_a, dot_b = tl.inline_asm_elementwise(
            _Q5K_DOT, Q5K_CONSTRAINTS, [w0, w1, w2, w3, h0, h1, h2, h3, rot, x0[0], x0[1], x0[2], x0[3], x1[0], x1[1],
                                        x1[2], x1[3], x2[0], x2[1], x2[2], x2[3], x3[0], x3[1], x3[2], x3[3]],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        a0, b0 = _q5k_word_f32(w0, h0, rot, x0[0], x0[1], x0[2], x0[3])
        a1, b1 = _q5k_word_f32(w1, h1, rot, x1[0], x1[1], x1[2], x1[3])
        a2, b2 = _q5k_word_f32(w2, h2, rot, x2[0], x2[1], x2[2], x2[3])
        a3, b3 = _q5k_word_f32(w3, h3, rot, x3[0], x3[1], x3[2], x3[3])
        dot_a, dot_b = a0 + a1 + a2 + a3, b0 + b1 + b2 + b3
    return dot_a, dot_b


@triton.jit
def _q6k_codes(ql, qh, QL_SHIFT: tl.constexpr, QH_SHIFT: tl.constexpr):
    """The 6-bit codes of bytes (0, 2) as (q0 | q2 << 16): ql's nibble at QL_SHIFT, qh's 2 bits at QH_SHIFT."""
    return ((ql >> QL_SHIFT) & 0x000F000F) | (((qh >> QH_SHIFT) & 0x00030003) << 4)


@triton.jit
def _q6k_quarter_f32(ql, qh, QL_SHIFT: tl.constexpr, QH_SHIFT: tl.constexpr, p02, p13):
    """One quarter's sum (q - 32)/16 * x over a word column in float32: bytes (0, 2) then (1, 3)."""
    ql, qh = ql.to(tl.int32), qh.to(tl.int32)
    even = _q6k_codes(ql, qh, QL_SHIFT, QH_SHIFT)
    odd = _q6k_codes(ql >> 8, qh >> 8, QL_SHIFT, QH_SHIFT)
    xs = _lane(p02, 0) + _lane(p02, 16) + _lane(p13, 0) + _lane(p13, 16)
    return (_pair_dot(even, odd, p02, p13) - 32.0 * xs) / 16.0


@triton.jit
def _q6k_dots(ql0_0, ql1_0, qh_0, ql0_1, ql1_1, qh_1, x0, x1, PTX: tl.constexpr):
    """Sums (q - 32)/16 * x of the four quarters over two word columns (ql word, ql word + 8, qh word); x_c the
    column's pairs, quarters 0..3 x (0,2), (1,3). The PTX on CUDA, its float32 twin in the interpreter."""
    if PTX:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _Q6K_DOT, Q6K_CONSTRAINTS,
            [ql0_0, ql1_0, qh_0, ql0_1, ql1_1, qh_1, x0[0], x0[1], x0[2], x0[3], x0[4], x0[5], x0[6], x0[7],
             x1[0], x1[1], x1[2], x1[3], x1[4], x1[5], x1[6], x1[7]],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        d0 = _q6k_quarter_f32(ql0_0, qh_0, 0, 0, x0[0], x0[1]) + _q6k_quarter_f32(ql0_1, qh_1, 0, 0, x1[0], x1[1])
        d1 = _q6k_quarter_f32(ql1_0, qh_0, 0, 2, x0[2], x0[3]) + _q6k_quarter_f32(ql1_1, qh_1, 0, 2, x1[2], x1[3])
        d2 = _q6k_quarter_f32(ql0_0, qh_0, 4, 4, x0[4], x0[5]) + _q6k_quarter_f32(ql0_1, qh_1, 4, 4, x1[4], x1[5])
        d3 = _q6k_quarter_f32(ql1_0, qh_0, 4, 6, x0[6], x0[7]) + _q6k_quarter_f32(ql1_1, qh_1, 4, 6, x1[6], x1[7])
    return d0, d1, d2, d3


@triton.jit
def _split4(words, BLOCK_N: tl.constexpr, A: tl.constexpr):
    """Words [BLOCK_N, A, 8] as four [BLOCK_N, A, 2]: words 4g + c for c = 0..3 (a thread's 16-byte load)."""
    e0, e1 = tl.split(tl.reshape(words, (BLOCK_N, A, 2, 2, 2)))
    w0, w2 = tl.split(e0)
    w1, w3 = tl.split(e1)
    return w0, w1, w2, w3


@triton.jit
def _split2(words, BLOCK_N: tl.constexpr, A: tl.constexpr):
    """Words [BLOCK_N, A, 8] as two [BLOCK_N, A, 4]: words 2g and 2g + 1."""
    return tl.split(tl.reshape(words, (BLOCK_N, A, 4, 2)))


@triton.jit
def _u8_float(word, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of int32 `word` as float32, by the float 2**23 + byte (no int-to-float conversion)."""
    return (((word >> SHIFT) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _half(bits):
    """The fp16 in the low 16 bits of int32 `bits`, as float32."""
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_h2_kernel(x_ptr, dm_ptr, sc_ptr, qs_ptr, bias_ptr, y_ptr, N, NB, tiles_per_split, num_tiles,
                   stride_xm, stride_ym, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   PTX: tl.constexpr):
    """y[m, n] (+)= sum_k x[m, k] W[n, k] over the program's super-blocks; program (row m, BLOCK_N rows, split).
    dm_ptr: each block's d and dmin as one int32; sc_ptr: its 16 repacked scale bytes as four int32."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    j = tl.arange(0, 4)                                   # 64-value chunk: sub-blocks 2j (low) and 2j + 1 (high)
    # word 4g + c of chunk j holds values 16g + 4c .. + 3 of sub-blocks 2j and 2j + 1
    x_a = x_ptr + pid_m * stride_xm + (j[:, None] * 64 + tl.arange(0, 2)[None, :] * 16)[None, :, :]
    w_off = (offs_n * (NB * 32))[:, None, None] + (j[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]
    m3 = mask_n[:, None, None]
    # the sums stay spread over the chunks j and word groups g (a group's lanes lie in other threads) to the end
    acc_q = tl.zeros((BLOCK_N, 4, 2), dtype=tl.float32)   # sum of d * sc * dot
    acc_m = tl.zeros((BLOCK_N, 4, 2), dtype=tl.float32)   # sum of dmin * m * sum(x)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    # each step loads the next super-block's words, scales and d / dmin before it computes on this one's, so
    # that a program keeps two tiles of loads in flight
    sc_off = offs_n[:, None] * (NB * 4) + j[None, :]
    m2 = mask_n[:, None]
    n_words = tl.load(qs_ptr + w_off + t_begin * 32, mask=m3 & (t_begin < t_end), other=0)
    n_sc = tl.load(sc_ptr + sc_off + t_begin * 4, mask=m2 & (t_begin < t_end), other=0)
    n_dm = tl.load(dm_ptr + offs_n * NB + t_begin, mask=mask_n & (t_begin < t_end), other=0)
    for t in range(t_begin, t_end):
        words, sc, dm = n_words, n_sc[:, :, None], n_dm[:, None, None]
        n_words = tl.load(qs_ptr + w_off + (t + 1) * 32, mask=m3 & (t + 1 < t_end), other=0)
        n_sc = tl.load(sc_ptr + sc_off + (t + 1) * 4, mask=m2 & (t + 1 < t_end), other=0)
        n_dm = tl.load(dm_ptr + offs_n * NB + t + 1, mask=mask_n & (t + 1 < t_end), other=0)
        w0, w1, w2, w3 = _split4(words, BLOCK_N, 4)
        x_t = x_a + t * 256
        a0, a1, a2, a3, xs_a = _x_pairs4(x_t)
        b0, b1, b2, b3, xs_b = _x_pairs4(x_t + 32)
        dot_a, dot_b = _q4k_dots(w0, w1, w2, w3, (a0[0], a0[1], b0[0], b0[1]), (a1[0], a1[1], b1[0], b1[1]),
                                 (a2[0], a2[1], b2[0], b2[1]), (a3[0], a3[1], b3[0], b3[1]), PTX)
        # word j of the repacked scales: scale 2j, min 2j, scale 2j + 1, min 2j + 1 (layout.k4_scale_pairs)
        acc_q += _half(dm) * (dot_a * _u8_float(sc, 0) + dot_b * _u8_float(sc, 16))
        acc_m += _half(dm >> 16) * (xs_a * _u8_float(sc, 8) + xs_b * _u8_float(sc, 24))
    y = tl.sum(tl.sum(acc_q * 16.0 - acc_m, axis=2), axis=1)
    store_row(y, bias_ptr, y_ptr, pid_m, pid_k, offs_n, mask_n, stride_ym, HAS_BIAS, SPLIT_K)


@triton.jit
def _x_pairs4(x_at):
    """The pairs of four consecutive words' activations (x_at, x_at + 4, + 8, + 12) and their float32 sum."""
    p0, r0, s0 = _x_pairs(x_at)
    p1, r1, s1 = _x_pairs(x_at + 4)
    p2, r2, s2 = _x_pairs(x_at + 8)
    p3, r3, s3 = _x_pairs(x_at + 12)
    return (p0, r0), (p1, r1), (p2, r2), (p3, r3), s0 + s1 + s2 + s3


@triton.jit
def _q5k_h2_kernel(x_ptr, dm_ptr, sc_ptr, qh_ptr, qs_ptr, bias_ptr, y_ptr, N, NB, tiles_per_split, num_tiles,
                   stride_xm, stride_ym, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   PTX: tl.constexpr):
    """As _q4k_h2_kernel for Q5_K: qh_ptr a block's 32 qh bytes as eight int32, word i (the fifth bits of word i of
    every chunk) loaded by each chunk's threads; sc_ptr its 16 repacked scale bytes as four int32, as Q4_K's."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    j = tl.arange(0, 4)
    x_a = x_ptr + pid_m * stride_xm + (j[:, None] * 64 + tl.arange(0, 2)[None, :] * 16)[None, :, :]
    w_off = (offs_n * (NB * 32))[:, None, None] + (j[:, None] * 8 + tl.arange(0, 8)[None, :])[None, :, :]
    h_off = (offs_n * (NB * 8))[:, None, None] + (j[:, None] * 0 + tl.arange(0, 8)[None, :])[None, :, :]
    rot = ((4 - 2 * j) & 31)[None, :, None]
    m3 = mask_n[:, None, None]
    acc_q, acc_m = tl.zeros((BLOCK_N, 4, 2), dtype=tl.float32), tl.zeros((BLOCK_N, 4, 2), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    sc_off = offs_n[:, None] * (NB * 4) + j[None, :]
    n_words = tl.load(qs_ptr + w_off + t_begin * 32, mask=m3 & (t_begin < t_end), other=0)
    n_qh = tl.load(qh_ptr + h_off + t_begin * 8, mask=m3 & (t_begin < t_end), other=0)
    n_sc = tl.load(sc_ptr + sc_off + t_begin * 4, mask=mask_n[:, None] & (t_begin < t_end), other=0)
    n_dm = tl.load(dm_ptr + offs_n * NB + t_begin, mask=mask_n & (t_begin < t_end), other=0)
    for t in range(t_begin, t_end):
        words, qh, dm = n_words, n_qh, n_dm[:, None, None]
        sc = n_sc[:, :, None]
        n_words = tl.load(qs_ptr + w_off + (t + 1) * 32, mask=m3 & (t + 1 < t_end), other=0)
        n_qh = tl.load(qh_ptr + h_off + (t + 1) * 8, mask=m3 & (t + 1 < t_end), other=0)
        n_sc = tl.load(sc_ptr + sc_off + (t + 1) * 4, mask=mask_n[:, None] & (t + 1 < t_end), other=0)
        n_dm = tl.load(dm_ptr + offs_n * NB + t + 1, mask=mask_n & (t + 1 < t_end), other=0)
        w0, w1, w2, w3 = _split4(words, BLOCK_N, 4)
        h0, h1, h2, h3 = _split4(qh, BLOCK_N, 4)
        x_t = x_a + t * 256
        a0, a1, a2, a3, xs_a = _x_pairs4(x_t)
        b0, b1, b2, b3, xs_b = _x_pairs4(x_t + 32)
        dot_a, dot_b = _q5k_dots(w0, w1, w2, w3, h0, h1, h2, h3, rot, (a0[0], a0[1], b0[0], b0[1]),
                                 (a1[0], a1[1], b1[0], b1[1]), (a2[0], a2[1], b2[0], b2[1]),
                                 (a3[0], a3[1], b3[0], b3[1]), PTX)
        acc_q += _half(dm) * (dot_a * _u8_float(sc, 0) + dot_b * _u8_float(sc, 16))
        acc_m += _half(dm >> 16) * (xs_a * _u8_float(sc, 8) + xs_b * _u8_float(sc, 24))
    y = tl.sum(tl.sum(acc_q * 16.0 - acc_m, axis=2), axis=1)
    store_row(y, bias_ptr, y_ptr, pid_m, pid_k, offs_n, mask_n, stride_ym, HAS_BIAS, SPLIT_K)


@triton.jit
def _q6k_h2_kernel(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, bias_ptr, y_ptr, N, NB, tiles_per_split, num_tiles,
                   stride_xm, stride_ym, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   PTX: tl.constexpr):
    """As _q4k_h2_kernel for Q6_K: d * sc[16 values] * (q - 32); sc_ptr a block's 16 int8 scales as four int32."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    h = tl.arange(0, 2)                                   # 128-value half
    i = tl.arange(0, 8)                                   # word of a quarter: values 4i..4i+3
    # word column 2g + c of half h: values 8g + 4c .. + 3 of each quarter
    x_h = x_ptr + pid_m * stride_xm + (h[:, None] * 128 + tl.arange(0, 4)[None, :] * 8)[None, :, :]
    ql_off = (offs_n * (NB * 32))[:, None, None] + (h[:, None] * 16 + i[None, :])[None, :, :]
    qh_off = (offs_n * (NB * 16))[:, None, None] + (h[:, None] * 8 + i[None, :])[None, :, :]
    # the scale of quarter q of half h for word columns 2g, 2g + 1 is sc[8h + 2q + g // 2]: byte 2(q % 2) + g // 2
    # of scale word 2h + q // 2 (sc_ptr: a block's 16 int8 scales as four int32), loaded as [BLOCK_N, 2 (h), 2]
    sc_word = (h[:, None] * 2 + tl.arange(0, 2)[None, :])[None, :, :]
    m3 = mask_n[:, None, None]
    acc = tl.zeros((BLOCK_N, 2, 2), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    # as in _q4k_h2_kernel, the next super-block's loads go out before this one's arithmetic
    m_next = m3 & (t_begin < t_end)
    blk = offs_n * NB + t_begin
    n_ql0 = tl.load(ql_ptr + ql_off + t_begin * 32, mask=m_next, other=0)
    n_ql1 = tl.load(ql_ptr + ql_off + t_begin * 32 + 8, mask=m_next, other=0)
    n_qh = tl.load(qh_ptr + qh_off + t_begin * 16, mask=m_next, other=0)
    n_sc = tl.load(sc_ptr + (blk * 4)[:, None, None] + sc_word, mask=m_next, other=0)
    n_d = tl.load(d_ptr + blk, mask=mask_n & (t_begin < t_end), other=0.0)
    for t in range(t_begin, t_end):
        ql0, ql1, qh, sc, d = n_ql0, n_ql1, n_qh, n_sc, n_d.to(tl.float32)[:, None, None]
        m_next = m3 & (t + 1 < t_end)
        blk = offs_n * NB + t + 1
        n_ql0 = tl.load(ql_ptr + ql_off + (t + 1) * 32, mask=m_next, other=0)
        n_ql1 = tl.load(ql_ptr + ql_off + (t + 1) * 32 + 8, mask=m_next, other=0)
        n_qh = tl.load(qh_ptr + qh_off + (t + 1) * 16, mask=m_next, other=0)
        n_sc = tl.load(sc_ptr + (blk * 4)[:, None, None] + sc_word, mask=m_next, other=0)
        n_d = tl.load(d_ptr + blk, mask=mask_n & (t + 1 < t_end), other=0.0)
        ql0_0, ql0_1 = _split2(ql0, BLOCK_N, 2)
        ql1_0, ql1_1 = _split2(ql1, BLOCK_N, 2)
        qh_0, qh_1 = _split2(qh, BLOCK_N, 2)
        x_t = x_h + t * 256
        d0, d1, d2, d3 = _q6k_dots(ql0_0, ql1_0, qh_0, ql0_1, ql1_1, qh_1, _q6k_pairs(x_t), _q6k_pairs(x_t + 4), PTX)
        sc_lo, sc_hi = tl.split(sc)                       # words 2h and 2h + 1: scales 8h..8h+3, 8h+4..8h+7
        part = _quarter(d0, sc_lo, 0, BLOCK_N) + _quarter(d1, sc_lo, 16, BLOCK_N) \
            + _quarter(d2, sc_hi, 0, BLOCK_N) + _quarter(d3, sc_hi, 16, BLOCK_N)
        acc += d * part
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * 16.0
    store_row(y, bias_ptr, y_ptr, pid_m, pid_k, offs_n, mask_n, stride_ym, HAS_BIAS, SPLIT_K)


@triton.jit
def _q6k_pairs(x_at):
    """A word column's pairs: quarters 0..3 (x_at + 32q) x (values 0, 2), (1, 3)."""
    p0, r0, _ = _x_pairs(x_at)
    p1, r1, _ = _x_pairs(x_at + 32)
    p2, r2, _ = _x_pairs(x_at + 64)
    p3, r3, _ = _x_pairs(x_at + 96)
    return p0, r0, p1, r1, p2, r2, p3, r3


@triton.jit
def _quarter(dots, words, SHIFT: tl.constexpr, BLOCK_N: tl.constexpr):
    """A quarter's dot products [BLOCK_N, 2 (h), 4 (g)] summed per 16-value sub-block (g // 2) and scaled by the
    int8 scales at bytes SHIFT / 8 and SHIFT / 8 + 1 of `words` [BLOCK_N, 2 (h)]: [BLOCK_N, 2, 2]."""
    per_sub = tl.sum(tl.reshape(dots, (BLOCK_N, 2, 2, 2)), axis=3)
    shift = SHIFT + 8 * tl.arange(0, 2)[None, None, :]
    sc = ((words[:, :, None] >> shift) & 0xFF).to(tl.int8).to(tl.float32)
    return per_sub * sc


def applies(st: GgmlState, caps: DeviceCaps | None = None) -> str | None:
    """None where the packed-half GEMV can run this weight, else why not (the interpreter runs its float32 twin
    of the PTX; the plan takes it on CUDA only)."""
    if st.name not in TYPES:
        return f"{st.name} has no packed-half GEMV (only {', '.join(TYPES)})"
    if st.dtype != torch.float16:
        return f"{str(st.dtype).removeprefix('torch.')} activations (packed halves are fp16)"
    return None


# The GEMV streams the weight only with enough loads in flight: many programs of two warps, with more rows a program
# where the weight is large (gate/up, down) than where it is small (q/k/v, o), as the H200 sweeps of
# benchmarks/ggml_gemm.py --sweep found for Q4_K and Q5_K; Q6_K ran best with 32 rows in four warps.
Q4K_LARGE = GemvConfig(block_n=128, warps=2, waves=8.0, min_tiles=1)
Q4K_SMALL = GemvConfig(block_n=64, warps=2, waves=8.0, min_tiles=2)
Q5K_LARGE = GemvConfig(block_n=128, warps=2, waves=16.0, min_tiles=1)
Q6K = GemvConfig(block_n=32, warps=4, waves=4.0, min_tiles=2)
LARGE_WEIGHT = 1 << 25          # values (N * K) from which a weight takes its large config
CONFIGS = {"q4_K": (Q4K_SMALL, Q4K_LARGE), "q5_K": (Q4K_SMALL, Q5K_LARGE), "q6_K": (Q6K, Q6K)}   # (small, large)


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> GemvConfig:
    """The launch config of a weight (any M: the plan gives this path one row)."""
    small, large = CONFIGS[st.name]
    return large if st.n * st.k >= LARGE_WEIGHT else small


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) for fp16 x2 and a weight of TYPES, one program row per activation row."""
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1 and applies(st) is None, st.name
    caps = caps or device_caps(x2.device)
    launch = Launch.of(x2, st, config or default_config(st, caps, x2.shape[0]), caps)
    if st.name == "q4_K":          # d and dmin as one int32, the 16 repacked scale bytes as four
        kernel, planes = _q4k_h2_kernel, (st.planes[0].view(torch.int32), st.planes[1].view(torch.int32), st.planes[2])
    elif st.name == "q5_K":        # the same, and the qh words
        kernel, planes = _q5k_h2_kernel, (st.planes[0].view(torch.int32), st.planes[1].view(torch.int32),
                                          st.planes[2], st.planes[3])
    else:                          # the 16 int8 scales as four int32
        kernel, planes = _q6k_h2_kernel, (st.planes[0], st.planes[1], st.planes[2].view(torch.int32), st.planes[3])
    kernel[launch.grid](
        x2, *planes, bias if bias is not None else x2, launch.y, st.n, st.blocks, launch.tiles_per_split, st.tiles,
        x2.stride(0), launch.y.stride(0), BLOCK_N=launch.block_n, HAS_BIAS=bias is not None, SPLIT_K=launch.splits,
        PTX=caps.is_cuda, num_warps=launch.warps)
    return launch.y.to(x2.dtype)
