"""The MMA path of the ggml kernels for Q4_K: the affine MMA kernel's register operand (affine/mma.py), decoded
straight from ggml's own code plane, for the small and middle M between the GEMV and dequantize + cuBLAS.

The product is computed transposed, yᵀ = W · xᵀ, so that the decoded weight is the MMA's A operand, read from
registers (wgmma on sm90); x, operand B, goes through shared memory. A K step is half a super-block: 16 code words
of each of BLOCK_N rows, 128 values. The words are loaded in the MMA accumulator's layout, whose thread map is
operand A's, so each thread holds the words 2q, 2q + 1, 2q + 8, 2q + 9 of its rows and decodes them in place
(_slice); the MMA's K order is therefore not the file's, and x is permuted into it instead (_in_mma_order).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import H2_PAIR_F16
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.layout import GgmlState
from quanta.kernels.triton_support import cdiv, split_k, tl, triton

TYPES = ("q4_K",)
CAPABILITY = (9, 0)         # the register operand is Hopper's wgmma (as the affine MMA kernel's)
STEP = 128                  # values of a row a K step: half a Q4_K super-block, 16 code words


@triton.jit
def _slice(p, t: tl.constexpr, HIGH: tl.constexpr, s, zb, H2: tl.constexpr, BN: tl.constexpr):
    """Weights [BN, 16] of MMA slice 4 HIGH + t (its 16 K columns) from the step's words p [BN, 8, 2] (word pairs
    2q', 2q' + 1) and the pairs' (scale, zbias) s, zb [BN, 8, 2].

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
        args = [p, tl.full(shape, SEL, tl.int32), tl.full(shape, MASK, tl.int32),
                tl.full(shape, FACTOR, tl.float32).to(tl.float16), tl.full(shape, ADDEND, tl.float32).to(tl.float16),
                s, zb]
        w = tl.inline_asm_elementwise(H2_PAIR_F16, "=r,r,r,r,r,r,r,r,r,r,r", args, dtype=tl.float16,
                                      is_pure=True, pack=2)
    else:
        a, b = tl.split(p)
        if t >= 2:
            word = b
        else:
            word = a
        shift = (8 * (2 * (t % 2) + tl.arange(0, 2)) + 4 * HIGH)[None, None, :]
        q = ((word[:, :, None] >> shift) & 15).to(tl.float32)
        w = (q * s.to(tl.float32) + zb.to(tl.float32)).to(tl.float16)
    return tl.reshape(w, (BN, 16))


@triton.jit
def _step_scales(dm_ptr, sc_ptr, rows, mask_n, step, NB):
    """The (d, dmin) word [BN] of the step's super-block and its scale words 2 (step % 2), 2 (step % 2) + 1
    (layout.k4_scale_pairs: sub-blocks 4h, 4h + 1, then 4h + 2, 4h + 3; byte 2s a scale, 2s + 1 a min)."""
    blk = step // 2
    at = sc_ptr + rows * (NB * 4) + blk * 4 + 2 * (step % 2)
    return (tl.load(dm_ptr + rows * NB + blk, mask=mask_n, other=0), tl.load(at, mask=mask_n, other=0),
            tl.load(at + 1, mask=mask_n, other=0))


# PTX of a sub-block's (scale, zbias) in fp16 from its scale word's pair of bytes (scale, min) selected by $4 and
# the block's halves (d, -dmin) $3: the bytes join 0x64 bytes into the halves 1024 + byte (prmt), 1024 comes off
# exactly, and one packed multiply gives d * scale and -dmin * min, each rounded once as float32's product would be.
_SCALE_PAIR = tl.constexpr("{ .reg .b32 t, c; mov.b32 c, 0x64006400; prmt.b32 t, $2, c, $4; sub.rn.f16x2 t, t, c; "
                           "mul.rn.f16x2 t, t, $3; mov.b32 {$0, $1}, t; }")


@triton.jit
def _scale_pair(word, dm, HIGH: tl.constexpr, H2: tl.constexpr):
    """(d * scale, -dmin * min) in fp16 of the sub-block whose byte pair HIGH of `word` holds its scale and min;
    `dm` the block's (d, dmin) halves as one int32."""
    if H2:
        SEL: tl.constexpr = 0x5352 if HIGH else 0x5150      # bytes 2, 3 or 0, 1 of word; c's 0x64
        s, zb = tl.inline_asm_elementwise(_SCALE_PAIR, "=h,=h,r,r,r", [word, dm ^ -2147483648, tl.full(word.shape,
                                          SEL, tl.int32)], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
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
def _in_mma_order(x, BM: tl.constexpr):
    """x's step [BM, 128], loaded in K order, in the MMA's column order: column 64 HIGH + 16 t + 2 q' + e
    (q' = 4 qa + qb) is value 64 qa + 32 HIGH + 8 qb + 2 t + e of the half super-block (_slice's map). Loaded
    whole (16-byte copies) and permuted on its way to shared memory: a load gathered in the MMA's order moves
    4 bytes a copy, which was slower at every M."""
    return tl.reshape(tl.permute(tl.reshape(x, (BM, 2, 2, 4, 4, 2)), (0, 2, 4, 1, 3, 5)), (BM, 128))


@triton.jit
def _tile(p, dm_ptr, sc_ptr, rows, mask_n, step, NB, H2: tl.constexpr, BN: tl.constexpr):
    """The step's weight tile [BN, 128] in the MMA's column order, the 8 slices joined along register dims."""
    dm, first, second = _step_scales(dm_ptr, sc_ptr, rows, mask_n, step, NB)
    s, zb = _pair_scales(dm, first, second, 0, H2, BN)
    w0 = _slice(p, 0, 0, s, zb, H2, BN)
    w1 = _slice(p, 1, 0, s, zb, H2, BN)
    w2 = _slice(p, 2, 0, s, zb, H2, BN)
    w3 = _slice(p, 3, 0, s, zb, H2, BN)
    s, zb = _pair_scales(dm, first, second, 1, H2, BN)
    w4 = _slice(p, 0, 1, s, zb, H2, BN)
    w5 = _slice(p, 1, 1, s, zb, H2, BN)
    w6 = _slice(p, 2, 1, s, zb, H2, BN)
    w7 = _slice(p, 3, 1, s, zb, H2, BN)
    j = tl.join(tl.join(tl.join(w0, w1), tl.join(w2, w3)), tl.join(tl.join(w4, w5), tl.join(w6, w7)))
    return tl.reshape(tl.permute(j, (0, 4, 3, 2, 1)), (BN, 8 * 16))      # column 16 i + r, i = 4 i2 + 2 i1 + i0


@triton.jit(do_not_specialize=["steps_per_split"])
def _q4k_mma_kernel(x_ptr, dm_ptr, sc_ptr, qs_ptr, bias_ptr, y_ptr, M, N, NB, steps_per_split, num_steps,
                    stride_xm, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ATOMIC: tl.constexpr, H2: tl.constexpr):
    """y[M, N] (+)= (W[BLOCK_N rows] @ x[BLOCK_M rows]ᵀ)ᵀ over the program's K steps; program (output tile, M
    fastest, split of K steps). dm_ptr: d, dmin as one int32 a block; sc_ptr: the scale pairs as int32 words; qs_ptr:
    the code words."""
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
    for step in range(s_begin, s_end):
        p = tl.load(qs_ptr + rows[:, None] * (NB * 32) + step * 16 + tl.arange(0, 16)[None, :],
                    mask=mask_n[:, None], other=0)
        p = tl.reshape(p | acc_layout, (BLOCK_N, 8, 2))
        w = _tile(p, dm_ptr, sc_ptr, rows, mask_n, step, NB, H2, BLOCK_N)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (step * 128 + offs_k)[None, :], mask=mask_m[:, None],
                    other=0.0)
        acc = tl.dot(w, tl.trans(_in_mma_order(x, BLOCK_M)), acc)
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


def applies(st: GgmlState, caps: DeviceCaps) -> str | None:
    """None if the kernel runs this weight on a device of these caps, else why not."""
    if st.name not in TYPES:
        return f"{st.name}: no MMA decoder (it takes {', '.join(TYPES)})"
    if st.dtype != torch.float16:
        return f"{str(st.dtype).removeprefix('torch.')} activations (the decode is packed fp16)"
    if caps.capability != CAPABILITY:
        return f"{caps.name}: the register operand is sm90's wgmma"
    return None


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
    y = (torch.zeros(m, st.n, device=x2.device, dtype=torch.float32) if splits > 1
         else torch.empty(m, st.n, device=x2.device, dtype=x2.dtype))
    dm, sc, qs = (plane.view(torch.int32) for plane in st.planes)
    _q4k_mma_kernel[(tiles, splits)](
        x2, dm, sc, qs, bias if bias is not None else x2, y, m, st.n, st.blocks, per, steps,
        x2.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, ATOMIC=splits > 1,
        H2=x2.is_cuda if h2 is None else h2, num_warps=warps, num_stages=stages)
    return y.to(x2.dtype)

