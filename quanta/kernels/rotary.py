"""Rotary position embedding (rotate-half, the HF layout) applied to q and k in one launch.

    out[..., :D/2] = x1*cos - x2*sin,   out[..., D/2:] = x2*cos + x1*sin,   angle = position * inv_freq
as engine.layers.RotaryEmbedding computes it (inv_freq already carries any llama3 / linear scaling).
"""
from __future__ import annotations

import torch

from quanta.kernels.triton_support import (
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    tl,
    triton,
    use_pdl,
    why_not_device,
)

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
def _rotate_heads(x_ptr, y_ptr, t, angle, H, HALF_D, stride_xt, stride_xh, stride_yt, stride_yh,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate every head of token t of x into y by the token's angles [1, BLOCK_HALF]."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < H) & (offs_d < HALF_D)
    x_lo = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + offs_d, mask=mask, other=0.0)
    x_hi = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + HALF_D + offs_d, mask=mask, other=0.0)
    # --- rotate in fp32 with cos / sin rounded to the dtype as the reference rounds them
    cos = tl.cos(angle).to(x_lo.dtype).to(tl.float32)
    sin = tl.sin(angle).to(x_lo.dtype).to(tl.float32)
    lo, hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    tl.store(y_ptr + t * stride_yt + offs_h * stride_yh + offs_d, (lo * cos - hi * sin).to(x_lo.dtype), mask=mask)
    tl.store(y_ptr + t * stride_yt + offs_h * stride_yh + HALF_D + offs_d, (hi * cos + lo * sin).to(x_lo.dtype),
             mask=mask)


@triton.jit
def _rotary_kernel(
    # pointers
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, freq_ptr,
    # sizes
    HQ, HK, HALF_D,
    # strides (token, head; the last dim is contiguous)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    # meta
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (token, 0) rotates the token's q heads, (token, 1) its k heads: one launch for both."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs_d, mask=offs_d < HALF_D, other=0.0)
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, qo_ptr, t, angle, HQ, HALF_D, stride_qt, stride_qh, stride_qot, stride_qoh,
                      BLOCK_HQ, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, ko_ptr, t, angle, HK, HALF_D, stride_kt, stride_kh, stride_kot, stride_koh,
                      BLOCK_HK, BLOCK_HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D], positions [T] (int), inv_freq [D/2] float32 -> rotated (q, k)."""
    inv_freq = inv_freq.float().contiguous()
    (t, hq, d), hk = q.shape, k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and d % 2 == 0 and inv_freq.numel() == d // 2
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    _rotary_kernel[(t, 2)](q, k, qo, ko, positions, inv_freq, hq, hk, d // 2, q.stride(0), q.stride(1),
                           k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
                           BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                           BLOCK_HALF=triton.next_power_of_2(d // 2), PDL=use_pdl(q.device), num_warps=4,
                           **pdl_launch(q.device))
    return qo, ko


def supports(x: torch.Tensor) -> str | None:
    return why_not_device(x.device, x.dtype, (torch.float16, torch.bfloat16, torch.float32))
