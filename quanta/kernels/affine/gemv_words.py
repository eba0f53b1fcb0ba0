"""A word of codes against its activations in packed halves (H2): the GEMV's inner step (gemv.py), in PTX, since
Triton has no packed-half arithmetic.

Affine codes decode by magic numbers (Marlin's trick), table codes (NF4 / FP4 / IQ4_NL) by byte permutes
(layout.lut_lookup8_ptx). A word's products add to packed-half sums whose lanes each lie in one scale group, so
that groups narrower than a K tile (32 or 64 columns) are scaled once a tile, as wider ones are.
"""
from __future__ import annotations

from quanta.kernels.affine.layout import load_half_lut_words, lut_lookup8_ptx
from quanta.kernels.triton_support import tl, triton

# A word's codes become pairs of fp16 with one LOP3 each (Marlin's trick: (code | 0x6400) is the half
# 1024 + code), one FMA maps each pair to (code - C) / D exactly (C = 2**(bits-1), D = 16 or 256, so that
# the products stay far inside fp16's range), and the pairs meet the activations in packed-half FMAs. Per 4-bit
# code: ~2 instructions instead of 3 in fp32. The word's two lanes leave as one float32 ($0), or, with TILE_SUMS,
# the FMAs add to the packed-half sum of the tile's earlier words in the element (the last operand) and the lanes
# leave once a tile (lanes): a lane's R / RS words of PACK / 2 products each stay far inside fp16's range too.
_H2_LANES_TO_F32 = """mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}"""                                    # the packed-half sum's two lanes -> one float32 ($0)
_H2_DECODE = {4: """mov.b32 c_lo, 0x2C002C00;
mov.b32 b_lo, 0xD408D408;
mov.b32 c_hi, 0x1C001C00;
mov.b32 b_hi, 0xC480C480;
lop3.b32 lo, {w}, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 hi, {w}, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
{first}fma.rn.f16x2 {a}, hi, {x1}, {a};
shr.u32 t, {w}, 8;
lop3.b32 lo, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 hi, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
fma.rn.f16x2 {b}, lo, {x2}, {b_in};
fma.rn.f16x2 {b}, hi, {x3}, {b};
""", 8: """mov.b32 c_lo, 0x1C001C00;
mov.b32 b_lo, 0xC480C480;
lop3.b32 lo, $1, 0x00FF00FF, 0x64006400, 0xEA;
shr.u32 t, $1, 8;
lop3.b32 hi, t, 0x00FF00FF, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_lo, b_lo;
{first}fma.rn.f16x2 acc, hi, $3, acc;
"""}


# the 4-bit template's word ({w}), pairs ({x1}..{x3} after the first) and sums ({a}, then {b} from {b_in}) for one
# sum (acc) over the word's pairs $2..$5
_ONE_SUM = dict(w="$1", x1="$3", x2="$4", x3="$5", a="acc", b="acc", b_in="acc")


def _h2_pairs(bits: int) -> int:
    """The activation pairs ($2 ...) a word of `bits`-bit codes meets: its codes, two a pair."""
    return 32 // bits // 2


def _h2_dot_ptx(bits: int, tile_sums: bool) -> tl.constexpr:
    """The PTX of one word of `bits`-bit codes: $1 the word, then its activation pairs; with `tile_sums` the packed
    sum so far last, and the packed sum out; else the float32 sum of its lanes out."""
    first = f"fma.rn.f16x2 acc, lo, $2, ${2 + _h2_pairs(bits)};\n" if tile_sums else "mul.rn.f16x2 acc, lo, $2;\n"
    end = "mov.b32 $0, acc;\n}" if tile_sums else _H2_LANES_TO_F32
    return tl.constexpr("{\n.reg .b32 t, lo, hi, acc, c_lo, b_lo, c_hi, b_hi;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n"
                        + _H2_DECODE[bits].format(first=first, **_ONE_SUM) + end)


def _h2_constraints(bits: int, tile_sums: bool) -> tl.constexpr:
    """The asm constraints of _h2_dot_ptx(bits, tile_sums): its output, the word, the pairs (and the packed sum)."""
    return tl.constexpr(("=r" if tile_sums else "=f") + ",r" * (1 + _h2_pairs(bits) + tile_sums))


_H2_DOT_INT4, _H2_DOT_INT8 = _h2_dot_ptx(4, False), _h2_dot_ptx(8, False)
_H2_SUM_INT4, _H2_SUM_INT8 = _h2_dot_ptx(4, True), _h2_dot_ptx(8, True)
_H2_DOT_ARGS4, _H2_DOT_ARGS8 = _h2_constraints(4, False), _h2_constraints(8, False)
# Groups of 32 (4-bit): the word's first four FMAs' pairs (x0, x4), (x1, x5) add to sum a, whose lanes are the
# groups of codes 0-1 and 4-5, (x2, x6), (x3, x7) to sum b (codes 2-3, 6-7). $0 $1 out, $2 the word, $3..$6 the
# pairs, $7 $8 in.
_H2_SUM2_INT4 = tl.constexpr("{\n.reg .b32 t, lo, hi, a, b, c_lo, b_lo, c_hi, b_hi;\n"
                             + _H2_DECODE[4].format(w="$2", first="fma.rn.f16x2 a, lo, $3, $7;\n", a="a", x1="$4",
                                                    b="b", x2="$5", b_in="$8", x3="$6")
                             + "mov.b32 $0, a;\nmov.b32 $1, b;\n}")
_H2_SUM_ARGS4, _H2_SUM_ARGS8 = _h2_constraints(4, True), _h2_constraints(8, True)
_H2_LANES = tl.constexpr("""{
.reg .b32 acc;
.reg .f16 h0, h1;
.reg .f32 f0, f1;
mov.b32 acc, $1;
""" + _H2_LANES_TO_F32)
# A 16-entry table (NF4 / FP4) instead of the magic numbers: a word's 8 codes become fp16 entries of the halved
# table (layout.lut_lookup8_ptx) and meet the activations in packed-half FMAs that add to two packed sums, one per
# scale group (nibbles 0-3, 4-7); the kernel sums a step's rows in packed halves and converts a column's two sums to
# float32 once a tile (four sums, one a pair of codes, for groups of 32: IQ4).


def _lut_sums_ptx(sums: int) -> tl.constexpr:
    """The PTX of a word's 8 table codes into `sums` packed sums (2: codes 0-3, 4-7; 4: a pair of codes each): $0 ..
    the sums out, then the word, the 4 activation pairs (x0, x1) ... (x6, x7), the sums in, the halved table's 8 byte
    words."""
    word, pairs, ins = sums, sums + 1, sums + 5
    regs = "abcd"[:sums]
    fmas = []
    for j, e in enumerate(("e01", "e23", "e45", "e67")):
        r = j * sums // 4                                  # the sum of pair j; its first pair adds to the sum in
        acc = f"${ins + r}" if j % (4 // sums) == 0 else regs[r]
        fmas.append(f"fma.rn.f16x2 {regs[r]}, {e}, ${pairs + j}, {acc};\n")
    return tl.constexpr("{\n.reg .b32 sel, t, m, lo, lo2, hi, hi2, e01, e23, e45, e67, " + ", ".join(regs) + ";\n"
                        + lut_lookup8_ptx(f"${word}", ins + sums) + "".join(fmas)
                        + "".join(f"mov.b32 ${i}, {r};\n" for i, r in enumerate(regs)) + "}")


_H2_LUT_SUMS, _H2_LUT_SUMS4 = _lut_sums_ptx(2), _lut_sums_ptx(4)
# D by bits: int4 lo halves 1024 + q -> (1024 + q)/16 - 64.5 = (q - 8)/16, hi halves 1024 + 16q ->
# (1024 + 16q)/256 - 4.5 = (q - 8)/16; int8 1024 + q -> (1024 + q)/256 - 4.5 = (q - 128)/256. Exact in fp16.
H2_DIVISOR = {4: 16.0, 8: 256.0}


@triton.jit
def load_x(x_row, perm_ptr, k, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations at input columns k (through the act-order permutation), in their own dtype."""
    kx = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
    if EVEN_K:
        x = tl.load(x_row + kx, eviction_policy="evict_last")
    else:
        x = tl.load(x_row + kx, mask=k < K, other=0.0, eviction_policy="evict_last")
    return x


@triton.jit
def pair(a, b):
    """Two fp16 vectors as one int32 vector of (a | b << 16), the operand of a packed-half instruction."""
    return (a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (b.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _load_x4(x_row, perm_ptr, k0, K, R: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """The activations of a word's 4 consecutive codes (input columns k0, k0 + R, k0 + 2R, k0 + 3R)."""
    x0 = load_x(x_row, perm_ptr, k0, K, HAS_PERM, EVEN_K)
    x1 = load_x(x_row, perm_ptr, k0 + R, K, HAS_PERM, EVEN_K)
    x2 = load_x(x_row, perm_ptr, k0 + 2 * R, K, HAS_PERM, EVEN_K)
    x3 = load_x(x_row, perm_ptr, k0 + 3 * R, K, HAS_PERM, EVEN_K)
    return x0, x1, x2, x3


@triton.jit
def _f32(x):
    return x.to(tl.float32)


@triton.jit
def word_dots(p, acc, acc2, x_row, perm_ptr, k0, K, R: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
              EVEN_K: tl.constexpr, TILE_SUMS: tl.constexpr, GROUPS: tl.constexpr):
    """Affine codes of words p [RS, BLOCK_N] (the codes i of input columns k0 + i*R): (d, d2, xs0, xs1, xs2, xs3).

    d: sum_i x_i (code_i - C) / D in float32, or with TILE_SUMS added to the packed halves acc. GROUPS scale groups
    a K tile (1, 2, or 4 with 4-bit codes; packed sums only): acc's lanes hold group 0 and 1 (GROUPS 2), or groups 0
    and 2 while d2 (acc2 plus) holds 1 and 3 (GROUPS 4); else d2 is acc2. xs_g: sum_i x_i over the codes of group g
    (float32 [RS]; the whole word's in xs0 when GROUPS is 1; unused ones 0)."""
    x0, x1, x2, x3 = _load_x4(x_row, perm_ptr, k0, K, R, HAS_PERM, EVEN_K)
    if BITS == 4:
        x4, x5, x6, x7 = _load_x4(x_row, perm_ptr, k0 + 4 * R, K, R, HAS_PERM, EVEN_K)
        pairs = [p, pair(x0, x4)[:, None], pair(x1, x5)[:, None], pair(x2, x6)[:, None], pair(x3, x7)[:, None]]
        if GROUPS == 1:
            xs = (_f32(x0) + _f32(x1) + _f32(x2) + _f32(x3) + _f32(x4) + _f32(x5) + _f32(x6) + _f32(x7),
                  0.0, 0.0, 0.0)
        elif GROUPS == 2:
            xs = (_f32(x0) + _f32(x1) + _f32(x2) + _f32(x3), _f32(x4) + _f32(x5) + _f32(x6) + _f32(x7), 0.0, 0.0)
        else:
            xs = (_f32(x0) + _f32(x1), _f32(x2) + _f32(x3), _f32(x4) + _f32(x5), _f32(x6) + _f32(x7))
    else:
        pairs = [p, pair(x0, x2)[:, None], pair(x1, x3)[:, None]]
        if GROUPS == 1:
            xs = (_f32(x0) + _f32(x1) + _f32(x2) + _f32(x3), 0.0, 0.0, 0.0)
        else:
            xs = (_f32(x0) + _f32(x1), _f32(x2) + _f32(x3), 0.0, 0.0)
    d2 = acc2
    if TILE_SUMS and BITS == 4 and GROUPS == 4:
        d, d2 = tl.inline_asm_elementwise(_H2_SUM2_INT4, "=r,=r,r,r,r,r,r,r,r", pairs + [acc, acc2],
                                          dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    elif TILE_SUMS:
        d = tl.inline_asm_elementwise(_H2_SUM_INT4 if BITS == 4 else _H2_SUM_INT8,
                                      _H2_SUM_ARGS4 if BITS == 4 else _H2_SUM_ARGS8, pairs + [acc], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        d = tl.inline_asm_elementwise(_H2_DOT_INT4 if BITS == 4 else _H2_DOT_INT8,
                                      _H2_DOT_ARGS4 if BITS == 4 else _H2_DOT_ARGS8, pairs, dtype=tl.float32,
                                      is_pure=True, pack=1)
    return d, d2, xs[0], xs[1], xs[2], xs[3]


@triton.jit
def lanes(acc):
    """The two lanes of packed halves acc, summed as float32."""
    return tl.inline_asm_elementwise(_H2_LANES, "=f,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def lane(acc, HIGH: tl.constexpr):
    """One lane of packed halves acc (the high one where HIGH) as float32."""
    h = (acc >> 16) if HIGH else acc
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def h2_add(a, b):
    """Packed halves a + b (the combine of a packed-half row sum)."""
    return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], tl.int32, True, 1)


@triton.jit
def lut_word_sums(p, s0, s1, s2, s3, x_row, perm_ptr, k0, K, lut_ptr, R: tl.constexpr, HAS_PERM: tl.constexpr,
                  EVEN_K: tl.constexpr, GROUPS: tl.constexpr):
    """Table codes of words p: packed-half sums + x[k0 + i*R] * table[code_i] / 2, by scale group. GROUPS 2: codes
    i < 4 into s0, i >= 4 into s1; GROUPS 4 (groups of 32 columns): codes 2g, 2g + 1 into s_g. Returns (s0, .., s3)."""
    x0, x1, x2, x3 = _load_x4(x_row, perm_ptr, k0, K, R, HAS_PERM, EVEN_K)
    x4, x5, x6, x7 = _load_x4(x_row, perm_ptr, k0 + 4 * R, K, R, HAS_PERM, EVEN_K)
    lut = load_half_lut_words(lut_ptr)
    args = [p, pair(x0, x1)[:, None], pair(x2, x3)[:, None], pair(x4, x5)[:, None], pair(x6, x7)[:, None]]
    table = [lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]]
    if GROUPS == 4:
        s0, s1, s2, s3 = tl.inline_asm_elementwise(_H2_LUT_SUMS4, "=r,=r,=r,=r" + ",r" * 17,
                                                   args + [s0, s1, s2, s3] + table,
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
    else:
        s0, s1 = tl.inline_asm_elementwise(_H2_LUT_SUMS, "=r,=r" + ",r" * 15, args + [s0, s1] + table,
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return s0, s1, s2, s3
