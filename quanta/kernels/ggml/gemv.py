"""The GEMV path of the ggml kernels: a few rows of activations, no tensor cores.

Each program takes one activation row, BLOCK_N weight rows and a run of K tiles; a tile's codes are decoded in
registers (decode.py) and met by the activations in float32. Per sub-block the dot product of the decoded floats is
taken first, then centred and scaled (f - center is never formed per value), so a 4-bit value costs a funnel shift,
two logic ops and one FMA; the scaled sums stay spread over the tile's sub-blocks until the end of the K loop.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml.decode import decode
from quanta.kernels.ggml.layout import GgmlState, plane_args, split_output, type_constexprs
from quanta.kernels.triton_support import cdiv, split_k, tl, triton


@triton.jit
def _ggml_gemv_kernel(
    # pointers
    x_ptr, p0, p1, p2, p3, lut_ptr, bias_ptr, y_ptr,
    # sizes
    N, K, NB, tiles_per_split, num_tiles,
    # strides (x and y rows)
    stride_xm, stride_ym,
    # meta
    TYPE: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
    CENTER: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """y[m, n] (+)= sum_k x[m, k] * W[n, k] over the program's K tiles; program (row m, BLOCK_N rows of W, split)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # --- the tile's values along K in the decoder's axes [A, B, C, D]
    xo = (tl.arange(0, A)[:, None, None, None] * (B * C * D) + tl.arange(0, B)[None, :, None, None] * (C * D)
          + tl.arange(0, C)[None, None, :, None] * D + tl.arange(0, D)[None, None, None, :])
    x_row = x_ptr + pid_m * stride_xm
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    acc = tl.zeros((BLOCK_N, A, B), dtype=tl.float32)
    # --- main loop: one tile (256 values of each row) a step
    for t in range(t_begin, t_end):
        f, scale, minus = decode(p0, p1, p2, p3, lut_ptr, offs_n, mask_n, t, 0, NB, N, TYPE, A)
        k = t * (A * B * C * D) + xo
        x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        p = tl.sum(tl.sum(f * x[None, :, :, :, :], axis=4), axis=3)              # a sub-block's dot product
        if CENTER != 0.0 or HAS_MIN:
            xs = tl.sum(tl.sum(x, axis=3), axis=2)[None, :, :]
        if CENTER != 0.0:
            p -= CENTER * xs
        acc += p * scale
        if HAS_MIN:
            acc -= minus * xs
    # --- epilogue: reduce the tile's axes, bias once (first split), store or add
    store_row(tl.sum(tl.sum(acc, axis=2), axis=1), bias_ptr, y_ptr, pid_m, pid_k, offs_n, mask_n, stride_ym,
              HAS_BIAS, SPLIT_K)


@triton.jit
def store_row(y, bias_ptr, y_ptr, pid_m, pid_k, offs_n, mask_n, stride_ym, HAS_BIAS: tl.constexpr,
              SPLIT_K: tl.constexpr):
    """A GEMV program's float32 outputs y [BLOCK_N] of row pid_m: the bias once (first split), then stored, or added
    into the float32 output of a split-K launch."""
    if HAS_BIAS:
        if pid_k == 0:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + pid_m * stride_ym + offs_n
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.atomic_add(y_ptrs, y, mask=mask_n, sem="relaxed")


class GemvConfig(NamedTuple):
    """A GEMV launch: BLOCK_N weight rows a program; split-K aims at `waves` programs an SM, each with at least
    `min_tiles` K tiles."""
    block_n: int
    warps: int
    waves: float
    min_tiles: int


# The GEMV must stream the weight at copy bandwidth: enough programs to keep every SM's loads in flight (split-K
# where N alone gives too few), and a few KB of blocks each step of a program. 32 rows in 4 warps (64 values a thread
# a step) were the best of the shapes tried on the H200 for Q4_K and Q6_K, though the loop stays issue-bound: each
# value costs a funnel shift, two logic ops and an FMA, plus its share of the activations' layout conversion.
DEFAULT = GemvConfig(block_n=32, warps=4, waves=4.0, min_tiles=2)


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> GemvConfig:
    """The GEMV's launch config (one for every weight and M so far; the plan's table is the place for more)."""
    return DEFAULT


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias), one program row per activation row; `config` (GemvConfig's fields)
    forced by tests and benchmarks."""
    assert x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1
    caps = caps or device_caps(x2.device)
    launch = Launch.of(x2, st, config or default_config(st, caps, x2.shape[0]), caps)
    _ggml_gemv_kernel[launch.grid](
        x2, *plane_args(st), st.lut if st.lut is not None else x2, bias if bias is not None else x2, launch.y,
        st.n, st.k, st.blocks, launch.tiles_per_split, st.tiles, x2.stride(0), launch.y.stride(0),
        **type_constexprs(st), BLOCK_N=launch.block_n, HAS_BIAS=bias is not None, SPLIT_K=launch.splits,
        num_warps=launch.warps)
    return launch.y.to(x2.dtype)


class Launch(NamedTuple):
    """A GEMV launch worked out: grid (rows, column blocks, splits), K tiles a split, and the output (float32
    zeros to add the splits into, or the activations' dtype)."""
    grid: tuple[int, int, int]
    tiles_per_split: int
    y: torch.Tensor
    block_n: int
    warps: int

    @property
    def splits(self) -> int:
        return self.grid[2]

    @classmethod
    def of(cls, x2: torch.Tensor, st: GgmlState, config: tuple, caps: DeviceCaps) -> Launch:
        """The launch of `config` (GemvConfig's fields) for x2 [M, K] against st on a device of these caps."""
        bn, warps, waves, min_tiles = config
        m, column_blocks = x2.shape[0], cdiv(st.n, bn)
        splits, per = split_k(m * column_blocks, st.tiles, caps.sm_count, waves, min_tiles)
        y = split_output(x2, st, splits)
        return cls((m, column_blocks, splits), per, y, bn, warps)

