"""The packed-half dot products of Q4_K, Q5_K and Q6_K code words (PTX, fp16 activations; float32 twins for the
interpreter) that gemv_cols.py's GEMV runs, as the affine kernels' H2 loop does.

The fp32 GEMV (gemv.py) spends a funnel shift, two logic ops and an FMA on each value. Here a 32-bit word yields two
pairs of halves per LOP3 (Marlin's trick: (code | 0x6400) is the half 1024 + code), one FMA a pair maps them to
(q - center) / 16 exactly, two packed FMAs a pair take the dot product, and a lane sums at most eight products in
fp16; scales and mins apply in float32.

Q4_K: word i of a 64-value chunk j holds values 4i..4i+3 of sub-block 2j in its low nibbles and of 2j + 1 in its high
ones. Q5_K: the same, and bits 2j, 2j + 1 of qh word i's bytes join those nibbles as 16 with one more LOP3 a pair,
as Q6_K's qh bits do: per 128-value half h, ql words i and 8 + i and qh word i hold values 4i..4i+3 of the four
32-value quarters, qh's 2-bit fields joining ql's nibbles.
"""
from __future__ import annotations

import struct

from quanta.kernels.ggml.decode import _half
from quanta.kernels.triton_support import tl, triton

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


def _h2_immediate(v: float) -> str:
    """The 32-bit immediate of the pair (v, v) of fp16 (v exact in fp16)."""
    bits = struct.unpack("<H", struct.pack("<e", v))[0]
    return f"0x{bits:04X}{bits:04X}"


def _q23k_run_ptx(j: int, h: int | None) -> str:
    """PTX of run j (the 2-bit codes at bits 2j of every byte) of four Q2_K words $1..$4 (Q3_K, h given: then their
    hmask words $5..$8, bit 4h + j of a byte the code's third bit) against each word's pairs (x0, x2), (x1, x3), the
    next eight operands, summed in packed halves (eight products a lane) into $0 in float32. A lop3 leaves the half
    1024 + 4^j q (Q3_K: the third bit rotated into bit 2j + 2 and ORed in), one FMA by 4^-j maps it to q (q - 4)
    exactly; bytes 1 and 3 likewise from the word shifted right by 8."""
    q3 = h is not None
    pairs = 5 + 4 * q3
    mask, third = (3 << 2 * j) * 0x10001, (4 << 2 * j) * 0x10001
    lines = [f"mov.b32 k, {_h2_immediate(4.0 ** -j)};", f"mov.b32 z, {_h2_immediate(-1024.0 * 4.0 ** -j - 4 * q3)};"]
    for c in range(4):
        for half, src in enumerate((f"${1 + c}", "t")):
            if half:
                lines.append(f"shr.u32 t, ${1 + c}, 8;")
            lines.append(f"lop3.b32 v, {src}, 0x{mask:08X}, 0x64006400, 0xEA;")
            if q3:
                rot = (j + 2 - 4 * h - 8 * half) % 32
                lines += [f"shf.l.wrap.b32 u, ${5 + c}, ${5 + c}, {rot};", f"lop3.b32 v, u, 0x{third:08X}, v, 0xEA;"]
            lines.append("fma.rn.f16x2 v, v, k, z;")
            x = f"${pairs + 2 * c + half}"
            lines.append(f"mul.rn.f16x2 a, v, {x};" if c == half == 0 else f"fma.rn.f16x2 a, v, {x}, a;")
    return ("{\n.reg .b32 t, u, v, a, k, z;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n" + "\n".join(lines) + "\n"
            + _LANES_TO_F32.format(acc="a", out="$0") + "}")


_Q2K_RUNS = tl.constexpr(tuple(_q23k_run_ptx(j, None) for j in range(4)))          # by run j
_Q3K_RUNS = tl.constexpr(tuple(_q23k_run_ptx(j, h) for h in range(2) for j in range(4)))   # by 4h + j
Q2K_RUN_ARGS = tl.constexpr("=f," + ",".join(["r"] * 12))
Q3K_RUN_ARGS = tl.constexpr("=f," + ",".join(["r"] * 16))


# (x0 | x2 << 16, x1 | x3 << 16, x0 + x1 + x2 + x3 in float32) of a 64-bit word of four fp16 activations: two
# byte permutes, four conversions and three adds
_X_PAIRS_PTX = tl.constexpr("{\n.reg .b32 lo, hi;\n.reg .b16 x0, x1, x2, x3;\n.reg .f32 f0, f1, f2, f3;\n"
                            "mov.b64 {lo, hi}, $3;\nprmt.b32 $0, lo, hi, 0x5410;\nprmt.b32 $1, lo, hi, 0x7632;\n"
                            "mov.b32 {x0, x1}, lo;\nmov.b32 {x2, x3}, hi;\ncvt.f32.f16 f0, x0;\ncvt.f32.f16 f1, x1;\n"
                            "cvt.f32.f16 f2, x2;\ncvt.f32.f16 f3, x3;\nadd.f32 f0, f0, f1;\nadd.f32 f2, f2, f3;\n"
                            "add.f32 $2, f0, f2;\n}")


@triton.jit
def _x_pairs(x_at, PTX: tl.constexpr):
    """The activation pairs of a word's four bytes at x_at (values 0, 2 and 1, 3), and their float32 sum: one
    64-bit load of the four (x_at 8-byte aligned; every thread loads the same activations, so a load each would
    cost the loop an issue slot a value), the pairs made by byte permutes in PTX (masks and shifts without)."""
    q = tl.load(x_at.to(tl.pointer_type(tl.int64)), eviction_policy="evict_last")
    if PTX:
        p02, p13, xs = tl.inline_asm_elementwise(_X_PAIRS_PTX, "=r,=r,=f,l", [q],
                                                 dtype=(tl.int32, tl.int32, tl.float32), is_pure=True, pack=1)
    else:
        lo, hi = q.to(tl.int32), (q >> 32).to(tl.int32)     # x0 | x1 << 16, x2 | x3 << 16
        xs = (_half(lo) + _half(lo >> 16)) + (_half(hi) + _half(hi >> 16))
        p02, p13 = (lo & 0xFFFF) | (hi << 16), ((lo >> 16) & 0xFFFF) | (hi & -65536)
    return p02, p13, xs


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
def _q23k_word_f32(w, hm, p02, p13, J: tl.constexpr, H: tl.constexpr, Q3: tl.constexpr):
    """The float32 twin of one word of _q23k_run_ptx: run J's codes (Q3_K: with their third bits from hm) times x."""
    w = w.to(tl.int32)
    even, odd = (w >> 2 * J) & 0x00030003, (w >> 8 + 2 * J) & 0x00030003
    if Q3:
        m = hm.to(tl.int32)
        even |= ((m >> 4 * H + J) & 0x00010001) << 2
        odd |= ((m >> 8 + 4 * H + J) & 0x00010001) << 2
    dot = _pair_dot(even, odd, p02, p13)
    if Q3:
        dot -= 4.0 * (_lane(p02, 0) + _lane(p02, 16) + _lane(p13, 0) + _lane(p13, 16))
    return dot


@triton.jit
def _q23k_dot(w0, w1, w2, w3, m0, m1, m2, m3, x0, x1, x2, x3, J: tl.constexpr, H: tl.constexpr, Q3: tl.constexpr,
              PTX: tl.constexpr):
    """Sum of q * x (Q3_K: (q - 4) * x) over run J of four Q2_K / Q3_K qs words w_c (Q3_K: their hmask words m_c,
    half H; Q2_K reads neither); x_c word c's pairs ((0, 2), (1, 3)). The PTX on CUDA, its float32 twin in the
    interpreter."""
    if PTX:
        if Q3:
            dot = tl.inline_asm_elementwise(_Q3K_RUNS[4 * H + J], Q3K_RUN_ARGS,
                                            [w0, w1, w2, w3, m0, m1, m2, m3, x0[0], x0[1], x1[0], x1[1], x2[0], x2[1],
                                             x3[0], x3[1]], dtype=tl.float32, is_pure=True, pack=1)
        else:
            dot = tl.inline_asm_elementwise(_Q2K_RUNS[J], Q2K_RUN_ARGS,
                                            [w0, w1, w2, w3, x0[0], x0[1], x1[0], x1[1], x2[0], x2[1], x3[0], x3[1]],
                                            dtype=tl.float32, is_pure=True, pack=1)
    else:
        dot = (_q23k_word_f32(w0, m0, x0[0], x0[1], J, H, Q3) + _q23k_word_f32(w1, m1, x1[0], x1[1], J, H, Q3)
               + _q23k_word_f32(w2, m2, x2[0], x2[1], J, H, Q3) + _q23k_word_f32(w3, m3, x3[0], x3[1], J, H, Q3))
    return dot


@triton.jit
def _small_float(v):
    """Integer 0 <= v < 2**23 as float32, by the float 2**23 + v (no int-to-float conversion)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _u8_float(word, SHIFT: tl.constexpr):
    """Byte SHIFT / 8 of int32 `word` as float32."""
    return _small_float((word >> SHIFT) & 0xFF)


# The pairs of four 64-bit words of activations ($9..$12: x0..x3 each), as _X_PAIRS_PTX's ($0 $1 the first word's ..
# $6 $7 the last's), and the sum of the sixteen ($8): packed-half adds, each lane summing eight, then the two lanes
# in float32. Seven adds and two conversions instead of a float32 sum per word (four conversions and three adds).
_X_PAIRS4_PTX = tl.constexpr(
    "{\n.reg .b32 l0, h0, l1, h1, l2, h2, l3, h3, s, t;\n.reg .b16 y0, y1;\n.reg .f32 f0, f1;\n"
    + "".join(f"mov.b64 {{l{i}, h{i}}}, ${9 + i};\nprmt.b32 ${2 * i}, l{i}, h{i}, 0x5410;\n"
              f"prmt.b32 ${2 * i + 1}, l{i}, h{i}, 0x7632;\n" for i in range(4))
    + "add.rn.f16x2 s, l0, h0;\n"
    + "".join(f"add.rn.f16x2 t, l{i}, h{i};\nadd.rn.f16x2 s, s, t;\n" for i in range(1, 4))
    + "mov.b32 {y0, y1}, s;\ncvt.f32.f16 f0, y0;\ncvt.f32.f16 f1, y1;\nadd.f32 $8, f0, f1;\n}")


@triton.jit
def _x_pairs4(x_at, PTX: tl.constexpr):
    """The pairs of four consecutive words' activations (x_at, x_at + 4, + 8, + 12) and their sum in float32 (with
    PTX summed in packed halves first: _X_PAIRS4_PTX)."""
    if PTX:
        q = x_at.to(tl.pointer_type(tl.int64))
        q0 = tl.load(q, eviction_policy="evict_last")
        q1 = tl.load(q + 1, eviction_policy="evict_last")
        q2 = tl.load(q + 2, eviction_policy="evict_last")
        q3 = tl.load(q + 3, eviction_policy="evict_last")
        p0, r0, p1, r1, p2, r2, p3, r3, xs = tl.inline_asm_elementwise(
            _X_PAIRS4_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,=f,l,l,l,l", [q0, q1, q2, q3],
            dtype=(tl.int32,) * 8 + (tl.float32,), is_pure=True, pack=1)
    else:
        p0, r0, s0 = _x_pairs(x_at, PTX)
        p1, r1, s1 = _x_pairs(x_at + 4, PTX)
        p2, r2, s2 = _x_pairs(x_at + 8, PTX)
        p3, r3, s3 = _x_pairs(x_at + 12, PTX)
        xs = s0 + s1 + s2 + s3
    return (p0, r0), (p1, r1), (p2, r2), (p3, r3), xs


@triton.jit
def _q6k_pairs(x_at, PTX: tl.constexpr):
    """A word column's pairs: quarters 0..3 (x_at + 32q) x (values 0, 2), (1, 3)."""
    p0, r0, _ = _x_pairs(x_at, PTX)
    p1, r1, _ = _x_pairs(x_at + 32, PTX)
    p2, r2, _ = _x_pairs(x_at + 64, PTX)
    p3, r3, _ = _x_pairs(x_at + 96, PTX)
    return p0, r0, p1, r1, p2, r2, p3, r3
