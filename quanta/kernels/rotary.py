"""Rotary position embedding (rotate-half, the HF layout) applied to q and k in one launch.

    out[..., :D/2] = x1*cos - x2*sin,   out[..., D/2:] = x2*cos + x1*sin,   angle = position * inv_freq
as engine.layers.RotaryEmbedding computes it (inv_freq already carries any llama3 / linear scaling).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.paged_kv import Fp8Format, fp8_write_constexprs, head_scale, to_cache_codes
from quanta.kernels.triton_support import (
    pdl_launch,
    pdl_launch_dependents,
    pdl_wait,
    tl,
    triton,
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
def _rotated_heads(x_ptr, t, angle, H, HALF_D, stride_xt, stride_xh, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    """Every head of token t of x rotated by the token's angles [1, BLOCK_HALF]: (lo, hi halves, heads, d,
    mask), the halves rounded to x's dtype."""
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (offs_h < H) & (offs_d < HALF_D)
    x_lo = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + offs_d, mask=mask, other=0.0)
    x_hi = tl.load(x_ptr + t * stride_xt + offs_h * stride_xh + HALF_D + offs_d, mask=mask, other=0.0)
    lo, hi = _rotate(x_lo, x_hi, angle)
    return lo, hi, offs_h, offs_d, mask


@triton.jit
def _rotate(lo, hi, angle):
    """Heads' halves (lo, hi, in their 16-bit dtype) rotated by `angle`: in fp32, with cos / sin rounded to the
    dtype as the reference rounds them, the results rounded back to the dtype. The rotary kernel and the GEMV's
    epilogue both rotate here, so their q and caches hold the same bits."""
    cos = tl.cos(angle).to(lo.dtype).to(tl.float32)
    sin = tl.sin(angle).to(lo.dtype).to(tl.float32)
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    return (lo32 * cos - hi32 * sin).to(lo.dtype), (hi32 * cos + lo32 * sin).to(lo.dtype)


@triton.jit
def _store_halves(y_ptr, base, lo, hi, HALF_D, mask):
    tl.store(y_ptr + base, lo.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + HALF_D, hi.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_cache(cache_ptr, scale_ptr, slot, lo, hi, offs_h, offs_d, mask, H, HALF_D,
              FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_REBIAS: tl.constexpr,
              FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr, FP8_MAGIC_BITS: tl.constexpr):
    """Write one token's heads (lo, hi halves) at `slot` of a contiguous [slots, H, D] cache, as
    paged_kv.store writes them (fp8: divided by the head's scale, converted by bit operations)."""
    scale = head_scale(scale_ptr, offs_h, offs_h < H, FP8)
    lo = to_cache_codes(lo, scale, FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    hi = to_cache_codes(hi, scale, FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    _store_halves(cache_ptr, slot * (H * 2 * HALF_D) + offs_h * (2 * HALF_D) + offs_d, lo, hi, HALF_D,
                  mask & (slot >= 0))


@triton.jit
def _rotary_kernel(
    # pointers
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, freq_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,      # STORE_KV only
    # sizes
    HQ, HK, HALF_D,
    # strides (token, head; the last dim is contiguous)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_vt, stride_vh,
    # meta
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, STORE_KV: tl.constexpr = False,
    FP8: tl.constexpr = 0, FP8_MAX: tl.constexpr = 0.0, FP8_SHIFT: tl.constexpr = 0, FP8_REBIAS: tl.constexpr = 0,
    FP8_MIN_NORMAL: tl.constexpr = 0.0, FP8_MAGIC: tl.constexpr = 0.0, FP8_MAGIC_BITS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Program (token, 0) rotates the token's q heads, (token, 1) its k heads: one launch for both.

    STORE_KV: the rotated k and the v heads go straight into the paged caches at slot[token] (< 0: nowhere),
    as paged_kv.store would put them, instead of into ko (the KV store's launch saved)."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs_d, mask=offs_d < HALF_D, other=0.0)
    # (the branches name their tensors apart: Triton types a name across both sides of an if)
    if tl.program_id(1) == 0:
        q_lo, q_hi, q_h, q_d, q_mask = _rotated_heads(q_ptr, t, angle, HQ, HALF_D, stride_qt, stride_qh,
                                                      BLOCK_HQ, BLOCK_HALF)
        _store_halves(qo_ptr, t * stride_qot + q_h * stride_qoh + q_d, q_lo, q_hi, HALF_D, q_mask)
    else:
        k_lo, k_hi, k_h, k_d, k_mask = _rotated_heads(k_ptr, t, angle, HK, HALF_D, stride_kt, stride_kh,
                                                      BLOCK_HK, BLOCK_HALF)
        if STORE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            _to_cache(k_cache_ptr, k_scale_ptr, slot, k_lo, k_hi, k_h, k_d, k_mask, HK, HALF_D, FP8, FP8_MAX,
                      FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
            v_lo = tl.load(v_ptr + t * stride_vt + k_h * stride_vh + k_d, mask=k_mask, other=0.0)
            v_hi = tl.load(v_ptr + t * stride_vt + k_h * stride_vh + HALF_D + k_d, mask=k_mask, other=0.0)
            _to_cache(v_cache_ptr, v_scale_ptr, slot, v_lo, v_hi, k_h, k_d, k_mask, HK, HALF_D, FP8, FP8_MAX,
                      FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
        else:
            _store_halves(ko_ptr, t * stride_kot + k_h * stride_koh + k_d, k_lo, k_hi, HALF_D, k_mask)


def _scale_args(k_scale, v_scale, fmt: Fp8Format | None, unread: torch.Tensor) -> tuple:
    """The caches' scale pointers a launch passes: the fp8 scales, or `unread` (any float32 tensor) for a cache in
    the model dtype, whose kernels never read them."""
    return (k_scale, v_scale) if fmt is not None else (unread, unread)


class RopeStore(NamedTuple):
    """What a GEMM making a token's stacked [q | k | v] row needs to finish it as rotary_and_store would: rotate
    the q and k heads, write k and v into the paged caches at `slot`, and leave only q (rotated) in its output."""
    positions: torch.Tensor               # [T] int64
    inv_freq: torch.Tensor                # [D / 2] float32
    q_size: int                           # query heads x D: the row's first columns
    kv_size: int                          # kv heads x D: k's columns, then v's
    head_dim: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot: torch.Tensor                    # [T] int64, < 0: nowhere
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    fmt: Fp8Format | None

    def kernel_args(self) -> tuple:
        """The epilogue's pointer arguments: positions, frequencies, caches, slots, scales (rope_store_epilogue)."""
        return (self.positions, self.inv_freq, self.k_cache, self.v_cache, self.slot,
                *_scale_args(self.k_scale, self.v_scale, self.fmt, self.inv_freq))


@triton.jit
def rope_store_epilogue(y, y_row, t, col0, N, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr,
                        v_scale_ptr, Q_SIZE, KV_SIZE, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
                        FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_REBIAS: tl.constexpr,
                        FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr, FP8_MAGIC_BITS: tl.constexpr):
    """Finish BLOCK_N float32 columns from col0 of token t's stacked [q | k | v] row (whole heads of HEAD_D, a
    power of two) as the GEMM's output rounded to y's dtype, then rotary_and_store, would: q heads rotated into
    y_row, k heads rotated and v heads as they are into the paged caches at slot[t]. The same arithmetic and
    roundings as the rotary kernel (_rotate, _to_cache), so the caches and q hold the same bits."""
    HEADS: tl.constexpr = BLOCK_N // HEAD_D
    HALF: tl.constexpr = HEAD_D // 2
    DT: tl.constexpr = y_row.dtype.element_ty
    lo, hi = tl.split(tl.permute(tl.reshape(y.to(DT), (HEADS, 2, HALF)), (0, 2, 1)))
    d = tl.arange(0, HALF)[None, :]
    r_lo, r_hi = _rotate(lo, hi, tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + d))
    col = col0 + tl.arange(0, HEADS)[:, None] * HEAD_D              # each head's first column [HEADS, 1]
    is_q = col < Q_SIZE
    is_k = (col >= Q_SIZE) & (col < Q_SIZE + KV_SIZE)
    is_v = (col >= Q_SIZE + KV_SIZE) & (col < N)
    _store_halves(y_row, col + d, r_lo, r_hi, HALF, is_q & (d < HALF))
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = KV_SIZE // HEAD_D
    k_head = tl.where(is_k, (col - Q_SIZE) // HEAD_D, 0)
    _to_cache(k_cache_ptr, k_scale_ptr, slot, r_lo, r_hi, k_head, d, is_k & (d < HALF), hk, HALF, FP8, FP8_MAX,
              FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    v_head = tl.where(is_v, (col - Q_SIZE - KV_SIZE) // HEAD_D, 0)
    _to_cache(v_cache_ptr, v_scale_ptr, slot, lo, hi, v_head, d, is_v & (d < HALF), hk, HALF, FP8, FP8_MAX,
              FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)


def _launch(q, k, qo, ko, positions, inv_freq, store_args: tuple | None, fmt: Fp8Format | None):
    (t, hq, d), hk = q.shape, k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and d % 2 == 0 and inv_freq.numel() == d // 2
    v, k_cache, v_cache, slot, k_scale, v_scale = store_args or (k, qo, qo, positions, inv_freq, inv_freq)
    _rotary_kernel[(t, 2)](q, k, qo, ko, positions, inv_freq, v, k_cache, v_cache, slot, k_scale, v_scale,
                           hq, hk, d // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0),
                           qo.stride(1), ko.stride(0), ko.stride(1), v.stride(0), v.stride(1),
                           BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
                           BLOCK_HALF=triton.next_power_of_2(d // 2), STORE_KV=store_args is not None,
                           **fp8_write_constexprs(fmt), num_warps=4, **pdl_launch(device_caps(q.device)))


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q [T, Hq, D], k [T, Hk, D], positions [T] (int), inv_freq [D/2] float32 -> rotated (q, k)."""
    inv_freq = inv_freq.float().contiguous()
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    _launch(q, k, qo, ko, positions, inv_freq, None, None)
    return qo, ko


def rotary_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     fmt: Fp8Format | None = None) -> torch.Tensor:
    """Rotated q, with the rotated k and v [T, Hk, D] written into the paged caches at `slot` [T] (< 0:
    nowhere) exactly as paged_kv.store(rotated k, v, ...) writes them: one launch instead of two."""
    inv_freq = inv_freq.float().contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:]
    assert v.shape == k.shape and v.stride(-1) == 1 and (fmt is None) == (k_cache.dtype != torch.uint8)
    qo = torch.empty_like(q)
    scales = _scale_args(k_scale, v_scale, fmt, inv_freq)
    _launch(q, k, qo, qo, positions, inv_freq, (v, k_cache, v_cache, slot, *scales), fmt)
    return qo

