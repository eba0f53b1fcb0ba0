"""The model's building blocks: QuantLinear (any weight kind, through the kernel registry),
RMSNorm, a (quantized-aware) embedding and rotary position embedding (default, linear, llama3)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quanta.kernels import registry
from quanta.quant.errors import ShapeError, UnsupportedError
from quanta.quant.qtensor import QTensor


class QuantLinear(nn.Module):
    """y = x @ W.T + b for W a plain tensor or any QTensor; the kernel is picked once at load."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.kernel = None
        self.kernel_reason = ""
        self.scheme = "unloaded"
        self.state = None
        self.bias: torch.Tensor | None = None

    def load(self, weight: torch.Tensor | QTensor, bias: torch.Tensor | None, device: torch.device,
             dtype: torch.dtype, name: str = "", force_kernel: str | None = None) -> None:
        """Check the weight's shape, pick its kernel and repack it into the kernel's layout."""
        shape = tuple(weight.shape)
        if shape != (self.out_features, self.in_features):
            raise ShapeError(f"{name}: weight shape {list(shape)} != expected "
                             f"{[self.out_features, self.in_features]}")
        if self.has_bias != (bias is not None):
            raise ShapeError(f"{name}: bias {'missing' if self.has_bias else 'unexpected'}")
        self.kernel, self.kernel_reason = registry.select(weight, device, dtype, force=force_kernel)
        self.scheme = weight.describe() if isinstance(weight, QTensor) else f"dense {weight.dtype}"
        self.state = self.kernel.prepare(weight, device, dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(x, self.state, self.bias)

    def extra_repr(self) -> str:
        kernel = self.kernel.NAME if self.kernel else None
        return f"{self.in_features}->{self.out_features}, {self.scheme}, kernel={kernel}"


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers' LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Embedding(nn.Module):
    """Token embedding over a plain or quantized table; quantized rows are decoded on lookup."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.table: torch.Tensor | QTensor | None = None

    def load(self, weight: torch.Tensor | QTensor, device: torch.device, dtype: torch.dtype) -> None:
        if tuple(weight.shape) != (self.vocab_size, self.dim):
            raise ShapeError(f"model.embed_tokens.weight: shape {list(weight.shape)} != "
                             f"{[self.vocab_size, self.dim]}")
        if isinstance(weight, QTensor) and not hasattr(weight, "take_rows"):
            weight = weight.dequantize(dtype)   # kinds without row access: decode the table once
        self.table = weight.to(device) if isinstance(weight, QTensor) else weight.to(device, dtype)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.table, QTensor):
            return self.table.take_rows(ids.reshape(-1)).dequantize(self.dtype).reshape(*ids.shape, self.dim)
        return F.embedding(ids, self.table)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for default, linear and llama3 RoPE (transformers' formulas)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3" and "low_freq_factor" not in scaling and "freq_factors" in scaling:
        # GGUF rope_freqs: llama.cpp's exact per-frequency divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF layout; GGUF loaders undo ggml's interleaved permutation)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hk, D], positions [T] -> rotated q, k."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
