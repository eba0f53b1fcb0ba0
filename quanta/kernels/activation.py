"""SiLU-and-mul (the SwiGLU gate): y = silu(x[..., :I]) * x[..., I:] for the fused gate_up output."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quanta.kernels.triton_support import cdiv, tl, triton

NAME = "triton_silu_and_mul"


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def silu_mul(g, u, DT: tl.constexpr):
    """silu(g) * u in dtype DT from float32 g, u holding DT values: silu in fp32 rounded to DT (as F.silu
    returns it), the product rounded once (the rounding of every fused SwiGLU, e.g. the affine GEMV's epilogue)."""
    return ((g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32) * u).to(DT)


@triton.jit
def _silu_and_mul_kernel(
    # pointers
    x_ptr, y_ptr,
    # sizes
    I,
    # strides (rows)
    stride_x, stride_y,
    # meta
    BLOCK: tl.constexpr,
):
    """Program (row, block of I): gate and up read once, silu in fp32, product rounded once."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    # --- load both halves
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, silu_mul(g, u.to(tl.float32), u.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> [..., I]."""
    i = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * i)
    assert x2.stride(-1) == 1
    y = torch.empty(x2.shape[0], i, device=x.device, dtype=x.dtype)
    block = 1024
    _silu_and_mul_kernel[(x2.shape[0], cdiv(i, block))](x2, y, i, x2.stride(0), y.stride(0), BLOCK=block,
                                                        num_warps=4)
    return y.reshape(*x.shape[:-1], i)

