"""The K-quants' GEMV over column-major words: a thread owns output columns and walks K, as the affine GEMV does,
every type's codes meeting the activations in packed halves.

Word w of super-block t of every row lies in row t * words + w of a [words, N] plane (the file's bytes, transposed
at load: layout.GgmlLayout.columns), so a warp's load of one word row is contiguous over its columns, a thread
holds the same words of neighbouring columns, and one set of activation pairs serves them all. The words meet their
activations in gemv_h2's PTX (_q4k_dots ... _q23k_dot); scales and mins apply in float32, mins against x's sum per
sub-block. The affine GEMV's ends (gemv_out): split-K sums through its workspace (no zeroed output, no memset), the
SwiGLU and rotary + KV-store epilogues.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.gemv_out import gemv_launch, output_columns, rope_fits, store_output
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.decode import _half, q3k_scale
from quanta.kernels.ggml.gemv_h2 import (_q4k_dots, _q5k_dots, _q6k_dots, _q6k_pairs, _q23k_dot, _small_float,
                                         _u8_float, _x_pairs4)
from quanta.kernels.ggml.layout import GgmlState, plane_args
from quanta.kernels.paged_kv import fp8_write_constexprs
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

TYPES = ("q2_K", "q3_K", "q4_K", "q5_K", "q6_K")


@triton.jit
def _ggml_cols_kernel(x_ptr, p0, p1, p2, p3, bias_ptr, y_ptr, ws_ptr, lock_ptr,
                      pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,   # ROPE only
                      N, tiles_per_split, num_tiles, Q_SIZE, KV_SIZE, stride_xm, stride_ym,
                      b0, b1, b2, b3, N_A,                                                        # TWO only
                      Q5: tl.constexpr, Q6: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT_K: tl.constexpr, PTX: tl.constexpr, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False,
                      CHUNKS: tl.constexpr = 1, PARTS: tl.constexpr = 1,
                      GLU: tl.constexpr = False, ROPE: tl.constexpr = False, HEAD_D: tl.constexpr = 128,
                      FP8: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0, FP8_SHIFT: tl.constexpr = 0,
                      FP8_REBIAS: tl.constexpr = 0, FP8_MIN_NORMAL: tl.constexpr = 0.0,
                      FP8_MAGIC: tl.constexpr = 0.0, FP8_MAGIC_BITS: tl.constexpr = 0, Q2: tl.constexpr = False,
                      Q3: tl.constexpr = False, TWO: tl.constexpr = False, Q2B: tl.constexpr = False,
                      Q3B: tl.constexpr = False, Q5B: tl.constexpr = False, Q6B: tl.constexpr = False):
    """y[m, n] = sum_k x[m, k] W[n, k]; program (row m, BLOCK_N columns, split of K), a split whole parts of the
    super-blocks, PARTS a super-block (tiles_per_split, num_tiles count parts); the planes p0..p3
    as _q45k_sums (Q4_K, Q5_K), _q6k_sums (Q6), _q2k_sums (Q2) or _q3k_sums (Q3) take them. TWO: W stacks two
    weights of different types, the first's N_A rows (a multiple of BLOCK_N) over planes p0..p3 and types Q2 .. Q6,
    the rest over b0..b3 and Q2B .. Q6B (a program's columns lie in one of them). GLU and ROPE: the affine GEMV's
    epilogues (gemv_out)."""
    pdl_launch_dependents(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = output_columns(pid_n, N, BLOCK_N, GLU)
    x_row = x_ptr + pid_m * stride_xm
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    if TWO:
        if pid_n * BLOCK_N < N_A:
            y = _sums(x_row, p0, p1, p2, p3, offs_n[None, :], mask_n[None, :], N_A, t_begin, t_end, BLOCK_N, Q2, Q3,
                      Q5, Q6, PTX, STAGES, PDL, CHUNKS, PARTS)
        else:
            y = _sums(x_row, b0, b1, b2, b3, offs_n[None, :] - N_A, mask_n[None, :], N - N_A, t_begin, t_end, BLOCK_N,
                      Q2B, Q3B, Q5B, Q6B, PTX, STAGES, PDL, CHUNKS, PARTS)
    else:
        y = _sums(x_row, p0, p1, p2, p3, offs_n[None, :], mask_n[None, :], N, t_begin, t_end, BLOCK_N, Q2, Q3, Q5, Q6,
                  PTX, STAGES, PDL, CHUNKS, PARTS)
    pdl_wait(PDL)
    store_output(y, bias_ptr, HAS_BIAS, y_ptr + pid_m * stride_ym, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                 mask_n, N, SPLIT_K, BLOCK_N, GLU, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                 v_scale_ptr, Q_SIZE, KV_SIZE, ROPE, HEAD_D, FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL,
                 FP8_MAGIC, FP8_MAGIC_BITS)


@triton.jit
def _sums(x_row, p0, p1, p2, p3, cols, m2, N, t_begin, t_end, BLOCK_N: tl.constexpr, Q2: tl.constexpr,
          Q3: tl.constexpr, Q5: tl.constexpr, Q6: tl.constexpr, PTX: tl.constexpr, STAGES: tl.constexpr,
          PDL: tl.constexpr, CHUNKS: tl.constexpr, PARTS: tl.constexpr):
    """The sums [BLOCK_N] of columns cols [1, BLOCK_N] of a weight of N columns over planes p0..p3, by its type,
    over parts t_begin..t_end (PARTS a super-block: the packed-half types' K loop steps, 64-value chunks or Q6_K's
    128-value halves, 4 // PARTS or 2 // PARTS a part; Q2_K, Q3_K whole super-blocks); CHUNKS: steps an iteration,
    at most a part's."""
    if Q2:
        y = _q2k_sums(x_row, p0, p1, p2, cols, m2, N, t_begin, t_end, BLOCK_N, PTX, STAGES, PDL, CHUNKS)
    elif Q3:
        y = _q3k_sums(x_row, p0, p1, p2, p3, cols, m2, N, t_begin, t_end, BLOCK_N, PTX, STAGES, PDL, CHUNKS)
    elif Q6:
        y = _q6k_sums(x_row, p0, p1, p2, p3, cols, m2, N, t_begin * (2 // PARTS), t_end * (2 // PARTS), BLOCK_N,
                      PTX, STAGES, PDL, min(CHUNKS, 2 // PARTS))
    elif Q5:
        y = _q45k_sums(x_row, p0, p1, p2, p3, cols, m2, N, t_begin * (4 // PARTS), t_end * (4 // PARTS), BLOCK_N,
                       True, PTX, STAGES, PDL, min(CHUNKS, 4 // PARTS))
    else:
        y = _q45k_sums(x_row, p0, p1, p2, p2, cols, m2, N, t_begin * (4 // PARTS), t_end * (4 // PARTS), BLOCK_N,
                       False, PTX, STAGES, PDL, min(CHUNKS, 4 // PARTS))
    return y


@triton.jit
def _q45k_sums(x_row, dm_ptr, sc_ptr, qh_ptr, qs_ptr, cols, m2, N, c_begin, c_end, BLOCK_N: tl.constexpr,
               Q5: tl.constexpr, PTX: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, CHUNKS: tl.constexpr):
    """Q4_K's (Q5_K's) sums [BLOCK_N] over 64-value chunks c_begin..c_end of columns cols [1, BLOCK_N]. Planes, a row
    per word of a super-block over N columns: dm [blocks, N] (d | dmin << 16), sc [blocks * 4, N] (word j: scale 2j,
    min 2j, scale 2j + 1, min 2j + 1), [qh [blocks * 8, N]: word i the fifth bits of word i of every chunk], qs
    [blocks * 32, N] (word 8j + 4g + c: values 16g + 4c .. + 3 of sub-blocks 2j and 2j + 1, low and high nibbles)."""
    g = tl.arange(0, 2)[:, None]                             # the word group: words 4g .. 4g + 3 of a chunk
    x_g = x_row + 16 * g
    acc_q = tl.zeros((2, BLOCK_N), dtype=tl.float32)        # sum of d * sc * dot
    acc_m = tl.zeros((2, BLOCK_N), dtype=tl.float32)        # sum of dmin * m * sum(x)
    # CHUNKS 64-value chunks c (chunk j = c % 4 of super-block t = c // 4) an iteration: more chunks put more bytes
    # in flight for each program, for the registers that let fewer programs share an SM
    for c0 in tl.range(c_begin, c_end, CHUNKS, num_stages=STAGES):
        t = c0 // 4                 # CHUNKS divides 4: an iteration's chunks share super-block t, its dm and qh
        dm = tl.load(dm_ptr + t * N + cols, mask=m2, other=0)
        if Q5:
            h0, h1, h2, h3 = _words4(qh_ptr + (t * 8 + 4 * g) * N + cols, m2, N)
        for i in tl.static_range(CHUNKS):
            c = c0 + i
            sc = tl.load(sc_ptr + c * N + cols, mask=m2, other=0)
            w0, w1, w2, w3 = _words4(qs_ptr + (c * 8 + 4 * g) * N + cols, m2, N)
            pdl_wait(PDL)                                        # (returns at once after the first time)
            x_t = x_g + c * 64
            a0, a1, a2, a3, xs_a = _x_pairs4(x_t, PTX)
            b0, b1, b2, b3, xs_b = _x_pairs4(x_t + 32, PTX)
            x0, x1 = (a0[0], a0[1], b0[0], b0[1]), (a1[0], a1[1], b1[0], b1[1])
            x2, x3 = (a2[0], a2[1], b2[0], b2[1]), (a3[0], a3[1], b3[0], b3[1])
            if Q5:          # chunk j's fifth bits: qh rotated left by 4 - 2j (_q5k_dots)
                rot = tl.zeros((1, 1), tl.int32) + ((4 - 2 * (c % 4)) & 31)
                dot_a, dot_b = _q5k_dots(w0, w1, w2, w3, h0, h1, h2, h3, rot, x0, x1, x2, x3, PTX)
            else:
                dot_a, dot_b = _q4k_dots(w0, w1, w2, w3, x0, x1, x2, x3, PTX)
            acc_q += _half(dm) * (dot_a * _u8_float(sc, 0) + dot_b * _u8_float(sc, 16))
            acc_m += _half(dm >> 16) * (xs_a * _u8_float(sc, 8) + xs_b * _u8_float(sc, 24))
    return tl.sum(acc_q * 16.0 - acc_m, axis=0)


@triton.jit
def _q6k_sums(x_row, ql_ptr, qh_ptr, sc_ptr, d_ptr, cols, m2, N, c_begin, c_end, BLOCK_N: tl.constexpr,
              PTX: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, CHUNKS: tl.constexpr):
    """Q6_K's sums [BLOCK_N] over 128-value halves c_begin..c_end, as _q45k_sums. Planes: ql [blocks * 32, N], qh
    [blocks * 16, N] (per half h, ql words 16h + i and 16h + 8 + i and qh word 8h + i hold values 4i .. 4i + 3 of its
    four 32-value quarters), sc [blocks * 4, N] (the 16 int8 scales, four a word), d [blocks, N] fp16. Word column
    i = 2u + c of a half."""
    u = tl.arange(0, 4)[:, None]                             # word columns 2u, 2u + 1: values 8u .. 8u + 7
    x_u = x_row + 8 * u
    shift = (u // 2) * 8                                     # quarter q's scale: byte 2 (q % 2) + u // 2 of word q // 2
    acc = tl.zeros((4, BLOCK_N), dtype=tl.float32)
    # CHUNKS 128-value halves h = c % 2 of super-block t = c // 2 an iteration (as _q45k_sums' chunks)
    for c0 in tl.range(c_begin, c_end, CHUNKS, num_stages=STAGES):
        d = tl.load(d_ptr + (c0 // 2) * N + cols, mask=m2, other=0.0).to(tl.float32)    # (CHUNKS divides 2)
        for i in tl.static_range(CHUNKS):
            c = c0 + i
            ql = ql_ptr + (c * 16 + 2 * u) * N + cols
            qh = qh_ptr + (c * 8 + 2 * u) * N + cols
            ql0_0 = tl.load(ql, mask=m2, other=0, eviction_policy="evict_first")
            ql0_1 = tl.load(ql + N, mask=m2, other=0, eviction_policy="evict_first")
            ql1_0 = tl.load(ql + 8 * N, mask=m2, other=0, eviction_policy="evict_first")
            ql1_1 = tl.load(ql + 9 * N, mask=m2, other=0, eviction_policy="evict_first")
            qh_0 = tl.load(qh, mask=m2, other=0, eviction_policy="evict_first")
            qh_1 = tl.load(qh + N, mask=m2, other=0, eviction_policy="evict_first")
            sc_lo = tl.load(sc_ptr + (c * 2) * N + cols, mask=m2, other=0)
            sc_hi = tl.load(sc_ptr + (c * 2 + 1) * N + cols, mask=m2, other=0)
            pdl_wait(PDL)
            x_t = x_u + c * 128
            d0, d1, d2, d3 = _q6k_dots(ql0_0, ql1_0, qh_0, ql0_1, ql1_1, qh_1, _q6k_pairs(x_t, PTX),
                                       _q6k_pairs(x_t + 4, PTX), PTX)
            acc += d * (d0 * _i8(sc_lo, shift) + d1 * _i8(sc_lo, shift + 16) + d2 * _i8(sc_hi, shift)
                        + d3 * _i8(sc_hi, shift + 16))
    return tl.sum(acc, axis=0) * 16.0


@triton.jit
def _nibble_float(word, shift):
    """Bits shift .. shift + 3 of int32 `word` as float32."""
    return _small_float((word >> shift) & 0xF)


@triton.jit
def _q2k_sums(x_row, sc_ptr, qs_ptr, dm_ptr, cols, m2, N, t_begin, t_end, BLOCK_N: tl.constexpr, PTX: tl.constexpr,
              STAGES: tl.constexpr, PDL: tl.constexpr, CHUNKS: tl.constexpr):
    """Q2_K's sums [BLOCK_N], as _q45k_sums. Planes: sc [blocks * 4, N] (byte s: scale | min << 4 of 16-value
    sub-block s), qs [blocks * 16, N] (word 8h + i: bytes 4i .. 4i + 3 of 128-value half h, bits 2j of byte l the
    value 128h + 32j + l, in sub-block 8h + 2j + l // 16), dm [blocks, N] (d | dmin << 16). Words 8h + 4v .. + 3
    hold sub-blocks 8h + 2j + v, j = 0..3: one run of _q23k_dot each. CHUNKS >= 2: all of a super-block's words
    loaded before its sums (on a program's first, before the PDL wait: they do not depend on the kernel before)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        dm = tl.load(dm_ptr + t * N + cols, mask=m2, other=0)
        part_q = tl.zeros(cols.shape, dtype=tl.float32)     # sum of sc * dot(q, x)
        part_m = tl.zeros(cols.shape, dtype=tl.float32)     # sum of m * sum(x)
        if CHUNKS >= 2:
            lo0, hi0, run00, run01 = _q2k_half_words(sc_ptr, qs_ptr, t, 0, cols, m2, N)
            lo1, hi1, run10, run11 = _q2k_half_words(sc_ptr, qs_ptr, t, 1, cols, m2, N)
            pdl_wait(PDL)                                    # (returns at once after the first time)
            part_q, part_m = _q2k_run(x_row, t, 0, 0, run00, lo0, hi0, part_q, part_m, PTX)
            part_q, part_m = _q2k_run(x_row, t, 0, 1, run01, lo0, hi0, part_q, part_m, PTX)
            part_q, part_m = _q2k_run(x_row, t, 1, 0, run10, lo1, hi1, part_q, part_m, PTX)
            part_q, part_m = _q2k_run(x_row, t, 1, 1, run11, lo1, hi1, part_q, part_m, PTX)
        else:
            pdl_wait(PDL)
            for h in tl.static_range(2):
                lo = tl.load(sc_ptr + (t * 4 + 2 * h) * N + cols, mask=m2, other=0)       # sub-blocks 8h .. 8h + 3
                hi = tl.load(sc_ptr + (t * 4 + 2 * h + 1) * N + cols, mask=m2, other=0)   # 8h + 4 .. 8h + 7
                for v in tl.range(0, 2):
                    run = _words4(qs_ptr + (t * 16 + 8 * h + 4 * v) * N + cols, m2, N)
                    part_q, part_m = _q2k_run(x_row, t, h, v, run, lo, hi, part_q, part_m, PTX)
        acc += _half(dm) * part_q - _half(dm >> 16) * part_m
    return tl.reshape(acc, (BLOCK_N,))


@triton.jit
def _q2k_half_words(sc_ptr, qs_ptr, t, h: tl.constexpr, cols, m2, N):
    """Half h of Q2_K super-block t: its scale words (sub-blocks 8h .. 8h + 3, 8h + 4 .. 8h + 7) and its runs of
    four qs words v = 0, 1."""
    lo = tl.load(sc_ptr + (t * 4 + 2 * h) * N + cols, mask=m2, other=0)
    hi = tl.load(sc_ptr + (t * 4 + 2 * h + 1) * N + cols, mask=m2, other=0)
    run0 = _words4(qs_ptr + (t * 16 + 8 * h) * N + cols, m2, N)
    run1 = _words4(qs_ptr + (t * 16 + 8 * h + 4) * N + cols, m2, N)
    return lo, hi, run0, run1


@triton.jit
def _q2k_run(x_row, t, h: tl.constexpr, v, run, lo, hi, part_q, part_m, PTX: tl.constexpr):
    """part_q, part_m plus Q2_K super-block t's sub-blocks 8h + 2j + v, j = 0..3, from their run of four qs words
    and the half's scale words lo, hi: the sums of sc * dot(q, x) and of m * sum(x)."""
    w0, w1, w2, w3 = run
    for j in tl.static_range(4):
        x0, x1, x2, x3, xs = _x_pairs4(x_row + t * 256 + 128 * h + 32 * j + 16 * v, PTX)
        dot = _q23k_dot(w0, w1, w2, w3, w0, w1, w2, w3, x0, x1, x2, x3, j, h, False, PTX)
        at = 8 * (2 * (j % 2) + v)
        sc = lo if j < 2 else hi
        part_q += dot * _nibble_float(sc, at)
        part_m += xs * _nibble_float(sc, at + 4)
    return part_q, part_m


@triton.jit
def _words4(at, m2, N):
    """Four word rows at, at + N, at + 2N, at + 3N of a plane (streamed once: evict first)."""
    w0 = tl.load(at, mask=m2, other=0, eviction_policy="evict_first")
    w1 = tl.load(at + N, mask=m2, other=0, eviction_policy="evict_first")
    w2 = tl.load(at + 2 * N, mask=m2, other=0, eviction_policy="evict_first")
    w3 = tl.load(at + 3 * N, mask=m2, other=0, eviction_policy="evict_first")
    return w0, w1, w2, w3


@triton.jit
def _q3k_sums(x_row, hm_ptr, qs_ptr, sc_ptr, d_ptr, cols, m2, N, t_begin, t_end, BLOCK_N: tl.constexpr,
              PTX: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, CHUNKS: tl.constexpr):
    """Q3_K's sums [BLOCK_N], as _q2k_sums (CHUNKS too). Planes: hm [blocks * 8, N] (bit 4h + j of byte l the third
    bit of value 128h + 32j + l, set meaning no -4), qs [blocks * 16, N] (Q2_K's), sc [blocks * 3, N] (the 12 bytes
    of 6-bit scales, decode._q3k_scale's packing), d [blocks, N] fp16. The value is d (sc - 32) (q2 + 4 hbit - 4)."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for t in tl.range(t_begin, t_end, num_stages=STAGES):
        d = tl.load(d_ptr + t * N + cols, mask=m2, other=0.0).to(tl.float32)
        s_lo0 = tl.load(sc_ptr + (t * 3) * N + cols, mask=m2, other=0)
        s_lo1 = tl.load(sc_ptr + (t * 3 + 1) * N + cols, mask=m2, other=0)
        s_hi = tl.load(sc_ptr + (t * 3 + 2) * N + cols, mask=m2, other=0)
        part = tl.zeros(cols.shape, dtype=tl.float32)
        if CHUNKS >= 2:
            hm_a, run_a0, run_a1 = _q3k_words(hm_ptr, qs_ptr, t, 0, cols, m2, N)
            hm_b, run_b0, run_b1 = _q3k_words(hm_ptr, qs_ptr, t, 1, cols, m2, N)
            pdl_wait(PDL)
            part = _q3k_run(x_row, t, 0, 0, run_a0, hm_a, s_lo0, s_lo1, s_hi, part, PTX)
            part = _q3k_run(x_row, t, 1, 0, run_a1, hm_a, s_lo0, s_lo1, s_hi, part, PTX)
            part = _q3k_run(x_row, t, 0, 1, run_b0, hm_b, s_lo0, s_lo1, s_hi, part, PTX)
            part = _q3k_run(x_row, t, 1, 1, run_b1, hm_b, s_lo0, s_lo1, s_hi, part, PTX)
        else:
            pdl_wait(PDL)
            for v in tl.range(0, 2):
                hm = _words4(hm_ptr + (t * 8 + 4 * v) * N + cols, m2, N)
                for h in tl.static_range(2):
                    run = _words4(qs_ptr + (t * 16 + 8 * h + 4 * v) * N + cols, m2, N)
                    part = _q3k_run(x_row, t, h, v, run, hm, s_lo0, s_lo1, s_hi, part, PTX)
        acc += d * part
    return tl.reshape(acc, (BLOCK_N,))


@triton.jit
def _q3k_words(hm_ptr, qs_ptr, t, v: tl.constexpr, cols, m2, N):
    """Q3_K super-block t's hmask words 4v .. 4v + 3 and its qs runs of v in halves h = 0, 1."""
    return (_words4(hm_ptr + (t * 8 + 4 * v) * N + cols, m2, N), _words4(qs_ptr + (t * 16 + 4 * v) * N + cols, m2, N),
            _words4(qs_ptr + (t * 16 + 8 + 4 * v) * N + cols, m2, N))


@triton.jit
def _q3k_run(x_row, t, h: tl.constexpr, v, run, hm, s_lo0, s_lo1, s_hi, part, PTX: tl.constexpr):
    """part plus the sum of dot * (sc - 32) over Q3_K super-block t's sub-blocks 8h + 2j + v, j = 0..3, from their
    run of four qs words and the hmask words of v."""
    w0, w1, w2, w3 = run
    hm0, hm1, hm2, hm3 = hm
    for j in tl.static_range(4):
        x0, x1, x2, x3, _ = _x_pairs4(x_row + t * 256 + 128 * h + 32 * j + 16 * v, PTX)
        dot = _q23k_dot(w0, w1, w2, w3, hm0, hm1, hm2, hm3, x0, x1, x2, x3, j, h, True, PTX)
        part += dot * (_small_float(q3k_scale(s_lo0 if j < 2 else s_lo1, s_hi, 8 * h + 2 * j + v)) - 32.0)
    return part


@triton.jit
def _i8(word, shift):
    """The int8 at bit `shift` of int32 `word`, as float32."""
    return ((word >> shift) & 0xFF).to(tl.int8).to(tl.float32)


def applies(st: GgmlState, caps: DeviceCaps | None = None) -> str | None:
    """None where this GEMV runs the weight, else why not (the interpreter runs its float32 twin of the PTX; the
    plan takes it on CUDA only)."""
    if st.name not in TYPES or not st.layout.columns:
        return f"{st.name} has no column-major GEMV (only {', '.join(TYPES)})"
    if st.dtype != torch.float16:
        return f"{str(st.dtype).removeprefix('torch.')} activations (packed halves are fp16)"
    return None


class ColsConfig(NamedTuple):
    """A launch of the column GEMV: BLOCK_N columns a program in `warps` warps; split-K aims at `waves` programs an
    SM, each with at least `min_tiles` parts of a super-block, `parts` a super-block (1, 2 or 4; at most its type's
    MAX_PARTS); `chunks` K-loop steps an iteration (1, 2 or 4, at most a part's: its loads in flight at once; Q2_K and
    Q3_K, whose loops take whole super-blocks: from 2, all of a super-block's words loaded before its sums)."""
    block_n: int
    warps: int
    waves: float
    min_tiles: int
    chunks: int = 1
    parts: int = 1


# (BLOCK_N, warps, waves, min tiles, chunks[, parts]). The packed-half types: four columns a thread in two warps, two
# 64-value chunks an iteration, the K loop split for sixteen programs an SM at every size. Alone
# (benchmarks/ggml_gemm.py --sweep) the small weights wanted whole super-blocks an iteration and the large ones eight
# programs an SM; in the decode chain, where the next GEMV's programs start as this one drains (PDL), the shorter
# programs with fewer registers are faster (benchmarks/gemv_cols_engine_configs.sh). Q6_K, whose 128-value half holds
# twice a chunk's loads: two columns a thread in four warps, one half an iteration. Q5_K, whose high bits add a word
# to each chunk's loads: two columns a thread, two chunks an iteration. The small weights (K = 4,096: 16 super-blocks,
# so at most 16 splits of whole super-blocks, too few programs to hide a program's chain of loads) split each
# super-block's K range in halves (benchmarks/gemv_cols_small_weights.sh).
PACKED_HALF = ColsConfig(block_n=256, warps=2, waves=16.0, min_tiles=1, chunks=2)
Q4_K_SMALL = PACKED_HALF._replace(parts=2)
Q6_K_CONFIG = ColsConfig(block_n=256, warps=4, waves=16.0, min_tiles=1)
Q6_K_SMALL = Q6_K_CONFIG._replace(parts=2)
Q5_K_LARGE = ColsConfig(block_n=256, warps=4, waves=16.0, min_tiles=1, chunks=2)
Q5_K_SMALL = Q5_K_LARGE._replace(parts=2)
LARGE_WEIGHT = 1 << 25          # values (N * K) from which a type's second config applies
# Q2_K and Q3_K, whose runs each take their own pass over a word: two columns a thread; their small weights one a
# thread, twice the programs, with a super-block's words all loaded first (chunks 2); Q3_K's large ones 512 columns
# a program (four a thread)
TWO_BIT = ColsConfig(block_n=256, warps=4, waves=16.0, min_tiles=1)
TWO_BIT_SMALL = ColsConfig(block_n=128, warps=4, waves=32.0, min_tiles=1, chunks=2)
Q3_K_LARGE = ColsConfig(block_n=512, warps=4, waves=16.0, min_tiles=1)
# type -> (config below LARGE_WEIGHT values, config from there)
CONFIGS = {"q2_K": (TWO_BIT_SMALL, TWO_BIT), "q3_K": (TWO_BIT_SMALL, Q3_K_LARGE), "q4_K": (Q4_K_SMALL, PACKED_HALF),
           "q5_K": (Q5_K_SMALL, Q5_K_LARGE), "q6_K": (Q6_K_SMALL, Q6_K_CONFIG)}
# The most parts a super-block's K range splits into, by type: its K loop's steps (Q4_K / Q5_K: four 64-value chunks,
# Q6_K: two halves); Q2_K's and Q3_K's loops take whole super-blocks.
MAX_PARTS = {"q4_K": 4, "q5_K": 4, "q6_K": 2, "q2_K": 1, "q3_K": 1}
# Two weights in one launch (a mixed file's q and k over a v of another type) take the first one's config in four
# warps: a Q6_K v holds four columns a thread's registers in two.
PAIR_WARPS = 4


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> ColsConfig:
    """The launch config of a weight (any M: the plan gives this path one row)."""
    return _config(st.name, st.n * st.k)


def _config(name: str, values: int) -> ColsConfig:
    return CONFIGS[name][values >= LARGE_WEIGHT]


def pair_config(a: GgmlState, b: GgmlState) -> ColsConfig:
    """The launch config of weights a and b stacked in one launch (matmul's `second`)."""
    return _config(a.name, (a.n + b.n) * a.k)._replace(warps=PAIR_WARPS)


def pair_applies(a: GgmlState, b: GgmlState, config: ColsConfig | None = None) -> str | None:
    """None where one launch can take weight a stacked over b (matmul's `second`), else why not: both on this
    GEMV, over one input, and a's rows filling whole column blocks of the launch config (a's), so that each
    program's columns lie in one of the two."""
    why = applies(a) or applies(b)
    if why is not None:
        return why
    if a.k != b.k or a.dtype != b.dtype:
        return f"{a.name} [{a.n}, {a.k}] and {b.name} [{b.n}, {b.k}] do not share an input"
    block_n = ColsConfig(*(config or pair_config(a, b))).block_n
    return None if a.n % block_n == 0 else f"{a.name}'s {a.n} rows are not whole blocks of {block_n} columns"


def _rows(st: GgmlState, second: GgmlState | None) -> int:
    """N of the weight a launch runs: st's rows, or st's over `second`'s."""
    return st.n + (second.n if second is not None else 0)


def rope_applies(st: GgmlState, rope: RopeStore, config: ColsConfig, second: GgmlState | None = None) -> bool:
    """Whether the epilogue can finish W = [q; k; v] (st, or st over `second`) under `config` (gemv_out.rope_fits)."""
    return rope_fits(_rows(st, second), rope, ColsConfig(*config).block_n)


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, glu: bool = False, rope: RopeStore | None = None, ptx: bool | None = None,
           stages: int = 1, second: GgmlState | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) for fp16 x2 and a weight of TYPES in column-major planes. `glu`: W stacks
    [gate; up] and y[M, N/2] = silu(gate) * up; `rope`: W stacks [q; k; v], q and k rotated and k, v stored in the
    paged caches (rope_applies must hold), as the affine GEMV's epilogues. `second`: W stacks st over a weight of
    another type (pair_applies must hold; not with glu), N their rows together, `bias` theirs. `config`
    (ColsConfig's fields), `ptx` (the PTX, or its float32 twin) and `stages` forced by tests and benchmarks."""
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1 and applies(st) is None, st.name
    if x2.data_ptr() % 8 or x2.stride(0) % 4:
        x2 = x2.clone()                     # four activations a 64-bit load (_x4, _x_pairs): rows 8-byte aligned
    caps = caps or device_caps(x2.device)
    config = ColsConfig(*(config or (default_config(st, caps, x2.shape[0]) if second is None
                                     else pair_config(st, second))))
    assert second is None or (not glu and pair_applies(st, second, config) is None)
    assert rope is None or (not glu and rope_applies(st, rope, config, second))
    n = _rows(st, second)
    assert not glu or n % 2 == 0
    bn, warps, waves, min_tiles, chunks, parts = config
    b = second if second is not None else st
    parts = min(parts, MAX_PARTS[st.name], MAX_PARTS[b.name])      # the finest split both types' loops take
    assert chunks in (1, 2, 4) and parts in (1, 2, 4), config      # an iteration's steps lie in one part
    m = x2.shape[0]
    column_blocks, splits, per, y, ws, locks = gemv_launch(x2, n, st.tiles * parts, bn, waves, min_tiles, glu,
                                                           x2.dtype, caps)
    _ggml_cols_kernel[(m, column_blocks, splits)](
        x2, *plane_args(st), bias if bias is not None else x2, y, ws, locks,
        *(rope.kernel_args() if rope is not None else (x2,) * 7), n, per, st.tiles * parts,
        *((rope.q_size, rope.kv_size) if rope is not None else (0, 0)), x2.stride(0), y.stride(0),
        *plane_args(b), st.n, BLOCK_N=bn, HAS_BIAS=bias is not None, SPLIT_K=splits,
        PTX=caps.is_cuda if ptx is None else ptx, STAGES=stages, CHUNKS=chunks, PARTS=parts, GLU=glu,
        ROPE=rope is not None, HEAD_D=rope.head_dim if rope is not None else 128, **_type_flags(st, ""),
        **_type_flags(b, "B"),
        TWO=second is not None, **fp8_write_constexprs(rope.fmt if rope is not None else None), num_warps=warps,
        **pdl_launch(caps))
    return y


def _type_flags(st: GgmlState, suffix: str) -> dict:
    """The kernel's type constexprs Q2 .. Q6 (Q2B .. Q6B for the second weight) of st (Q4_K: none set)."""
    return {f"Q{bits}{suffix}": st.name == f"q{bits}_K" for bits in (2, 3, 5, 6)}
