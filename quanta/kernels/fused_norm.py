"""RMSNorm, optionally fused with the residual add before it (one read and one write of the hidden state).

    h = x + residual (when given);  y = weight * (h.float() * rsqrt(mean(h**2) + eps)).to(dtype)
as transformers' LlamaRMSNorm and engine.layers.RMSNorm compute it; returns y, or (y, h) with a residual.
With `order`, y's column k holds feature order[k]: the order in which the GEMM that reads y holds its weight's
columns (an act-order weight sorted by group), so that the GEMM need not gather its input; h keeps the model's
order. The kernel permutes the row it holds in registers (tl.gather, through shared memory) and stores it
whole: a row scattered to global memory element by element costs one transaction per element.
"""
from __future__ import annotations

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.triton_support import (
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    tl,
    triton,
)

NAME = "triton_rms_norm"


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
              order: torch.Tensor | None = None):
    h = x if residual is None else x + residual
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if order is not None:
        y = y.index_select(-1, order.long())
    return y if residual is None else (y, h)


@triton.jit
def store_row(y_ptr, y, offs, mask, order_ptr, HAS_ORDER: tl.constexpr):
    """A normed row y into its output row at y_ptr; with HAS_ORDER column k holds feature order[k]."""
    if HAS_ORDER:
        y = tl.gather(y, tl.load(order_ptr + offs, mask=mask, other=0), axis=0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_and_weight(w_ptr, D, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """A norm program's start: its row, the row's offsets and mask, and the float32 weight, loaded before waiting
    for the kernel before it (PDL: no predecessor writes the weight)."""
    pdl_launch_dependents(PDL)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    return tl.program_id(0), offs, mask, w


@triton.jit
def add_rms_norm(h, r_ptrs, w, mask, D, eps, HAS_RESIDUAL: tl.constexpr):
    """A row h (in its 16- or 32-bit dtype) plus the residual row at r_ptrs, and its RMSNorm scaled by the float32
    weight w: (h + residual in h's dtype, y in float32). Arithmetic in fp32, rounded where the reference rounds: a
    16-bit sum or product rounded once is the same number as the native 16-bit operation; the norm is taken in
    fp32, rounded to the dtype, then scaled (the reference's order)."""
    h = add_residual(h, r_ptrs, mask, HAS_RESIDUAL)
    return h, normed(h, inverse_rms(h, D, eps), w)


@triton.jit
def add_residual(h, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
    """h + the residual at r_ptrs, summed in fp32 and rounded to h's dtype (h itself without a residual)."""
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def normed(h, inv, w):
    """w * (h * inv rounded to h's dtype), in fp32: y at h's columns, given the whole row's inverse RMS."""
    return w * (h.to(tl.float32) * inv).to(h.dtype).to(tl.float32)


@triton.jit
def inverse_rms(h, D, eps):
    """1 / sqrt(mean(h**2) + eps) of a whole row h, in fp32."""
    hf = h.to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, order_ptr,
    # sizes
    D, eps,
    # strides (rows)
    stride_x, stride_r, stride_y, stride_h,
    # meta
    BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ORDER: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """One program per row of D features (BLOCK_D >= D: the row stays in registers)."""
    row, offs, mask, w = row_and_weight(w_ptr, D, BLOCK_D, PDL)
    h, y = add_rms_norm(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0), r_ptr + row * stride_r + offs,
                        w, mask, D, eps, HAS_RESIDUAL)
    if HAS_RESIDUAL:                                   # written back for the next layer's residual
        tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    store_row(y_ptr + row * stride_y, y, offs, mask, order_ptr, HAS_ORDER)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             order: torch.Tensor | None = None):
    """x [..., D] (and residual, same shape) -> y, or (y, x + residual); y's column k holds feature order[k]
    where `order` (int32 [D], a permutation) is given."""
    d = x.shape[-1]
    assert weight.shape == (d,) and (residual is None or residual.shape == x.shape)
    assert order is None or (order.shape == (d,) and order.dtype == torch.int32)
    x2, r2, y, h = norm_rows(x, weight, residual)
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, y, h, weight if order is None else order, d, eps,
        x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
        BLOCK_D=block, HAS_RESIDUAL=residual is not None, HAS_ORDER=order is not None,
        num_warps=norm_warps(block), **pdl_launch(device_caps(x.device)))
    return norm_outputs(x, y, h, residual)


def norm_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    """A norm launch's rows (x, residual as [rows, D], unit column stride) and its outputs y and h (h is y without a
    residual), y in the promoted dtype of x and the weight."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    r2 = residual.reshape(-1, d) if residual is not None else x2
    assert x2.stride(-1) == 1 and r2.stride(-1) == 1
    y = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, weight.dtype))
    return x2, r2, y, torch.empty_like(x2) if residual is not None else y


def norm_warps(block: int) -> int:
    """Warps for a row of `block` features held in registers."""
    return min(16, max(1, block // 256))


def norm_outputs(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None):
    """y, or (y, h) with a residual, in x's shape."""
    y = y.reshape(x.shape)
    return y if residual is None else (y, h.reshape(x.shape))

