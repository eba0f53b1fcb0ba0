"""Q2_K's and Q3_K's GEMV against 8-bit activations: integer dot products of four codes an instruction (dp4a), as
llama.cpp's MMVQ takes them. In packed halves (gemv_cols) a pair of 2- or 3-bit codes costs a 4-bit pair's
instructions at up to twice the pairs a byte, so that GEMV is issue-bound; dp4a takes four codes after a mask.

x is rounded by quantize_rows, a launch of its own, or (QUANTIZE_IN_PROGRAMS) by each program for its K range through
a scratch row: int8 codes round(x * 127 / amax) in blocks of 32, each block's scale amax / 127, each 16-value
sub-block's sum of codes (Q2_K's mins, Q3_K's -4). A thread owns output columns over gemv_cols' planes; a
32-value block's scaled dots are summed in int32, then scaled once in float32. The result is the weight times x
rounded to 8 bits (the error is x's rounding); the affine GEMV's ends (gemv_out): split-K, SwiGLU.
"""
from __future__ import annotations

import torch

from quanta.kernels.affine.gemv_out import gemv_launch, output_columns, store_plain
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.decode import _half, q3k_scale
from quanta.kernels.ggml.gemv_cols import ColsConfig, _words4
from quanta.kernels.ggml.layout import GgmlState, plane_args
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

TYPES = ("q2_K", "q3_K")
QBLOCK = 32                   # activation values a scale
SUB = 16                      # values a sum of codes (a K-quant sub-block)
QUANT_BLOCKS = 8              # 32-value blocks a quantize program (one super-block's 256 values)
# Two columns a thread in four warps, the K loop split for sixteen programs an SM: gemv_cols' launch for Q2_K's
# large weights (benchmarks/gemv_dp4a.py times others).
DEFAULT_CONFIG = ColsConfig(block_n=256, warps=4, waves=16.0, min_tiles=1)
# Where x is rounded when the caller gives no codes: by quantize_rows before the GEMV (a launch), or in the GEMV's
# programs (no launch, but every program spends its own instructions and barriers on each tile of x: slower in the
# decode chain for Q3_K and on every IQ4 weight alone, benchmarks/dp4a_decode.sh). gemv_iq4 reads it too.
QUANTIZE_IN_PROGRAMS = False


@triton.jit
def _quantize(x_row, q_row, d_row, s_row, b, BLOCKS: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Values [b * 32 * BLOCKS, + 32 * BLOCKS) of one row: int8 codes floor(x * 127 / amax + 1/2) of each 32-value
    block (zero where amax is) into q_row, its scale amax / 127 (float32) into d_row, each 16 values' sum of codes
    (int32) into s_row. INTERLEAVE: a block's value i at byte 2i of it, value 16 + i at 2i + 1 (the order IQ4's
    byte permutes leave the weight's values in: gemv_iq4)."""
    offs = b * BLOCKS * 32 + tl.arange(0, BLOCKS * 32)
    x = tl.reshape(tl.load(x_row + offs).to(tl.float32), (BLOCKS, 32))
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    q = tl.floor(x * inv[:, None] + 0.5).to(tl.int32)
    at = offs
    if INTERLEAVE:
        at = offs - offs % 32 + (offs % 16) * 2 + (offs % 32) // 16
    tl.store(q_row + at, tl.reshape(q, (BLOCKS * 32,)).to(tl.int8))
    tl.store(d_row + b * BLOCKS + tl.arange(0, BLOCKS), amax / 127.0)
    sums = tl.sum(tl.reshape(q, (BLOCKS * 2, 16)), axis=1)
    tl.store(s_row + b * BLOCKS * 2 + tl.arange(0, BLOCKS * 2), sums)


@triton.jit
def _q8_rows_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_xm, BLOCKS: tl.constexpr, INTERLEAVE: tl.constexpr):
    """_quantize of values [pid_k * 32 * BLOCKS, + 32 * BLOCKS) of row pid_m."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    _quantize(x_ptr + pid_m * stride_xm, q_ptr + pid_m * K, d_ptr + pid_m * (K // 32), s_ptr + pid_m * (K // 16), pid_k,
              BLOCKS, INTERLEAVE)


def _code_buffers(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialized codes int8 [M, K], scales float32 [M, K / 32] and sums of codes int32 [M, K / 16]."""
    return (torch.empty(m, k, dtype=torch.int8, device=device),
            torch.empty(m, k // QBLOCK, dtype=torch.float32, device=device),
            torch.empty(m, k // SUB, dtype=torch.int32, device=device))


def quantize_rows(x2: torch.Tensor, interleave: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int8 [M, K], scales float32 [M, K / 32], sums of codes int32 [M, K / 16]) of rows x2 [M, K], K a
    multiple of 256: each 32-value block's codes round(x * 127 / amax), half-way up, its scale amax / 127.
    `interleave`: each block's codes in IQ4's order (_quantize)."""
    m, k = x2.shape
    assert k % (QBLOCK * QUANT_BLOCKS) == 0 and x2.stride(1) == 1, (m, k)
    q, d, s = _code_buffers(m, k, x2.device)
    _q8_rows_kernel[(m, k // (QBLOCK * QUANT_BLOCKS))](x2, q, d, s, k, x2.stride(0), BLOCKS=QUANT_BLOCKS,
                                                        INTERLEAVE=interleave)
    return q, d, s


def codes_for(x2: torch.Tensor, quantized: tuple | None, interleave: bool = False) -> tuple:
    """(codes, scales, sums, whether the GEMV's programs make them) for a dp4a GEMV: `quantized` where given; else
    quantize_rows' where x is rounded by a launch of its own (QUANTIZE_IN_PROGRAMS off), or buffers for the
    programs to fill."""
    if quantized is None and not QUANTIZE_IN_PROGRAMS:
        quantized = quantize_rows(x2, interleave)
    return (*quantized, False) if quantized is not None else (*_code_buffers(*x2.shape, x2.device), True)


def _int32(v: int) -> int:
    """Unsigned 32-bit `v` as the int32 of the same bits."""
    return v - (1 << 32) if v >= 1 << 31 else v


# The bit of each byte at which run j's code is dotted (the dot is 2^bit times the codes'): Q2_K's 2-bit codes where
# they lie (bits 2j); Q3_K's 3-bit codes there too, but run 3's from bit 4 (7 * 64 > 255). The masks of Q2_K's runs
# (as int32) and each run's 2^-bit follow.
RUN_AT, RUN3_AT_BITS = (0, 2, 4, 6), (0, 2, 4, 4)
RUN_MASKS = tl.constexpr(tuple(_int32(0x03030303 << at) for at in RUN_AT))
RUN_SCALES = tl.constexpr(tuple(2.0 ** -at for at in RUN_AT))
RUN3_AT = tl.constexpr(RUN3_AT_BITS)
RUN3_SCALES = tl.constexpr(tuple(2.0 ** -at for at in RUN3_AT_BITS))


@triton.jit
def _dp4a(codes, xw, acc, PTX: tl.constexpr, SIGNED: tl.constexpr = False):
    """acc + the dot product of the four bytes of `codes` (unsigned; SIGNED: signed) with the four signed bytes of
    `xw` (int32)."""
    if PTX:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [codes, xw, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [codes, xw, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        for b in tl.static_range(4):
            if SIGNED:
                code = (codes << 24 - 8 * b) >> 24
            else:
                code = (codes >> 8 * b) & 0xFF
            acc += code * ((xw << 24 - 8 * b) >> 24)
        return acc


@triton.jit
def _x4(q_at):
    """Four words of activation codes from two 64-bit loads at q_at (an int64 pointer)."""
    x01 = tl.load(q_at)
    x23 = tl.load(q_at + 1)
    return x01.to(tl.int32), (x01 >> 32).to(tl.int32), x23.to(tl.int32), (x23 >> 32).to(tl.int32)


@triton.jit
def _run(w0, w1, w2, w3, q_at, J: tl.constexpr, PTX: tl.constexpr):
    """4^J times the dot of Q2_K run J (bits 2J of every byte) of four qs words with their four words of codes
    at q_at: the codes masked in place, 4^J q < 256 an unsigned byte."""
    x0, x1, x2, x3 = _x4(q_at)
    s = _dp4a(w0 & RUN_MASKS[J], x0, tl.zeros_like(w0), PTX)
    s = _dp4a(w1 & RUN_MASKS[J], x1, s, PTX)
    s = _dp4a(w2 & RUN_MASKS[J], x2, s, PTX)
    return _dp4a(w3 & RUN_MASKS[J], x3, s, PTX)


@triton.jit
def _q3_codes(w, hm, H: tl.constexpr, J: tl.constexpr):
    """Run J of half H of Q3_K qs word w and hmask word hm: each byte's code q2 + 4 hbit (0..7) at bit P =
    RUN3_AT[J] of the byte, 2^P times it (the third bit, bit 4H + J of hm's byte, moved to bit P + 2)."""
    P: tl.constexpr = RUN3_AT[J]
    SHIFT: tl.constexpr = P + 2 - 4 * H - J
    q = (w >> (2 * J - P)) & (0x03030303 << P)
    if SHIFT >= 0:
        h = hm << SHIFT
    else:
        h = hm >> -SHIFT
    return q | (h & (0x04040404 << P))


@triton.jit
def _run3(w0, w1, w2, w3, m0, m1, m2, m3, q_at, H: tl.constexpr, J: tl.constexpr, PTX: tl.constexpr):
    """2^RUN3_AT[J] times the dot of Q3_K's unsigned codes (q2 + 4 hbit) of run J of half H over four qs words
    and their hmask words with their four words of activation codes at q_at."""
    x0, x1, x2, x3 = _x4(q_at)
    s = _dp4a(_q3_codes(w0, m0, H, J), x0, tl.zeros_like(w0), PTX)
    s = _dp4a(_q3_codes(w1, m1, H, J), x1, s, PTX)
    s = _dp4a(_q3_codes(w2, m2, H, J), x2, s, PTX)
    return _dp4a(_q3_codes(w3, m3, H, J), x3, s, PTX)


@triton.jit
def _nibble(word, SHIFT: tl.constexpr):
    return (word >> SHIFT) & 0xF


@triton.jit
def _q2k_half(q_row, xd_row, xs_row, t, H: tl.constexpr, lo, hi, w0, w1, w2, w3, w4, w5, w6, w7, part_q, part_m,
              PTX: tl.constexpr):
    """part_q, part_m plus half H of Q2_K super-block t: each run j (its 32 values one block of activation codes,
    sub-blocks 8H + 2j from words w0..w3 and 8H + 2j + 1 from w4..w7) as sc * dot and m * sum of codes in int32,
    then times the block's scale; lo, hi the half's scale words (sub-blocks 8H .. 8H + 3, 8H + 4 .. 8H + 7)."""
    for j in tl.static_range(4):
        q_at = q_row + t * 32 + 16 * H + 4 * j             # 64-bit words: two of codes each
        s0 = _run(w0, w1, w2, w3, q_at, j, PTX)
        s1 = _run(w4, w5, w6, w7, q_at + 2, j, PTX)
        sc = lo if j < 2 else hi
        sums = tl.load(xs_row + t * 8 + 4 * H + j)         # sub-blocks 8H + 2j and + 1's sums of codes
        # their bytes in sc from bit 16 (j % 2): scale | min << 4
        iq = s0 * _nibble(sc, 16 * (j % 2)) + s1 * _nibble(sc, 16 * (j % 2) + 8)
        im = (sums.to(tl.int32) * _nibble(sc, 16 * (j % 2) + 4)
              + (sums >> 32).to(tl.int32) * _nibble(sc, 16 * (j % 2) + 12))
        xd = tl.load(xd_row + t * 8 + 4 * H + j)
        part_q += (xd * RUN_SCALES[j]) * iq.to(tl.float32)     # the run's 4^j out
        part_m += xd * im.to(tl.float32)
    return part_q, part_m


@triton.jit
def _q3k_half(q_row, xd_row, xs_row, t, H: tl.constexpr, lo0, lo1, hi, w0, w1, w2, w3, w4, w5, w6, w7, m0, m1, m2,
              m3, m4, m5, m6, m7, part, PTX: tl.constexpr):
    """part plus half H of Q3_K super-block t: each run j's two sub-blocks (8H + 2j: qs words w0..w3 and hmask
    words m0..m3; 8H + 2j + 1: w4..w7, m4..m7) as (sc - 32) * (dot(q2 + 4 hbit, xq) - 4 sum(xq)) in int32, then
    times the block's scale; lo0, lo1, hi the super-block's scale words (decode.q3k_scale)."""
    for j in tl.static_range(4):
        q_at = q_row + t * 32 + 16 * H + 4 * j
        s0 = _run3(w0, w1, w2, w3, m0, m1, m2, m3, q_at, H, j, PTX)
        s1 = _run3(w4, w5, w6, w7, m4, m5, m6, m7, q_at + 2, H, j, PTX)
        sums = tl.load(xs_row + t * 8 + 4 * H + j)
        lo = lo0 if j < 2 else lo1
        # the codes' -4, at the runs' 2^RUN3_AT[j]
        s0 -= sums.to(tl.int32) << (RUN3_AT[j] + 2)
        s1 -= (sums >> 32).to(tl.int32) << (RUN3_AT[j] + 2)
        iq = s0 * (q3k_scale(lo, hi, 8 * H + 2 * j) - 32) + s1 * (q3k_scale(lo, hi, 8 * H + 2 * j + 1) - 32)
        part += (tl.load(xd_row + t * 8 + 4 * H + j) * RUN3_SCALES[j]) * iq.to(tl.float32)
    return part


@triton.jit
def _words8(at, m2, N):
    """Eight word rows at, at + N, .., at + 7N of a plane (streamed once: evict first)."""
    w0, w1, w2, w3 = _words4(at, m2, N)
    w4, w5, w6, w7 = _words4(at + 4 * N, m2, N)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _codes_ready(x_row, q_row, xd_row, xs_row, t, PDL: tl.constexpr, QUANTIZE: tl.constexpr,
                 INTERLEAVE: tl.constexpr):
    """After the PDL wait (x is the kernel before's output; returns at once after the first time): with QUANTIZE,
    super-block t's 256 values of x quantized into the program's codes, scales and sums (every program of the
    split writes the same values there), a barrier making them every thread's."""
    pdl_wait(PDL)
    if QUANTIZE:
        _quantize(x_row, q_row.to(tl.pointer_type(tl.int8)), xd_row, xs_row.to(tl.pointer_type(tl.int32)), t, 8,
                  INTERLEAVE)
        tl.debug_barrier()


@triton.jit
def _q2k_block(x_row, q_row, xd_row, xs_row, sc_ptr, qs_ptr, dm_ptr, t, cols, m2, N, PTX: tl.constexpr,
               PDL: tl.constexpr, QUANTIZE: tl.constexpr):
    """Q2_K super-block t's part of the sums: planes sc [blocks * 4, N], qs [blocks * 16, N], dm [blocks, N]
    (gemv_cols._q2k_sums); its words loaded before the PDL wait (they do not depend on the kernel before) and x's
    codes (_codes_ready)."""
    dm = tl.load(dm_ptr + t * N + cols, mask=m2, other=0)
    s0 = tl.load(sc_ptr + (t * 4) * N + cols, mask=m2, other=0)
    s1 = tl.load(sc_ptr + (t * 4 + 1) * N + cols, mask=m2, other=0)
    s2 = tl.load(sc_ptr + (t * 4 + 2) * N + cols, mask=m2, other=0)
    s3 = tl.load(sc_ptr + (t * 4 + 3) * N + cols, mask=m2, other=0)
    a0, a1, a2, a3, a4, a5, a6, a7 = _words8(qs_ptr + (t * 16) * N + cols, m2, N)
    b0, b1, b2, b3, b4, b5, b6, b7 = _words8(qs_ptr + (t * 16 + 8) * N + cols, m2, N)
    _codes_ready(x_row, q_row, xd_row, xs_row, t, PDL, QUANTIZE, False)
    part_q = tl.zeros(cols.shape, dtype=tl.float32)     # sum of xd * sc * dot(q, xq)
    part_m = tl.zeros(cols.shape, dtype=tl.float32)     # sum of xd * m * sum(xq)
    part_q, part_m = _q2k_half(q_row, xd_row, xs_row, t, 0, s0, s1, a0, a1, a2, a3, a4, a5, a6, a7, part_q, part_m,
                               PTX)
    part_q, part_m = _q2k_half(q_row, xd_row, xs_row, t, 1, s2, s3, b0, b1, b2, b3, b4, b5, b6, b7, part_q, part_m,
                               PTX)
    return _half(dm) * part_q - _half(dm >> 16) * part_m


@triton.jit
def _q3k_block(x_row, q_row, xd_row, xs_row, hm_ptr, qs_ptr, sc_ptr, d_ptr, t, cols, m2, N, PTX: tl.constexpr,
               PDL: tl.constexpr, QUANTIZE: tl.constexpr):
    """Q3_K super-block t's part of the sums: planes hm [blocks * 8, N], qs, sc [blocks * 3, N], d [blocks, N]
    fp16 (gemv_cols._q3k_sums); its words loaded before the PDL wait and x's codes (_codes_ready)."""
    d = tl.load(d_ptr + t * N + cols, mask=m2, other=0.0).to(tl.float32)
    lo0 = tl.load(sc_ptr + (t * 3) * N + cols, mask=m2, other=0)
    lo1 = tl.load(sc_ptr + (t * 3 + 1) * N + cols, mask=m2, other=0)
    hi = tl.load(sc_ptr + (t * 3 + 2) * N + cols, mask=m2, other=0)
    m0, m1, m2_, m3, m4, m5, m6, m7 = _words8(hm_ptr + (t * 8) * N + cols, m2, N)
    a0, a1, a2, a3, a4, a5, a6, a7 = _words8(qs_ptr + (t * 16) * N + cols, m2, N)
    b0, b1, b2, b3, b4, b5, b6, b7 = _words8(qs_ptr + (t * 16 + 8) * N + cols, m2, N)
    _codes_ready(x_row, q_row, xd_row, xs_row, t, PDL, QUANTIZE, False)
    part = tl.zeros(cols.shape, dtype=tl.float32)
    part = _q3k_half(q_row, xd_row, xs_row, t, 0, lo0, lo1, hi, a0, a1, a2, a3, a4, a5, a6, a7, m0, m1, m2_, m3, m4,
                     m5, m6, m7, part, PTX)
    part = _q3k_half(q_row, xd_row, xs_row, t, 1, lo0, lo1, hi, b0, b1, b2, b3, b4, b5, b6, b7, m0, m1, m2_, m3, m4,
                     m5, m6, m7, part, PTX)
    return d * part


@triton.jit
def _dp4a_kernel(x_ptr, q_ptr, xd_ptr, xs_ptr, p0, p1, p2, p3, bias_ptr, y_ptr, ws_ptr, lock_ptr, N, K,
                 tiles_per_split, num_tiles, stride_xm, stride_ym, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT_K: tl.constexpr, PTX: tl.constexpr, PDL: tl.constexpr = False, GLU: tl.constexpr = False,
                 Q3: tl.constexpr = False, QUANTIZE: tl.constexpr = True):
    """y[m, n] = sum_k xq[m, k] W[n, k] for a Q2_K (planes p0..p2) or Q3_K (Q3: p0..p3) weight and x's codes q (as
    int32 words), scales xd and sums xs (quantize_rows'); with QUANTIZE each program makes those of its K range from
    x into them first. Program (row m, BLOCK_N columns, split of whole super-blocks)."""
    pdl_launch_dependents(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n, mask_n = output_columns(pid_n, N, BLOCK_N, GLU)
    cols, m2 = offs_n[None, :], mask_n[None, :]
    q_row = (q_ptr + pid_m * (K // 4)).to(tl.pointer_type(tl.int64))
    xs_row = (xs_ptr + pid_m * (K // 16)).to(tl.pointer_type(tl.int64))
    xd_row = xd_ptr + pid_m * (K // 32)
    x_row = x_ptr + pid_m * stride_xm
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for t in tl.range(t_begin, t_end):
        if Q3:
            acc += _q3k_block(x_row, q_row, xd_row, xs_row, p0, p1, p2, p3, t, cols, m2, N, PTX, PDL, QUANTIZE)
        else:
            acc += _q2k_block(x_row, q_row, xd_row, xs_row, p0, p1, p2, t, cols, m2, N, PTX, PDL, QUANTIZE)
    pdl_wait(PDL)
    y = tl.reshape(acc, (BLOCK_N,))
    store_plain(y, bias_ptr, HAS_BIAS, y_ptr + pid_m * stride_ym, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                mask_n, N, SPLIT_K, BLOCK_N, GLU)


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> ColsConfig:
    """The launch config of a weight (the plan gives this path one row)."""
    return DEFAULT_CONFIG


def applies(st: GgmlState, caps: DeviceCaps | None = None) -> str | None:
    """None where this GEMV runs the weight, else why not."""
    if st.name not in TYPES or not st.layout.columns:
        return f"{st.name} has no dp4a GEMV (only {', '.join(TYPES)} in column-major planes)"
    if st.dtype != torch.float16:
        return f"{str(st.dtype).removeprefix('torch.')} activations (the GEMV writes fp16)"
    return None


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, glu: bool = False, ptx: bool | None = None,
           quantized: tuple | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) for fp16 x2 rounded to 8 bits in blocks of 32: by the GEMV's programs, each
    its K range (quantize_rows' rule), or `quantized`, quantize_rows' output for x2, given. `glu`: W stacks
    [gate; up] and y[M, N/2] = silu(gate) * up. `config` (ColsConfig's first four fields) and `ptx` (dp4a, or its
    integer twin) forced by tests and benchmarks."""
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1 and applies(st) is None, st.name
    caps = caps or device_caps(x2.device)
    m, k = x2.shape
    q, xd, xs, in_programs = codes_for(x2, quantized)
    bn, warps, waves, min_tiles = tuple(config or DEFAULT_CONFIG)[:4]
    n = st.n
    assert not glu or n % 2 == 0
    column_blocks, splits, per, y, ws, locks = gemv_launch(x2, n, st.tiles, bn, waves, min_tiles, glu, x2.dtype, caps)
    _dp4a_kernel[(m, column_blocks, splits)](
        x2, q.view(torch.int32), xd, xs, *plane_args(st), bias if bias is not None else x2, y, ws, locks, n, k, per,
        st.tiles, x2.stride(0), y.stride(0),
        BLOCK_N=bn, HAS_BIAS=bias is not None, SPLIT_K=splits, PTX=caps.is_cuda if ptx is None else ptx, GLU=glu,
        Q3=st.name == "q3_K", QUANTIZE=in_programs, num_warps=warps, **pdl_launch(caps))
    return y
