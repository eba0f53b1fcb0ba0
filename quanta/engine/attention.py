"""Attention over a KV cache, behind one seam: the model hands q, k, v of a step's tokens to an
attention context, which stores k, v and returns the attention output. The model never sees the
cache layout; the contiguous per-sequence cache below is the simple CPU/oracle implementation."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quanta.quant.errors import ConfigError


def attention_mask(q_pos: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Bool [T, S]: query at position q_pos[t] may attend key position s (causal, optional window)."""
    s = torch.arange(kv_len, device=q_pos.device)[None, :]
    allowed = s <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= s > q_pos[:, None] - sliding_window
    return allowed


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                        scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [T, Hq, D] against k, v [S, Hk, D] holding positions 0..S-1 -> [T, Hq, D] (GQA by repeat)."""
    groups = q.shape[1] // k.shape[1]
    mask = attention_mask(q_pos, k.shape[0], sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(groups, 0),
        v.transpose(0, 1).repeat_interleave(groups, 0), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


class ContiguousKVCache:
    """One sequence's K/V for every layer in preallocated [max_len, Hk, D] tensors."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, sliding_window: int | None = None):
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len, self.sliding_window = max_len, sliding_window
        self.positions: torch.Tensor | None = None   # positions of the step being run

    def begin_step(self, positions: torch.Tensor) -> None:
        """Set the positions of this step's tokens (contiguous, continuing the cached ones)."""
        if int(positions[-1]) >= self.max_len:
            raise ConfigError(f"sequence length {int(positions[-1]) + 1} exceeds max_model_len={self.max_len}")
        self.positions = positions

    def fork(self) -> ContiguousKVCache:
        """An independent copy (for the n > 1 samples of one prompt)."""
        clone = ContiguousKVCache.__new__(ContiguousKVCache)
        clone.k, clone.v = self.k.clone(), self.v.clone()
        clone.max_len, clone.sliding_window, clone.positions = self.max_len, self.sliding_window, self.positions
        return clone

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this step's k, v for `layer` and attend q over everything cached so far."""
        start, end = int(self.positions[0]), int(self.positions[-1]) + 1
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return reference_attention(q, self.k[layer, :end], self.v[layer, :end], self.positions, scale,
                                   self.sliding_window)
