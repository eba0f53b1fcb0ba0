"""The GEMV path of the affine kernels: M = 1 or 2 rows over the packed layout (layout.py), no tensor cores.

At M = 1 a 4-bit weight must stream at copy bandwidth; _affine_gemv_kernel says how its inner loops fit in that.
The compiled loops: `python tests/compile_check.py --sass gemv_w4_h2` (or `affine_gemv_w4`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.gemv_out import (  # noqa: F401  (MAX_ROWS, workspace: this path's, for its callers)
    LOCK_COLUMNS,
    MAX_ROWS,
    output_columns,
    rope_fits,
    store_output,
    workspace,
)
from quanta.kernels.affine.layout import AFFINE, LUT, AffineState, R, load_half_lut_words, load_scales, lut_lookup8_ptx
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.fp8_bits import fp8_to_f16
from quanta.kernels.lora_epilogue import RANK_CHUNK, LoRAEpilogue, lora_delta, no_lora_args
from quanta.kernels.paged_kv import fp8_write_constexprs
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import (
    cdiv,
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    split_k,
    tl,
    triton,
)


# --- fp16x2 dot products of one word of codes (H2): PTX, since Triton has no packed-half arithmetic -----
# A word's codes become pairs of fp16 with one LOP3 each (Marlin's trick: (code | 0x6400) is the half
# 1024 + code), one FMA maps each pair to (code - C) / D exactly (C = 2**(bits-1), D = 16 or 256, so that
# the products stay far inside fp16's range), and the pairs meet the activations in packed-half FMAs. Per 4-bit
# code: ~2 instructions instead of 3 in fp32. The word's two lanes leave as one float32 ($0), or, with TILE_SUMS,
# the FMAs add to the packed-half sum of the tile's earlier words in the element (the last operand) and the lanes
# leave once a tile (_h2_lanes): a lane's R / RS words of PACK / 2 products each stay far inside fp16's range too.
_H2_LANES_TO_F32 = """mov.b32 {h0, h1}, acc;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
add.f32 $0, f0, f1;
}"""                                    # the packed-half sum's two lanes -> one float32 ($0)
_H2_DECODE = {4: """mov.b32 c_lo, 0x2C002C00;
mov.b32 b_lo, 0xD408D408;
mov.b32 c_hi, 0x1C001C00;
mov.b32 b_hi, 0xC480C480;
lop3.b32 lo, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 hi, $1, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
{first}fma.rn.f16x2 acc, hi, $3, acc;
shr.u32 t, $1, 8;
lop3.b32 lo, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 hi, t, 0x00F000F0, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_hi, b_hi;
fma.rn.f16x2 acc, lo, $4, acc;
fma.rn.f16x2 acc, hi, $5, acc;
""", 8: """mov.b32 c_lo, 0x1C001C00;
mov.b32 b_lo, 0xC480C480;
lop3.b32 lo, $1, 0x00FF00FF, 0x64006400, 0xEA;
shr.u32 t, $1, 8;
lop3.b32 hi, t, 0x00FF00FF, 0x64006400, 0xEA;
fma.rn.f16x2 lo, lo, c_lo, b_lo;
fma.rn.f16x2 hi, hi, c_lo, b_lo;
{first}fma.rn.f16x2 acc, hi, $3, acc;
"""}


def _h2_pairs(bits: int) -> int:
    """The activation pairs ($2 ...) a word of `bits`-bit codes meets: its codes, two a pair."""
    return 32 // bits // 2


def _h2_dot_ptx(bits: int, tile_sums: bool) -> tl.constexpr:
    """The PTX of one word of `bits`-bit codes: $1 the word, then its activation pairs; with `tile_sums` the packed
    sum so far last, and the packed sum out; else the float32 sum of its lanes out."""
    first = f"fma.rn.f16x2 acc, lo, $2, ${2 + _h2_pairs(bits)};\n" if tile_sums else "mul.rn.f16x2 acc, lo, $2;\n"
    end = "mov.b32 $0, acc;\n}" if tile_sums else _H2_LANES_TO_F32
    return tl.constexpr("{\n.reg .b32 t, lo, hi, acc, c_lo, b_lo, c_hi, b_hi;\n.reg .f16 h0, h1;\n.reg .f32 f0, f1;\n"
                        + _H2_DECODE[bits].format(first=first) + end)


def _h2_constraints(bits: int, tile_sums: bool) -> tl.constexpr:
    """The asm constraints of _h2_dot_ptx(bits, tile_sums): its output, the word, the pairs (and the packed sum)."""
    return tl.constexpr(("=r" if tile_sums else "=f") + ",r" * (1 + _h2_pairs(bits) + tile_sums))


_H2_DOT_INT4, _H2_DOT_INT8 = _h2_dot_ptx(4, False), _h2_dot_ptx(8, False)
_H2_SUM_INT4, _H2_SUM_INT8 = _h2_dot_ptx(4, True), _h2_dot_ptx(8, True)
_H2_DOT_ARGS4, _H2_DOT_ARGS8 = _h2_constraints(4, False), _h2_constraints(8, False)
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
# float32 once a tile. $0 $1 the sums out, $2 the word, $3..$6 the activation pairs (x0, x1) ... (x6, x7), $7 $8 the
# sums in, $9..$16 the halved table's byte words.
_H2_LUT_SUMS = tl.constexpr("""{
.reg .b32 sel, t, m, lo, lo2, hi, hi2, e01, e23, e45, e67, a, b;
""" + lut_lookup8_ptx("$2", 9) + """fma.rn.f16x2 a, e01, $3, $7;
fma.rn.f16x2 a, e23, $4, a;
fma.rn.f16x2 b, e45, $5, $8;
fma.rn.f16x2 b, e67, $6, b;
mov.b32 $0, a;
mov.b32 $1, b;
}""")
# D by bits: int4 lo halves 1024 + q -> (1024 + q)/16 - 64.5 = (q - 8)/16, hi halves 1024 + 16q ->
# (1024 + 16q)/256 - 4.5 = (q - 8)/16; int8 1024 + q -> (1024 + q)/256 - 4.5 = (q - 128)/256. Exact in fp16.
H2_DIVISOR = {4: 16.0, 8: 256.0}


@triton.jit
def _load_x(x_row, perm_ptr, k, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """Activations at input columns k (through the act-order permutation), in their own dtype."""
    kx = tl.load(perm_ptr + k, mask=k < K, other=0) if HAS_PERM else k
    if EVEN_K:
        x = tl.load(x_row + kx, eviction_policy="evict_last")
    else:
        x = tl.load(x_row + kx, mask=k < K, other=0.0, eviction_policy="evict_last")
    return x


@triton.jit
def _pair(a, b):
    """Two fp16 vectors as one int32 vector of (a | b << 16), the operand of a packed-half instruction."""
    return (a.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (b.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _load_x4(x_row, perm_ptr, k0, K, R: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):
    """The activations of a word's 4 consecutive codes (input columns k0, k0 + R, k0 + 2R, k0 + 3R)."""
    return (_load_x(x_row, perm_ptr, k0, K, HAS_PERM, EVEN_K),
            _load_x(x_row, perm_ptr, k0 + R, K, HAS_PERM, EVEN_K),
            _load_x(x_row, perm_ptr, k0 + 2 * R, K, HAS_PERM, EVEN_K),
            _load_x(x_row, perm_ptr, k0 + 3 * R, K, HAS_PERM, EVEN_K))


@triton.jit
def _h2_word_dots(p, acc, x_row, perm_ptr, k0, K, R: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                  EVEN_K: tl.constexpr, TILE_SUMS: tl.constexpr):
    """(sum_i x[k0 + i*R] * (code_i - C) / D over the codes of words p [RS, BLOCK_N], float32; with TILE_SUMS that
    sum added to the packed halves acc, in packed halves), and sum_i x (float32)."""
    x0, x1, x2, x3 = _load_x4(x_row, perm_ptr, k0, K, R, HAS_PERM, EVEN_K)
    if BITS == 4:
        x4, x5, x6, x7 = _load_x4(x_row, perm_ptr, k0 + 4 * R, K, R, HAS_PERM, EVEN_K)
        pairs = [p, _pair(x0, x4)[:, None], _pair(x1, x5)[:, None], _pair(x2, x6)[:, None], _pair(x3, x7)[:, None]]
        xs = (x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32)
              + x4.to(tl.float32) + x5.to(tl.float32) + x6.to(tl.float32) + x7.to(tl.float32))
    else:
        pairs = [p, _pair(x0, x2)[:, None], _pair(x1, x3)[:, None]]
        xs = x0.to(tl.float32) + x1.to(tl.float32) + x2.to(tl.float32) + x3.to(tl.float32)
    if TILE_SUMS:
        d = tl.inline_asm_elementwise(_H2_SUM_INT4 if BITS == 4 else _H2_SUM_INT8,
                                      _H2_SUM_ARGS4 if BITS == 4 else _H2_SUM_ARGS8, pairs + [acc], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        d = tl.inline_asm_elementwise(_H2_DOT_INT4 if BITS == 4 else _H2_DOT_INT8,
                                      _H2_DOT_ARGS4 if BITS == 4 else _H2_DOT_ARGS8, pairs, dtype=tl.float32,
                                      is_pure=True, pack=1)
    return d, xs


@triton.jit
def _h2_lanes(acc):
    """The two lanes of packed halves acc, summed as float32."""
    return tl.inline_asm_elementwise(_H2_LANES, "=f,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _h2_add(a, b):
    """Packed halves a + b (the combine of a packed-half row sum)."""
    return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], tl.int32, True, 1)


@triton.jit
def _h2_lut_word_sums(p, sum_lo, sum_hi, x_row, perm_ptr, k0, K, lut_ptr, R: tl.constexpr, HAS_PERM: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """Packed-half sums + x[k0 + i*R] * table[code_i] / 2 over the codes i < 4 (sum_lo), i >= 4 (sum_hi) of words p."""
    x0, x1, x2, x3 = _load_x4(x_row, perm_ptr, k0, K, R, HAS_PERM, EVEN_K)
    x4, x5, x6, x7 = _load_x4(x_row, perm_ptr, k0 + 4 * R, K, R, HAS_PERM, EVEN_K)
    lut = load_half_lut_words(lut_ptr)
    return tl.inline_asm_elementwise(
        _H2_LUT_SUMS, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [p, _pair(x0, x1)[:, None], _pair(x2, x3)[:, None], _pair(x4, x5)[:, None], _pair(x6, x7)[:, None],
         sum_lo, sum_hi, lut[0], lut[1], lut[2], lut[3], lut[4], lut[5], lut[6], lut[7]],
        dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _affine_gemv_kernel(
    # pointers
    x_ptr, w_ptr, sz_ptr, perm_ptr, lut_ptr, bias_ptr, y_ptr, ws_ptr, lock_ptr,
    pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,      # ROPE only
    lora_part_ptr, lora_b_ptr, lora_scale_ptr, lora_slot_ptr, LORA_J, LORA_PIECES, LORA_B1, LORA_B2,   # LORA only
    lora_stride_bs,
    # sizes
    N, K, GS, tiles_per_split, num_tiles, magic, Q_SIZE, KV_SIZE,
    # strides
    stride_xm, stride_ym,
    # meta
    BITS: tl.constexpr, R: tl.constexpr, RS: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ZB: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    TILE_SCALE: tl.constexpr, EVEN_K: tl.constexpr, MODE: tl.constexpr, H2: tl.constexpr = False,
    H2_SCALE: tl.constexpr = 16.0, TILE_SUMS: tl.constexpr = False, GLU: tl.constexpr = False,
    PDL: tl.constexpr = False, STAGES: tl.constexpr = 1,
    ROPE: tl.constexpr = False, HEAD_D: tl.constexpr = 128,
    FP8: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0, FP8_SHIFT: tl.constexpr = 0, FP8_REBIAS: tl.constexpr = 0,
    FP8_MIN_NORMAL: tl.constexpr = 0.0, FP8_MAGIC: tl.constexpr = 0.0, FP8_MAGIC_BITS: tl.constexpr = 0,
    LORA: tl.constexpr = False, LORA_P: tl.constexpr = 1, LORA_R: tl.constexpr = 16, LORA_PIECES_PAD: tl.constexpr = 1,
    LORA_CHUNK: tl.constexpr = RANK_CHUNK,
):
    """y[m, n] = sum_k x[m, k] * W[n, k]; program (row m, BLOCK_N columns, split of K tiles), a step of which
    covers RS word rows by BLOCK_N columns.

    At M = 1 a 4-bit weight must stream at copy bandwidth; on an H100 that leaves about four instructions per
    code for everything, and too few loads in flight leave the SMs waiting. So:
      - fp16 (H2, CUDA only): pairs of codes become pairs of halves and meet the activations in packed-half
        FMAs written in PTX (above): ~2 instructions per 4-bit code.
      - otherwise (bf16, the interpreter) three per code in fp32 (LOP3, FADD, FFMA): no shift and no int->float
        conversion: code i of a word is masked in place and OR-ed into the float 2**(23 - bits*j)
        (j = i mod PACK/2), whose unit in the last place is 2**-(bits*j), so the float is 2**(23 - bits*j) +
        code exactly; one FADD removes the magic (and the symmetric zero point).
      - scales leave the inner loop when a tile lies inside one group (group >= TILE_K, e.g. g128):
        sum_k x*(q*s + zb) = s * sum_k x*q + zb * sum_k x, applied once per tile per column (TILE_SCALE).

    Split-K without a zeroed output: the splits add float32 partials into the workspace row ws[m] and count
    themselves in lock[m, column block]; the last to arrive takes the sum (resetting ws to zero), writes y
    in its dtype and resets the count, so the workspace is clean for the next call and no memset runs.

    MODE as in layout.decode: AFFINE (magic numbers), LUT (a table gather per code), FP8_* (bit conversion).
    H2 (fp16 activations, CUDA only): packed-half dot products per word (above); AFFINE with TILE_SCALE, or LUT
    with 4-bit codes and a scale per half tile (each half's sums in packed halves, scaled once a tile in acc_n);
    TILE_SUMS (H2, AFFINE): a tile's products summed in packed halves, converted to float32 once a tile.
    GLU: W stacks [gate; up] (N = 2I) and y = silu(gate) * up [M, I]: a program's BLOCK_N columns are BLOCK_N/2 gate
    columns and the same up columns, multiplied in the epilogue (rounded as GEMV + activation.silu_and_mul round them).
    PDL: launched early; the first words are loaded before waiting for the kernel that wrote x.
    ROPE: W stacks [q; k; v] of one attention layer (Q_SIZE, KV_SIZE columns) and the epilogue finishes the
    rows as rotary.rotary_and_store would (rotary.rope_store_epilogue): y keeps only q, rotated; k and v go
    into the paged caches (the rotary launch of a decode layer saved).
    LORA: one more K split, whose K range is empty, adds the row's adapter products (lora_epilogue.lora_delta)
    through the workspace like any split, so an adapted layer keeps GLU and ROPE and the adapter's loads run beside
    the weight's stream rather than after it.
    STAGES > 1: the K-tile loop is software-pipelined (Triton copies the next tiles' words and scales into shared
    memory while this one is computed), so a program with several tiles keeps loads in flight.
    """
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = PACK // 2
    TILE_K: tl.constexpr = PACK * R
    MASK: tl.constexpr = (1 << BITS) - 1
    CENTRE: tl.constexpr = 1 << (BITS - 1)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pdl_launch_dependents(PDL)
    # --- which row, columns and K range
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n, mask_n = output_columns(pid_n, N, BLOCK_N, GLU)
    offs_r = tl.arange(0, RS)
    x_row = x_ptr + pid_m * stride_xm
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros((RS, BLOCK_N), dtype=tl.float32)          # scaled per code (the group changes in a tile)
    acc_n = tl.zeros((BLOCK_N,), dtype=tl.float32)           # scaled per tile (TILE_SCALE, H2 table codes)
    # --- main loop over tiles of TILE_K input columns, RS word rows at a time
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        kt = t * TILE_K
        part = tl.zeros((RS, BLOCK_N), dtype=tl.float32)
        xsum = tl.zeros((RS,), dtype=tl.float32)
        acc_h = tl.zeros((RS, BLOCK_N), dtype=tl.int32)       # packed-half sums (0 is +0, +0): TILE_SUMS, H2 table
        acc_h2 = tl.zeros((RS, BLOCK_N), dtype=tl.int32)      # codes (acc_h a tile's first half, this its second)
        if H2 and MODE == 1:                     # table codes: each half of a word one scale group
            s_lo, zb = load_scales(sz_ptr, kt // GS, offs_n, mask_n, N, ZERO, HAS_ZB, DT)
            s_hi, zb = load_scales(sz_ptr, (kt + HALF * R) // GS, offs_n, mask_n, N, ZERO, HAS_ZB, DT)
        for a in tl.static_range(R // RS):
            rows = t * R + a * RS + offs_r
            p = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0,
                        eviction_policy="evict_first")
            pdl_wait(PDL)                        # (returns at once after the first time)
            if H2 and MODE == 1:
                acc_h, acc_h2 = _h2_lut_word_sums(p, acc_h, acc_h2, x_row, perm_ptr, kt + a * RS + offs_r, K, lut_ptr,
                                                  R, HAS_PERM, EVEN_K)
            elif H2:
                d, xs = _h2_word_dots(p, acc_h, x_row, perm_ptr, kt + a * RS + offs_r, K, R, BITS, HAS_PERM, EVEN_K,
                                      TILE_SUMS)
                if TILE_SUMS:
                    acc_h = d
                else:
                    part += d
                xsum += xs
            else:
                p_hi = p.to(tl.uint32, bitcast=True) >> 16
                for i in tl.static_range(PACK):
                    k = kt + i * R + a * RS + offs_r
                    x = _load_x(x_row, perm_ptr, k, K, HAS_PERM, EVEN_K).to(tl.float32)
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
        if H2 and MODE == 1:                     # the halved table's sums, each half's rows in packed halves
            acc_n += _h2_lanes(tl.reduce(acc_h, 0, _h2_add)) * (s_lo.to(tl.float32) * 2.0)
            acc_n += _h2_lanes(tl.reduce(acc_h2, 0, _h2_add)) * (s_hi.to(tl.float32) * 2.0)
        if TILE_SCALE:
            s, zb = load_scales(sz_ptr, kt // GS, offs_n, mask_n, N, ZERO, HAS_ZB, DT)
            s = s.to(tl.float32)
            ps = tl.sum(_h2_lanes(acc_h) if H2 and TILE_SUMS else part, axis=0)
            if H2:                     # part = sum x (q - C) / D: w = (q - C) s + (C s + zbias)
                acc_n += ps * (s * H2_SCALE)
                if HAS_ZB:
                    acc_n += tl.sum(xsum, axis=0) * (zb.to(tl.float32) + CENTRE * s)
                elif ZERO != CENTRE:
                    acc_n += tl.sum(xsum, axis=0) * ((CENTRE - ZERO) * s)
            elif HAS_ZB:
                acc_n += ps * s + tl.sum(xsum, axis=0) * zb.to(tl.float32)
            else:
                acc_n += ps * s
    # --- epilogue: reduce the RS rows, add bias once, store or accumulate
    pdl_wait(PDL)
    y = tl.sum(acc, axis=0) + acc_n
    if LORA:
        if pid_k == SPLIT_K - 1:                  # the adapter's own program: its K range is empty
            y += lora_delta(lora_part_ptr, lora_b_ptr, lora_scale_ptr, lora_slot_ptr, pid_m, tl.num_programs(0),
                            LORA_J, LORA_PIECES, LORA_B1, LORA_B2, lora_stride_bs, offs_n, mask_n, LORA_P, LORA_R,
                            LORA_PIECES_PAD, LORA_CHUNK)
    store_output(y, bias_ptr, HAS_BIAS, y_ptr + pid_m * stride_ym, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                 mask_n, N, SPLIT_K, BLOCK_N, GLU, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                 v_scale_ptr, Q_SIZE, KV_SIZE, ROPE, HEAD_D, FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL,
                 FP8_MAGIC, FP8_MAGIC_BITS)


class GemvConfig(NamedTuple):
    """A GEMV launch: split-K aims at `waves` programs an SM with at least `min_tiles` K tiles each."""
    block_n: int            # output columns a program
    rows_a_step: int        # word rows a step of the inner loop (RS)
    warps: int
    waves: float
    min_tiles: int
    stages: int = 1         # K tiles in flight per program (software pipelining through shared memory)
    max_registers: int = 0  # ptxas's register cap a thread (0: its own choice); fewer registers, more programs an SM
    tile_sums: bool = False  # H2 affine codes: a tile's products summed in packed halves (TILE_SUMS)


# weight size N*K -> config, by code kind and whether PDL is on (swept on the H100 over the 8 Llama-3 shapes and
# the Llama-3.2 1B/3B ones). Without PDL the GEMV is latency-bound up to 70B qkv (84M weights) and wants many small
# programs (128 columns x 8 rows, 16 waves, one tile each); above, issue-bound, it wants fewer, wider ones.
GEMV_CONFIGS = ((200_000_000, GemvConfig(128, 8, 2, 16.0, 1)), (1 << 62, GemvConfig(256, 4, 2, 8.0, 2)))
# Under programmatic dependent launch (sm90) the next GEMV's programs start while this one drains, which hides the
# fixed cost that made the small shapes want many tiny programs: 256 x 4 at 8 waves from 40M weights, all 16 word
# rows of a tile a step over 256 columns up to 20M (Llama-3.2 1B/3B, 8B o), and 128 x 8 at 32 waves for the
# largest (70B gate_up). Between 20M and 40M (8B qkv, one rank's qkv of 70B at TP = 4) a program's serial chain
# (its loads, then the split-K count and sum) is the cost, not the issue rate: 256 x 4 with every K tile its own
# split, so that all programs' loads are in flight at once.
GEMV_CONFIGS_PDL = ((20_000_000, GemvConfig(256, 16, 2, 8.0, 1)), (40_000_000, GemvConfig(256, 4, 2, 64.0, 1)),
                    (300_000_000, GemvConfig(256, 4, 2, 8.0, 2)), (1 << 62, GemvConfig(128, 8, 2, 32.0, 1)))
# 8-bit codes (twice the bytes a weight) under PDL: 256 columns in 4 warps, 8 word rows a step; all 16 rows of a
# tile a step where the programs fit one resident wave (its 79 registers leave 6 programs an SM), which the
# shapes between those bands overflow; 70B gate_up keeps 128 x 8 at 32 waves. Packed-half tile sums where they
# are faster (8B o and down); the 70B shapes (60M-100M, 200M-300M) lose with them.
GEMV_CONFIGS_PDL_W8 = ((12_000_000, GemvConfig(256, 16, 4, 8.0, 1)),
                       (20_000_000, GemvConfig(256, 8, 4, 8.0, 1, tile_sums=True)),
                       (30_000_000, GemvConfig(256, 16, 4, 8.0, 1)),
                       (60_000_000, GemvConfig(256, 8, 4, 8.0, 1, tile_sums=True)),
                       (300_000_000, GemvConfig(256, 8, 4, 8.0, 1)),
                       (1 << 62, GemvConfig(128, 8, 2, 32.0, 1)))
# The SwiGLU epilogue's programs read a run of gate and a run of up columns (output_columns): on 7-8B models'
# stacked gate/up (GLU_BAND) 512 columns keep each run 1 KB a word row, which the call with the epilogue gains and
# the plain call loses, so only GLU calls under PDL take these (by code width; W8's in 8 warps with tile sums).
GLU_BAND = (100_000_000, 200_000_000)
GLU_CONFIGS_PDL = {4: GemvConfig(512, 4, 4, 8.0, 2), 8: GemvConfig(512, 8, 8, 16.0, 1, tile_sums=True)}
# 4-bit table codes (NF4 / FP4) on the byte-permute loop: its row sums want a step's rows in one thread, so every
# config has its warps side by side along N (128 columns a warp). Under PDL 512 x 4 above 20M weights, at 16 waves or,
# from 60M to 200M (8B gate_up, 70B qkv, o), 8 waves; without PDL (sm80, sm89) 256 x 8 at 16 waves for every size.
GEMV_CONFIGS_PDL_TABLE = ((20_000_000, GemvConfig(256, 8, 2, 8.0, 1)), (60_000_000, GemvConfig(512, 4, 4, 16.0, 1)),
                          (200_000_000, GemvConfig(512, 4, 4, 8.0, 2)), (1 << 62, GemvConfig(512, 4, 4, 16.0, 1)))
GEMV_CONFIGS_TABLE = ((1 << 62, GemvConfig(256, 8, 2, 16.0, 1)),)


def h2_applies(st: AffineState) -> bool:
    """Whether the packed-half (PTX) inner loop can run this weight: fp16 activations, and affine int4/int8
    codes with one scale per K tile, or 4-bit table codes with one scale per half tile (64 columns)."""
    if st.dtype != torch.float16:
        return False
    if st.mode == AFFINE:
        return st.tile_scale
    return st.table_lookup and st.group_size % (st.tile_k // 2) == 0


def use_h2(st: AffineState, caps: DeviceCaps) -> bool:
    """Whether the GEMV takes the packed-half loop by default: where it applies, on a CUDA device (the
    interpreter cannot run PTX). For table codes it replaces the fp32 loop's gather of the table per code."""
    return caps.is_cuda and h2_applies(st)


def default_config(st: AffineState, caps: DeviceCaps, m: int = 1) -> GemvConfig:
    """The launch config of the weight on a device of these caps: the tables above, by weight count (any M)."""
    if st.mode == LUT and use_h2(st, caps):
        table = GEMV_CONFIGS_PDL_TABLE if caps.pdl else GEMV_CONFIGS_TABLE
    else:
        table = (GEMV_CONFIGS_PDL_W8 if st.bits == 8 else GEMV_CONFIGS_PDL) if caps.pdl else GEMV_CONFIGS
    return next(c for top, c in table if st.n * st.k <= top)


def glu_config(st: AffineState, caps: DeviceCaps, config: GemvConfig) -> GemvConfig:
    """The config of a call with the SwiGLU epilogue: GLU_CONFIGS_PDL's for affine codes on the packed-half loop
    under PDL within GLU_BAND, else `config` (the plan's)."""
    lo, hi = GLU_BAND
    if caps.pdl and st.mode != LUT and use_h2(st, caps) and st.bits in GLU_CONFIGS_PDL and lo < st.n * st.k <= hi:
        return GLU_CONFIGS_PDL[st.bits]
    return config


def rope_applies(st: AffineState, rope: RopeStore, config: GemvConfig) -> bool:
    """Whether the epilogue can finish W = [q; k; v] under `config` (rope_fits)."""
    return rope_fits(st.n, rope, config.block_n)


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, h2: bool | None = None, glu: bool = False,
           rope: RopeStore | None = None, lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias), one program row per activation row (M small). `glu`: W stacks
    [gate; up] and y[M, N/2] = silu(gate) * up, made in the epilogue (the MLP's gate_up without a second
    kernel). `rope`: W stacks an attention layer's [q; k; v], and the epilogue rotates q and k and stores k and v
    in the paged caches (rope_applies must hold); y's q columns hold the rotated q, its k and v columns nothing.
    `lora`: each row's adapter products (quanta.lora.kernels.shrink_rows of these rows) are added before all that.

    `config` (GemvConfig's fields) and `h2` override the defaults (tests, benchmark sweeps); `caps` defaults to
    the device's.
    """
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    caps = caps or device_caps(x2.device)
    config = GemvConfig(*(config or default_config(st, caps)))
    bn, rs, warps, waves, min_tiles, stages, max_registers, tile_sums = config
    assert rope is None or (not glu and rope_applies(st, rope, config))
    assert bn % LOCK_COLUMNS == 0
    h2 = use_h2(st, caps) if h2 is None else h2
    assert not h2 or h2_applies(st), "the packed-half loop needs fp16, and affine codes with a scale per K tile " \
        "or 4-bit table codes with a scale per half tile"
    table_h2 = h2 and st.mode == LUT
    assert not glu or st.n % 2 == 0
    column_blocks = cdiv(st.n // 2, bn // 2) if glu else cdiv(st.n, bn)
    splits, per = split_k(m * column_blocks, st.num_tiles, caps.sm_count, waves, min_tiles)
    y = torch.empty(m, st.n // 2 if glu else st.n, device=x2.device, dtype=st.dtype)
    ws, locks = workspace(x2.device, st.n, m)
    lora_split = int(lora is not None)
    _affine_gemv_kernel[(m, column_blocks, splits + lora_split)](
        x2, st.packed, st.sz, st.perm if st.perm is not None else st.packed,
        st.lut_arg(table_h2), bias if bias is not None else x2,
        y, ws, locks, *(rope.kernel_args() if rope is not None else (x2,) * 7),
        *(lora.kernel_args() if lora is not None else no_lora_args(x2)),
        st.n, st.k, st.group_size, per, st.num_tiles, 0x4B000000, *((rope.q_size, rope.kv_size) if rope else (0, 0)),
        x2.stride(0), y.stride(0), BITS=st.bits, R=R, RS=rs, ZERO=st.zero, BLOCK_N=bn, HAS_ZB=st.has_zb,
        HAS_PERM=st.perm is not None, HAS_BIAS=bias is not None, SPLIT_K=splits + lora_split,
        TILE_SCALE=st.tile_scale and not table_h2, EVEN_K=st.k == st.k_pad, MODE=st.mode, H2=h2,
        H2_SCALE=H2_DIVISOR[st.bits] if h2 else 16.0, TILE_SUMS=tile_sums and h2 and not table_h2, GLU=glu,
        STAGES=stages, ROPE=rope is not None,
        HEAD_D=rope.head_dim if rope is not None else 128, **fp8_write_constexprs(rope.fmt if rope else None),
        **(lora.constexprs() if lora is not None else {}),
        num_warps=warps,
        **({"maxnreg": max_registers} if max_registers else {}), **pdl_launch(caps))
    return y
