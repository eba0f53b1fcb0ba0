"""The affine kernels' weight layout, made once by `prepare()`, and the decoding every path shares.

The layout is Marlin's lessons in Triton terms (AffineState describes it): codes packed along K into int32 words,
scales as int32 words of two 16-bit floats, act-order columns sorted once. The codebook (NF4 / FP4) and FP8
weight-only kernels pack their codes the same way (`pack`, MODE LUT / FP8_*).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quanta.kernels.fp8_bits import fp8_to_f16
from quanta.kernels.triton_support import cdiv, tl, triton, zero_
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import IQ4_TABLE_SCALE
from quanta.quant.qtensor import QTensor

AFFINE, LUT, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3       # how a code becomes a number (MODE of the kernels)
# AffineState.zero of table codes whose groups of 32 are scaled by a super-block's fp16 d times a 6-bit ls - 32
# (GGUF IQ4_XS): load_scales reads super_scale_words' layout; its table is divided by SUPER_TABLE_SCALE
SUPER_SCALED = -1
SUPER_TABLE_SCALE = tl.constexpr(IQ4_TABLE_SCALE)
R = 16                      # word rows per tile: the K of one tensor-core step
# Output rows packed per pass: the repack's int64 temporaries stay a few tens of MB whatever N is, so the
# load's transient is the canonical codes alone (the memory plan's load_peak counts on it).
PACK_ROWS = 2048


@dataclass(slots=True)
class AffineState:
    """An affine weight in kernel layout, Marlin's lessons in Triton terms:

      packed [K_pad / PACK, N] int32, PACK = 32 // bits codes per word, packed along K so that every load is
      coalesced along N. Within each tile of TILE_K = PACK * R input columns (R = 16 rows of words), word
      row r holds the columns k = i * R + r for i = 0..PACK-1 (code i in bits [bits*i, bits*(i+1))), so that
      unpacking code i of a [R, BLOCK_N] tile is one shift and gives the contiguous K slice i of the tile.
      scales as int32 words [rows, N] of two 16-bit floats in the compute dtype, so that a scale row loads in
      the same register layout as a row of codes: with zero points, word g = (s_g | zbias_g << 16) where
      zbias = -s*z (or the float min) folds the zero into w = q*s + zbias; symmetric weights keep their one
      integer zero as a compile-time constant and word g holds (s_2g | s_2g+1 << 16).
      Act-order (g_idx): columns sorted by group once; activations are gathered through `perm` in-kernel, or
      once a call (in_weight_order)."""
    packed: torch.Tensor            # int32 [K_pad // PACK, N]
    sz: torch.Tensor                # int32 [G_pad or G_pad / 2, N]: scale words (see above)
    has_zb: bool                    # words hold (scale, zbias) pairs; else pairs of symmetric scales
    perm: torch.Tensor | None       # int32 [K]: column k of the sorted weight reads x[:, perm[k]]
    n: int
    k: int
    k_pad: int
    bits: int                       # bits a code field holds in the words: 4 or 8
    group_size: int                 # group of column k is k // group_size (k_pad for per-channel)
    zero: int                       # the symmetric zero point (unused when zbias is given)
    dtype: torch.dtype
    mode: int = AFFINE              # AFFINE, LUT (codebook_gemm) or FP8_* (fp8_gemm)
    lut: torch.Tensor | None = None  # float32 [2**bits] for LUT
    lut_bytes: torch.Tensor | None = None  # int32 [24]: lut_byte_words of the table, then twice of it halved
    # codes narrower than their 8-bit fields, with zero points or mins: they lie far from the field's centre, about
    # which the GEMV's packed-half loop decodes, and its sums would lose the products' low bits to the offset
    off_centre: bool = False
    plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)   # plan.choose's cache

    @property
    def tile_k(self) -> int:
        """Input columns of one K tile: PACK codes of R word rows."""
        return (32 // self.bits) * R

    @property
    def num_tiles(self) -> int:
        return self.k_pad // self.tile_k

    @property
    def tile_scale(self) -> bool:
        """Whether every K tile lies inside one scale group (one scale row a tile)."""
        return self.group_size % self.tile_k == 0

    @property
    def table_lookup(self) -> bool:
        """Whether the codes can be looked up by byte permutes: a 16-entry table (4-bit codes), whose byte words
        pack() made."""
        return self.lut_bytes is not None

    def lut_arg(self, lookup: bool) -> torch.Tensor:
        """The kernels' lut_ptr: the table's byte words for the byte-permute lookup, else the float table, else (no
        table) any tensor, never read."""
        return self.lut_bytes if lookup else self.lut if self.lut is not None else self.sz

    def in_weight_order(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] with its columns in the weight's sorted order (x2[:, perm]) for the paths that read x whole
        (dequantize + cuBLAS, wgmma); x2 itself where the weight has no act-order."""
        return x2 if self.perm is None else x2.index_select(1, self.perm)


# --- decoding in registers, shared by the paths ---------------------------------------------------

@triton.jit
def _super_d(word, other, first):
    """A super-block's d (float32) from its two scale words (byte 0 of d's bits in the first one's top byte)."""
    lo = tl.where(first, word, other)
    hi = tl.where(first, other, word)
    d_bits = ((lo >> 24) & 0xFF) | (((hi >> 24) & 0xFF) << 8)
    return d_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _super_scale(word, d, i, DT: tl.constexpr):
    """Group i's scale (of a scale word's 4) d * (ls - 32), times the table's divisor, in DT."""
    ls = (word >> (6 * i)) & 63
    return (d * ((ls - 32).to(tl.float32) * SUPER_TABLE_SCALE)).to(DT)


@triton.jit
def load_tile_table_scales(sz_ptr, t, GS, cols, mask, N, ZERO: tl.constexpr, GROUPS: tl.constexpr,
                           TILE_K: tl.constexpr, DT: tl.constexpr):
    """The scales (DT) of K tile t's packed sums of 4-bit table codes: its halves (GROUPS 2; the last two repeat
    them) or quarters (GROUPS 4); SUPER_SCALED ones all four from the tile's two scale words."""
    if ZERO == -1:                                   # SUPER_SCALED
        word = tl.load(sz_ptr + t * N + cols, mask=mask, other=0)
        other = tl.load(sz_ptr + (t ^ 1) * N + cols, mask=mask, other=0)
        d = _super_d(word, other, t % 2 == 0)
        return (_super_scale(word, d, 0, DT), _super_scale(word, d, 1, DT), _super_scale(word, d, 2, DT),
                _super_scale(word, d, 3, DT))
    kt = t * TILE_K
    s0 = load_scales(sz_ptr, kt // GS, cols, mask, N, ZERO, False, DT)[0]
    s1 = load_scales(sz_ptr, (kt + TILE_K // GROUPS) // GS, cols, mask, N, ZERO, False, DT)[0]
    s2, s3 = s0, s1
    if GROUPS == 4:
        s2 = load_scales(sz_ptr, (kt + 2 * TILE_K // 4) // GS, cols, mask, N, ZERO, False, DT)[0]
        s3 = load_scales(sz_ptr, (kt + 3 * TILE_K // 4) // GS, cols, mask, N, ZERO, False, DT)[0]
    return s0, s1, s2, s3


@triton.jit
def load_scales(sz_ptr, g, cols, mask, N, ZERO: tl.constexpr, HAS_ZB: tl.constexpr, DT: tl.constexpr):
    """(scale, zbias) in dtype DT of groups g at columns cols (broadcastable), from the int32 scale words; ZERO ==
    SUPER_SCALED: groups of 32 scaled d * (ls - 32) (IQ4_XS, super_scale_words' layout; zbias 0)."""
    if ZERO == -1:                                   # SUPER_SCALED
        word = tl.load(sz_ptr + (g // 4) * N + cols, mask=mask, other=0)
        other = tl.load(sz_ptr + ((g // 4) ^ 1) * N + cols, mask=mask, other=0)
        s = _super_scale(word, _super_d(word, other, (g // 4) % 2 == 0), g % 4, DT)
        return s, (s * 0).to(DT)
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
def load_lut_words(lut_ptr):
    """The 8 int32 byte words of a 16-entry table (lut_byte_words), as scalars for the lookups' PTX operands."""
    return (tl.load(lut_ptr), tl.load(lut_ptr + 1), tl.load(lut_ptr + 2), tl.load(lut_ptr + 3), tl.load(lut_ptr + 4),
            tl.load(lut_ptr + 5), tl.load(lut_ptr + 6), tl.load(lut_ptr + 7))


@triton.jit
def load_half_lut_words(lut_ptr):
    """The 8 byte words of the halved table (AffineState.lut_bytes' second or third 8), the copy by the thread's lane
    parity: ptxas holds values it proves uniform in uniform registers and copies each into a thread register before
    every prmt that reads it, which a lane-dependent address prevents."""
    lane_odd = tl.inline_asm_elementwise("{ .reg .b32 lane; mov.u32 lane, %laneid; and.b32 $0, lane, 1; }", "=r,r",
                                         [tl.full((), 0, tl.int32)], dtype=tl.int32, is_pure=True, pack=1)
    return load_lut_words(lut_ptr + 8 + 8 * lane_odd)


LUT_PAIRS = (0x5140, 0x7362)    # prmt selectors interleaving low and high bytes into entries (codes 0, 1), (2, 3)


def lut_lookup4_ptx(w: str, table: int, e01: str = "e01", e23: str = "e23", step: int = 1,
                    pairs: tuple[int, int] = LUT_PAIRS) -> str:
    """PTX of a 16-entry table lookup of 4 codes, the nibbles 0-3 of the word register `w`, into two pairs of 16-bit
    entries `e01` (codes 0, 1) and `e23` (codes 2, 3) by byte permutes: the codes' low 3 bits select a byte from 8
    (prmt), once among entries 0-7 and once among 8-15, for the low and the high bytes; each code's bit 3, spread to a
    byte mask by a sign-replicating prmt, picks between the two; two more prmts interleave low and high bytes.
    `table`: the operand number of the first of the 8 table words (lut_byte_words), $table, $table + step, ...
    (step 2 under pack 2, where each input comes twice). `pairs`: the two interleaving selectors, (codes 0, 1) and
    (codes 2, 3) by default. Uses the registers sel, t, m, lo, lo2, hi, hi2 (declared by the caller)."""
    mask = f"shl.b32 t, {w}, 4;\nprmt.b32 m, t, {w}, 0xD9C8;\n"
    return f"and.b32 sel, {w}, 0x7777;\n" + _lut_permutes(table, step, mask, e01, e23, pairs)


def lut_lookup8_ptx(w: str, table: int) -> str:
    """PTX of the lookup of all 8 codes of the word register `w`, as lut_lookup4_ptx's: nibbles 0-3 into e01, e23,
    then 4-7 into e45, e67. One mask of w serves both halves' selectors (prmt reads a selector's low 16 bits), and
    one shifted copy t both halves' bit-3 masks (its bytes 0, 1, then 2, 3). Uses the registers of lut_lookup4_ptx
    and e01, e23, e45, e67 (declared by the caller)."""
    low = _lut_permutes(table, 1, f"shl.b32 t, {w}, 4;\nprmt.b32 m, t, {w}, 0xD9C8;\n", "e01", "e23", LUT_PAIRS)
    high = _lut_permutes(table, 1, f"prmt.b32 m, t, {w}, 0xFBEA;\n", "e45", "e67", LUT_PAIRS)
    return f"and.b32 sel, {w}, 0x77777777;\n" + low + "shr.u32 sel, sel, 16;\n" + high


def _lut_permutes(table: int, step: int, mask: str, e_a: str, e_b: str, pairs: tuple[int, int]) -> str:
    """The lookups' permutes by the selectors in `sel`: low and high bytes among entries 0-7 and 8-15, the `mask`
    PTX (bit 3 of each code spread to its byte of m), the selects by m, the interleaves into e_a, e_b."""
    t = [f"${table + step * i}" for i in range(8)]
    return (f"prmt.b32 lo, {t[0]}, {t[1]}, sel;\nprmt.b32 lo2, {t[2]}, {t[3]}, sel;\n"
            f"prmt.b32 hi, {t[4]}, {t[5]}, sel;\nprmt.b32 hi2, {t[6]}, {t[7]}, sel;\n{mask}"
            f"lop3.b32 lo, lo, lo2, m, 0xD8;\nlop3.b32 hi, hi, hi2, m, 0xD8;\n"
            f"prmt.b32 {e_a}, lo, hi, {pairs[0]:#06x};\nprmt.b32 {e_b}, lo, hi, {pairs[1]:#06x};\n")


# PTX of one pair of affine codes decoded together (H2), used by the MMA and wgmma kernels: $1 $2 words of columns
# 2q, 2q+1; $3 $4 the prmt selector; $5 $6 the lop3 mask; $7 $8 the exact fma's factor and addend; $9 the scale
# pair; $10 the zbias pair, or -0 without zero points (an fma with -0 leaves every product as it is; ptxas makes it
# a multiply). fp16: the code, masked in place, ORs into 1024 (a high nibble into 1024 + 16 q, which the factor
# 1/16 undoes). bf16 has 7 mantissa bits, so a high nibble is shifted down first and the code ORs into 128.
def _h2_pair_ptx(bf16: bool, high: bool) -> tl.constexpr:
    magic, dt = ("0x43004300", "bf16x2") if bf16 else ("0x64006400", "f16x2")
    shift = "shr.u32 t, t, 4; " if high else ""
    return tl.constexpr(f"{{ .reg .b32 t; prmt.b32 t, $1, $2, $3; {shift}lop3.b32 t, t, $5, {magic}, 0xea; "
                        f"fma.rn.{dt} t, t, $7, $8; fma.rn.{dt} $0, t, $9, $10; }}")


H2_PAIR_F16, H2_PAIR_BF16, H2_PAIR_BF16_HIGH = _h2_pair_ptx(False, False), _h2_pair_ptx(True, False), \
    _h2_pair_ptx(True, True)


def split_k_output(m: int, st: AffineState, added: bool, device: torch.device) -> torch.Tensor:
    """y [M, N] for a launch of this weight: where programs add partial sums (split-K, stream-K) zeroed, in fp16 or,
    for bf16, float32 (each bf16 addition would round at 8 bits); else uninitialised in the compute dtype. The
    launcher returns y.to(st.dtype)."""
    if not added:
        return torch.empty(m, st.n, device=device, dtype=st.dtype)
    sums = torch.float16 if st.dtype == torch.float16 else torch.float32
    return zero_(torch.empty(m, st.n, device=device, dtype=sums))


# --- making the layout ----------------------------------------------------------------------------

def why_not(weight) -> str | None:
    """None if the weight has an exact affine form these kernels pack (an Affine, or a GGUF Q4_0 / Q4_1 / Q5_0 /
    Q5_1 / Q8_0 block weight), else why not."""
    scheme = weight.affine_scheme() if isinstance(weight, QTensor) else None
    if scheme is None:
        return f"{weight.describe() if isinstance(weight, QTensor) else 'a plain tensor'}: no exact affine form"
    if scheme.num_groups > 1 and scheme.group_size % R:
        return f"group size {scheme.group_size} is not a multiple of {R}"
    if scheme.act_order:                  # a tensor-parallel piece of an act-order weight has uneven groups
        g_idx = weight.to_affine().g_idx.long()
        if not torch.equal(g_idx.sort().values, torch.arange(len(g_idx), device=g_idx.device) // scheme.group_size):
            return f"act-order groups are not {scheme.group_size} columns each"
    return None


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> AffineState:
    """Repack once: the weight's exact affine form (GGUF blocks converted losslessly), act-order columns sorted,
    codes packed along K in 4- or 8-bit fields, zero points folded into the scale words."""
    w: Affine = weight.to(device).to_affine()
    n, k = w.shape
    codes, perm = w.codes, None
    if w.g_idx is not None:
        order = torch.argsort(w.g_idx.long(), stable=True)
        if not torch.equal(w.g_idx.long()[order], torch.arange(k, device=order.device) // w.group_size):
            raise UnsupportedError(f"{w.describe()} {list(w.shape)}: g_idx groups are not "
                                   f"{w.group_size} columns each once sorted")
        if not torch.equal(order, torch.arange(k, device=order.device)):
            codes, perm = codes[:, order], order.to(torch.int32)
    # codes of up to 4 bits are held in 4-bit words and codes of 5 to 8 bits in 8-bit words: a wider field
    # holds them exactly, and the kernels read the zero point as it is, not as the field's centre
    bits = 4 if w.bits <= 4 else 8
    group = w.group_size if w.num_groups > 1 else None
    scales = w.effective_scales()           # bnb int8's post_scale (1/127) folded in
    if w.mins is not None:
        mins = w.mins.float() if w.post_scale is None else w.mins.float() * w.post_scale
        st = pack(codes, bits, group, scales, dtype, zbias=mins, perm=perm)
    elif isinstance(w.zeros, torch.Tensor):
        st = pack(codes, bits, group, scales, dtype, zbias=-scales * w.zeros.float(), perm=perm)
    else:
        # a narrower symmetric code moves to the field's centre exactly (q - z = (q + C - z) - C), where the GEMV's
        # packed-half loop decodes about the centre and keeps its products' precision
        centre, zero = 1 << (bits - 1), int(w.zeros)
        if w.bits < bits and 0 <= zero <= centre:
            codes, zero = codes + (centre - zero), centre
        st = pack(codes, bits, group, scales, dtype, zero=zero, perm=perm)
    st.off_centre = bits == 8 and w.bits < 8 and st.has_zb
    return st


def pack(codes: torch.Tensor, bits: int, group: int | None, scales: torch.Tensor | None, dtype: torch.dtype,
         zbias: torch.Tensor | None = None, zero: int = 0, perm: torch.Tensor | None = None,
         mode: int = AFFINE, lut: torch.Tensor | None = None, scale_words: torch.Tensor | None = None) -> AffineState:
    """Kernel layout of codes [N, K] (uint8, each below 2**bits, bits 4 or 8) with scales [N, G] over groups of
    `group` columns (None: one group per row); shared by the affine, codebook and FP8 weight-only kernels.
    `scale_words`: the scale words made already (zero SUPER_SCALED: super_scale_words), in place of scales."""
    assert bits in (4, 8), bits
    n, k = codes.shape
    pack_n = 32 // bits
    tile_k = pack_n * R
    k_pad = cdiv(k, tile_k) * tile_k
    group = group or k_pad
    packed = torch.empty(k_pad // pack_n, n, dtype=torch.int32, device=codes.device)
    for n0 in range(0, n, PACK_ROWS):                   # rows at a time: bounded int64 temporaries
        rows = codes[n0:n0 + PACK_ROWS]
        # codes [rows, K_pad] -> [tiles, PACK, R, rows] -> words [tiles * R, rows]
        c = F.pad(rows, (0, k_pad - k)).view(rows.shape[0], k_pad // tile_k, pack_n, R).permute(1, 2, 3, 0)
        words = torch.zeros(k_pad // tile_k, R, rows.shape[0], dtype=torch.int64, device=codes.device)
        for i in range(pack_n):
            words |= c[:, i].to(torch.int64) << (bits * i)
        packed[:, n0:n0 + PACK_ROWS] = _int32(words).reshape(-1, rows.shape[0])
    return AffineState(packed.contiguous(), scale_words if scale_words is not None else
                       _scale_words(scales, zbias, cdiv(k_pad, group), dtype), zbias is not None, perm, n, k, k_pad,
                       bits, group, zero, dtype, mode, lut.float().contiguous() if lut is not None else None,
                       _lookup_words(lut, dtype) if lut is not None and lut.numel() == 16 else None)


def _scale_words(scales: torch.Tensor, zbias: torch.Tensor | None, g_pad: int, dtype: torch.dtype) -> torch.Tensor:
    """AffineState.sz of scales [N, G] (and zbias [N, G]) over g_pad padded groups: (scale, zbias) a word, or two
    groups' scales a word."""
    def by_group(t: torch.Tensor) -> torch.Tensor:       # [N, G] float -> 16-bit patterns [G_pad, N], int64
        out = torch.zeros(g_pad, t.shape[0], dtype=torch.float32, device=t.device)
        out[: t.shape[1]] = t.float().t()
        return out.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF

    s = by_group(scales)
    if zbias is not None:
        sz = s | by_group(zbias) << 16
    else:                                                # two groups' scales per word
        s = F.pad(s, (0, 0, 0, g_pad % 2))
        sz = s[0::2] | s[1::2] << 16
    return _int32(sz).contiguous()


def _lookup_words(lut: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """AffineState.lut_bytes: the table's byte words, then the halved table's twice. The GEMV's packed-half sums use
    the halved one so that their range is the affine codes' ((q - 8) / 16, within +-0.5; halving is exact for 16-bit
    floats), odd lanes the second copy, which keeps ptxas from holding the words as uniform values."""
    half = lut_byte_words(lut / 2, dtype)
    return torch.cat([lut_byte_words(lut, dtype), half, half])


def super_scale_words(d: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    """The scale words of SUPER_SCALED codes, from each super-block's fp16 d [N, S] and its 8 groups' 6-bit ls
    [N, S, 8] (super-blocks of 256 columns): int32 [2 S, N], word 2s + h holding ls of groups 4h .. 4h + 3 in bits
    6i .. 6i + 5 and byte h of d's bits in bits 24-31, the file's 8 bytes a super-block and column."""
    n, sb = d.shape
    bits = d.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    six = ls.to(torch.int64).view(n, sb, 2, 4) << torch.tensor([0, 6, 12, 18], device=ls.device)
    words = six.sum(-1) | torch.stack([bits & 0xFF, bits >> 8], dim=-1) << 24        # [N, S, 2]
    return _int32(words.reshape(n, 2 * sb).t()).contiguous()


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
