"""The tensor-core path of the ggml kernels: a tiled `tl.dot` GEMM, the weight tile decoded in registers.

Each program takes BLOCK_M activation rows and BLOCK_N weight rows; a step decodes a [BLOCK_N, 256 / PARTS] part of
a tile (decode.py) into the compute dtype, rounded once from ggml's float32 value, which meets the activations'
[BLOCK_M, 256 / PARTS] tile in `tl.dot` with float32 accumulation. For small M the K loop is split over programs
that add their partial sums, so that enough programs fill the SMs.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.decode import decode
from quanta.kernels.ggml.layout import GgmlState, plane_args, split_output, type_constexprs
from quanta.kernels.triton_support import cdiv, split_k, tl, triton


@triton.jit
def _ggml_gemm_kernel(
    # pointers
    x_ptr, p0, p1, p2, p3, lut_ptr, bias_ptr, y_ptr,
    # sizes
    M, N, K, NB, steps_per_split, num_steps,
    # strides (x and y rows)
    stride_xm, stride_ym,
    # meta
    TYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    CENTER: tl.constexpr, HAS_MIN: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """y[M, N] (+)= x[M, K] @ W[N, K].T over the program's K steps; program (tile of M x N, split of K steps)."""
    AP: tl.constexpr = A // PARTS
    BLOCK_K: tl.constexpr = AP * B * C * D
    DT: tl.constexpr = x_ptr.dtype.element_ty
    # --- which tile and which K range
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m                       # M fastest: programs sharing a weight tile run together
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    s_begin = pid_k * steps_per_split
    s_end = tl.minimum(s_begin + steps_per_split, num_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # --- main loop: part (step % PARTS) of tile (step // PARTS) a step
    for step in range(s_begin, s_end):
        f, scale, minus = decode(p0, p1, p2, p3, lut_ptr, offs_n, mask_n, step // PARTS, (step % PARTS) * AP, NB,
                                 N, TYPE, AP)
        w = (f - CENTER) * scale[:, :, :, None, None]
        if HAS_MIN:
            w -= minus[:, :, :, None, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DT)
        k = step * BLOCK_K + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & (k < K)[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    # --- epilogue: bias once (first split), then store or add the split's partial sum
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")


class GemmConfig(NamedTuple):
    """A GEMM launch: BLOCK_M x BLOCK_N output tiles, K steps of 256 / parts values, the K loop split for about
    `waves` programs an SM."""
    block_m: int
    block_n: int
    parts: int
    warps: int
    stages: int
    waves: float


# M bucket -> config on the chips with ~160-227 KB of shared memory a block (sm80, sm90). Steps of a quarter tile
# (64 values): a step's decoded weight is 64 values a row, which keeps the decode's registers clear of spilling
# beside mma's register operands on sm80; a stage holds x's [BLOCK_M, 64] tile and the raw blocks.
GEMM_CONFIGS = ((16, GemmConfig(16, 64, 4, 4, 4, 2.0)), (32, GemmConfig(32, 64, 4, 4, 4, 2.0)),
                (64, GemmConfig(64, 64, 4, 4, 3, 1.5)), (256, GemmConfig(128, 128, 4, 8, 4, 1.0)))
# Above the last bucket, compute-bound, the decode is the cost: on sm90 256-row tiles decode each weight tile once
# for twice the rows; sm80's register file holds no such tile beside mma's register operands.
LARGE_M = GemmConfig(128, 128, 4, 8, 4, 1.0)
SM90_LARGE_M = GemmConfig(256, 128, 4, 8, 3, 1.0)
LARGE_SMEM = ((8, 0), (9, 0))       # the chips these configs fit as they are; the others have ~100 KB or less


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> GemmConfig:
    """M's bucket of GEMM_CONFIGS (above, LARGE_M or SM90_LARGE_M), cut to 64 x 64 tiles in 4 warps and 2 stages where
    the chip has ~100 KB of shared memory or less (sm75, sm86, sm89); parts never split axis A below one value."""
    large = SM90_LARGE_M if caps.capability == (9, 0) else LARGE_M
    cfg = next((c for top, c in GEMM_CONFIGS if m <= top), large)
    if caps.capability not in LARGE_SMEM:
        cfg = GemmConfig(min(cfg.block_m, 64), min(cfg.block_n, 64), cfg.parts, 4, 2, cfg.waves)
    return cfg._replace(parts=min(cfg.parts, st.layout.axes[0]))


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias); `config` (GemmConfig's fields) forced by tests and benchmarks."""
    m = x2.shape[0]
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1
    caps = caps or device_caps(x2.device)
    bm, bn, parts, warps, stages, waves = config or default_config(st, caps, m)
    assert st.layout.axes[0] % parts == 0, (st.name, parts)
    steps = st.tiles * parts
    tiles_out = cdiv(m, bm) * cdiv(st.n, bn)
    splits, per = split_k(tiles_out, steps, caps.sm_count, waves, 2 * parts)
    y = split_output(x2, st, splits)
    _ggml_gemm_kernel[(tiles_out, splits)](
        x2, *plane_args(st), st.lut if st.lut is not None else x2, bias if bias is not None else x2, y,
        m, st.n, st.k, st.blocks, per, steps, x2.stride(0), y.stride(0),
        **type_constexprs(st), PARTS=parts, BLOCK_M=bm, BLOCK_N=bn, HAS_BIAS=bias is not None, SPLIT_K=splits,
        num_warps=warps, num_stages=stages)
    return y.to(x2.dtype)
