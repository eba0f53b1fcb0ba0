"""Rotary position embedding (rotate-half, the HF layout) applied to q and k in one launch.

    out[..., :D/2] = x1*cos - x2*sin,   out[..., D/2:] = x2*cos + x1*sin,   angle = position * inv_freq
as engine.layers.RotaryEmbedding computes it (inv_freq already carries any llama3 / linear scaling).
"""
from __future__ import annotations

import torch

from quanta.kernels.triton_support import tl, triton, why_not_device

NAME = "triton_rotary"


def reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D], positions [T], inv_freq [D/2] -> rotated (q, k)."""
    cos, sin = cos_sin(positions, inv_freq, q.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin [T, 1, D] of every position's angles, rounded to `dtype` (shared by every layer)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, H, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@triton.jit
def _rotary_kernel(
    # pointers
    x_ptr, y_ptr, pos_ptr, freq_ptr,
    # sizes
    H, HALF_D,
    # strides (token, head; the last dim is contiguous)
    stride_xt, stride_xh, stride_yt, stride_yh,
    # meta
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program per token: every head of x at once (angles computed once, shared by the heads)."""
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < H) & (offs_d < HALF_D)
    # --- angles for this token, rounded to the dtype as the reference does
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs_d, mask=offs_d < HALF_D, other=0.0)
    x_lo = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + offs_d, mask=mask, other=0.0)
    x_hi = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + HALF_D + offs_d, mask=mask, other=0.0)
    cos = tl.cos(angle).to(x_lo.dtype).to(tl.float32)
    sin = tl.sin(angle).to(x_lo.dtype).to(tl.float32)
    # --- rotate in fp32 with cos / sin rounded to the dtype as the reference rounds them
    lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    y_lo = (lo * cos - hi * sin).to(x_lo.dtype)
    y_hi = (hi * cos + lo * sin).to(x_lo.dtype)
    tl.store(y_ptr + t * stride_yt + offs_h * stride_yh + offs_d, y_lo, mask=mask)
    tl.store(y_ptr + t * stride_yt + offs_h * stride_yh + HALF_D + offs_d, y_hi, mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    assert x.stride(-1) == 1 and d % 2 == 0 and inv_freq.numel() == d // 2
    y = torch.empty_like(x)
    _rotary_kernel[(t,)](x, y, positions, inv_freq, h, d // 2, x.stride(0), x.stride(1), y.stride(0),
                         y.stride(1), BLOCK_H=triton.next_power_of_2(h),
                         BLOCK_HALF=triton.next_power_of_2(d // 2), num_warps=4)
    return y


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D], positions [T] (int), inv_freq [D/2] float32 -> rotated (q, k)."""
    inv_freq = inv_freq.float().contiguous()
    return _rotate(q, positions, inv_freq), _rotate(k, positions, inv_freq)


def supports(x: torch.Tensor) -> str | None:
    return why_not_device(x.device, x.dtype, (torch.float16, torch.bfloat16, torch.float32))
