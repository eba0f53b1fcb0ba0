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
    gemv_launch,
    output_columns,
    rope_fits,
    store_output,
    workspace,
)
from quanta.kernels.affine.gemv_words import H2_DIVISOR, h2_add, lane, lanes, load_x, lut_word_sums, word_dots
from quanta.kernels.affine.layout import AFFINE, LUT, AffineState, R, load_scales, load_tile_table_scales
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.fp8_bits import fp8_to_f16
from quanta.kernels.lora_epilogue import RANK_CHUNK, LoRAEpilogue, lora_delta, no_lora_args
from quanta.kernels.paged_kv import fp8_write_constexprs
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import (
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    tl,
    triton,
)


@triton.jit
def _add_group(acc_n, ps, xs, sz_ptr, g, offs_n, mask_n, N, ZERO: tl.constexpr, HAS_ZB: tl.constexpr,
               DT: tl.constexpr, H2_SCALE: tl.constexpr, CENTRE: tl.constexpr):
    """acc_n + scale group g's share of a tile under the packed-half loop: ps [BLOCK_N] = sum x (q - C) / D over
    the group's codes, xs = sum x over its columns; w = (q - C) s + (C s + zbias)."""
    s, zb = load_scales(sz_ptr, g, offs_n, mask_n, N, ZERO, HAS_ZB, DT)
    s = s.to(tl.float32)
    acc_n += ps * (s * H2_SCALE)
    if HAS_ZB:
        acc_n += tl.sum(xs, axis=0) * (zb.to(tl.float32) + CENTRE * s)
    elif ZERO != CENTRE:
        acc_n += tl.sum(xs, axis=0) * ((CENTRE - ZERO) * s)
    return acc_n


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
    H2_SCALE: tl.constexpr = 16.0, TILE_SUMS: tl.constexpr = False, GROUPS: tl.constexpr = 1,
    GLU: tl.constexpr = False,
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
    H2 (fp16 activations, CUDA only): packed-half dot products per word (gemv_words.py); GROUPS scale groups a K
    tile (AFFINE: 1 with TILE_SCALE, else 2, or 4 for 4-bit codes; LUT: 2, or 4 for groups of 32): each group's
    products in packed-half sums of their own (lanes of one sum for affine codes), scaled once a tile in acc_n.
    TILE_SUMS (H2, AFFINE): a tile's products summed in packed halves, converted to float32 once a tile (always
    where GROUPS > 1).
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
    LUT_GROUPS: tl.constexpr = 4 if GROUPS == 4 else 2      # a table loop's packed sums a tile
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
        xsum = tl.zeros((RS,), dtype=tl.float32)              # by scale group (GROUPS > 1)
        xsum1 = tl.zeros((RS,), dtype=tl.float32)
        xsum2 = tl.zeros((RS,), dtype=tl.float32)
        xsum3 = tl.zeros((RS,), dtype=tl.float32)
        acc_h = tl.zeros((RS, BLOCK_N), dtype=tl.int32)       # packed-half sums (0 is +0, +0), by lanes of groups
        acc_h1 = tl.zeros((RS, BLOCK_N), dtype=tl.int32)
        acc_h2 = tl.zeros((RS, BLOCK_N), dtype=tl.int32)
        acc_h3 = tl.zeros((RS, BLOCK_N), dtype=tl.int32)
        if H2 and MODE == 1:                     # table codes: a scale group a packed sum (LUT_GROUPS 2 or 4)
            s_0, s_1, s_2, s_3 = load_tile_table_scales(sz_ptr, t, GS, offs_n, mask_n, N, ZERO, LUT_GROUPS, TILE_K, DT)
        for a in tl.static_range(R // RS):
            rows = t * R + a * RS + offs_r
            p = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0,
                        eviction_policy="evict_first")
            pdl_wait(PDL)                        # (returns at once after the first time)
            if H2 and MODE == 1:
                acc_h, acc_h1, acc_h2, acc_h3 = lut_word_sums(p, acc_h, acc_h1, acc_h2, acc_h3, x_row, perm_ptr,
                                                              kt + a * RS + offs_r, K, lut_ptr, R, HAS_PERM, EVEN_K,
                                                              LUT_GROUPS)
            elif H2:
                d, acc_h1, xs, xs1, xs2, xs3 = word_dots(p, acc_h, acc_h1, x_row, perm_ptr, kt + a * RS + offs_r, K,
                                                         R, BITS, HAS_PERM, EVEN_K, TILE_SUMS, GROUPS)
                if TILE_SUMS:
                    acc_h = d
                else:
                    part += d
                xsum += xs
                if GROUPS > 1:
                    xsum1 += xs1
                if GROUPS > 2:
                    xsum2 += xs2
                    xsum3 += xs3
            else:
                p_hi = p.to(tl.uint32, bitcast=True) >> 16
                for i in tl.static_range(PACK):
                    k = kt + i * R + a * RS + offs_r
                    x = load_x(x_row, perm_ptr, k, K, HAS_PERM, EVEN_K).to(tl.float32)
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
        g0 = kt // GS
        if H2 and MODE == 1:                     # the halved table's sums, each group's rows in packed halves
            acc_n += lanes(tl.reduce(acc_h, 0, h2_add)) * (s_0.to(tl.float32) * 2.0)
            acc_n += lanes(tl.reduce(acc_h1, 0, h2_add)) * (s_1.to(tl.float32) * 2.0)
            if LUT_GROUPS == 4:
                acc_n += lanes(tl.reduce(acc_h2, 0, h2_add)) * (s_2.to(tl.float32) * 2.0)
                acc_n += lanes(tl.reduce(acc_h3, 0, h2_add)) * (s_3.to(tl.float32) * 2.0)
        elif H2 and GROUPS == 2:                 # lanes: groups 0, 1
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h, False), axis=0), xsum, sz_ptr, g0, offs_n, mask_n, N, ZERO,
                               HAS_ZB, DT, H2_SCALE, CENTRE)
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h, True), axis=0), xsum1, sz_ptr, g0 + 1, offs_n, mask_n, N,
                               ZERO, HAS_ZB, DT, H2_SCALE, CENTRE)
        elif H2 and GROUPS == 4:                 # acc_h's lanes: groups 0, 2; acc_h1's: 1, 3
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h, False), axis=0), xsum, sz_ptr, g0, offs_n, mask_n, N, ZERO,
                               HAS_ZB, DT, H2_SCALE, CENTRE)
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h1, False), axis=0), xsum1, sz_ptr, g0 + 1, offs_n, mask_n, N,
                               ZERO, HAS_ZB, DT, H2_SCALE, CENTRE)
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h, True), axis=0), xsum2, sz_ptr, g0 + 2, offs_n, mask_n, N,
                               ZERO, HAS_ZB, DT, H2_SCALE, CENTRE)
            acc_n = _add_group(acc_n, tl.sum(lane(acc_h1, True), axis=0), xsum3, sz_ptr, g0 + 3, offs_n, mask_n, N,
                               ZERO, HAS_ZB, DT, H2_SCALE, CENTRE)
        elif TILE_SCALE:
            if H2:                               # part = sum x (q - C) / D: w = (q - C) s + (C s + zbias)
                ps = tl.sum(lanes(acc_h) if TILE_SUMS else part, axis=0)
                acc_n = _add_group(acc_n, ps, xsum, sz_ptr, g0, offs_n, mask_n, N, ZERO, HAS_ZB, DT, H2_SCALE, CENTRE)
            else:
                s, zb = load_scales(sz_ptr, g0, offs_n, mask_n, N, ZERO, HAS_ZB, DT)
                s = s.to(tl.float32)
                if HAS_ZB:
                    acc_n += tl.sum(part, axis=0) * s + tl.sum(xsum, axis=0) * zb.to(tl.float32)
                else:
                    acc_n += tl.sum(part, axis=0) * s
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
# Table codes in groups of 32 (IQ4_NL, IQ4_XS: four packed sums a word) under PDL: 256 x 8 in 2 warps at 16 waves on
# 70B qkv, 8B gate_up and 70B down, 512 x 8 in 4 warps at 16 waves on the smallest and the largest (8B o and qkv,
# 70B gate_up); 8B down and 70B o keep the table above's.
GEMV_CONFIGS_PDL_TABLE32 = ((30_000_000, GemvConfig(512, 8, 4, 16.0, 1)), (60_000_000, GemvConfig(512, 4, 4, 16.0, 1)),
                            (80_000_000, GemvConfig(512, 4, 4, 8.0, 2)), (300_000_000, GemvConfig(256, 8, 2, 16.0, 1)),
                            (1 << 62, GemvConfig(512, 8, 4, 16.0, 1)))


def h2_applies(st: AffineState) -> bool:
    """Whether the packed-half (PTX) inner loop can run this weight: fp16 activations, and affine int4/int8
    codes with one scale per K tile, or per half tile, or (4-bit) per quarter tile (groups of 32), centred in their
    fields (AffineState.off_centre), or 4-bit table codes with one scale per half or quarter tile."""
    if st.dtype != torch.float16 or st.off_centre:
        return False
    if st.mode == AFFINE:
        return st.tile_scale or tile_groups(st) in ((2, 4) if st.bits == 4 else (2,))
    return st.table_lookup and tile_groups(st) in (1, 2, 4)


def tile_groups(st: AffineState) -> int:
    """Scale groups a K tile: 1 where a tile lies inside one group, else tile_k / group (0: groups that do not
    divide a tile)."""
    if st.tile_scale:
        return 1
    return st.tile_k // st.group_size if st.tile_k % st.group_size == 0 else 0


def use_h2(st: AffineState, caps: DeviceCaps) -> bool:
    """Whether the GEMV takes the packed-half loop by default: where it applies, on a CUDA device (the
    interpreter cannot run PTX). For table codes it replaces the fp32 loop's gather of the table per code."""
    return caps.is_cuda and h2_applies(st)


def default_config(st: AffineState, caps: DeviceCaps, m: int = 1) -> GemvConfig:
    """The launch config of the weight on a device of these caps: the tables above, by weight count (any M)."""
    if st.mode == LUT and use_h2(st, caps):
        table = GEMV_CONFIGS_TABLE if not caps.pdl else \
            GEMV_CONFIGS_PDL_TABLE32 if tile_groups(st) == 4 else GEMV_CONFIGS_PDL_TABLE
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
    assert not h2 or h2_applies(st), "the packed-half loop needs fp16, and affine codes with a scale per K, half " \
        "or (4-bit) quarter tile, or 4-bit table codes with a scale per half or quarter tile"
    table_h2 = h2 and st.mode == LUT
    groups = tile_groups(st) if h2 else 1
    assert not glu or st.n % 2 == 0
    column_blocks, splits, per, y, ws, locks = gemv_launch(x2, st.n, st.num_tiles, bn, waves, min_tiles, glu, st.dtype,
                                                           caps)
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
        H2_SCALE=H2_DIVISOR[st.bits] if h2 else 16.0, TILE_SUMS=(tile_sums or groups > 1) and h2 and not table_h2,
        GROUPS=groups, GLU=glu,
        STAGES=stages, ROPE=rope is not None,
        HEAD_D=rope.head_dim if rope is not None else 128, **fp8_write_constexprs(rope.fmt if rope else None),
        **(lora.constexprs() if lora is not None else {}),
        num_warps=warps,
        **({"maxnreg": max_registers} if max_registers else {}), **pdl_launch(caps))
    return y
