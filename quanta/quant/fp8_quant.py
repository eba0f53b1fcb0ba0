"""FP8 (e4m3) quantization into the `Fp8` kind, with compressed-tensors' / vLLM's conventions.

    fp8_weight(w [N, K], strategy="tensor"|"channel", input_scale=None) -> Fp8
    amax_scale(amax) -> float32 scale             scale = max(amax, 0) / 448, at least float32 eps
    AmaxObserver(): .observe(x) ... .scale()     running absolute max of calibration tensors
"""
from __future__ import annotations

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ConfigError
from quanta.quant.kinds.fp8 import Fp8

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)     # 448
STRATEGIES = ("tensor", "channel")


def amax_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The e4m3 scale (float32) for values whose absolute max is `amax` (per tensor or per row).

    compressed-tensors `calculate_qparams` (symmetric FLOAT, 8 bits): scale = max(|min|, |max|) / 448
    (the range always contains 0), clamped to float32 eps. A static activation scale (W8A8 static) and the
    per-layer KV-cache scales (k_scale, v_scale) are the same formula over the calibration amax; dynamic
    activation quantization stores no input_scale."""
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return torch.clamp(amax.clamp(min=0) / E4M3_MAX, min=torch.finfo(torch.float32).eps)


def fp8_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale clamped to the e4m3 range and cast to float8_e4m3fn (scale broadcastable to x): compressed-tensors
    `_quantize`, clamp(w / scale, -448, 448), then a cast to float8_e4m3fn (round to nearest even)."""
    return torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_weight(w: torch.Tensor, strategy: str = "tensor", input_scale: torch.Tensor | None = None,
               name: str = "weight") -> Fp8:
    """w [N, K] as an e4m3 `Fp8` with one scale per tensor or per output row (channel).

    `input_scale` (a float32 scalar from calibration) makes it W8A8-static; None is dynamic.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"{name}: FP8 weight strategy must be one of {STRATEGIES}, got {strategy!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ConfigError(f"{name}: FP8 needs a 2-D float weight, got {w.dtype} {list(w.shape)}")
    blocks = range(0, w.shape[0], chunk_rows(w.shape[1], w.device))      # bounded float32 scratch
    step = blocks.step
    if strategy == "tensor":
        scale = amax_scale(torch.stack([w[r:r + step].float().abs().max() for r in blocks]).max())
    else:
        scale = torch.cat([amax_scale(w[r:r + step].float().abs().amax(dim=1)) for r in blocks])
    data = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    for r in blocks:
        data[r:r + step] = fp8_cast(w[r:r + step], scale if strategy == "tensor" else scale[r:r + step].unsqueeze(1))
    if input_scale is not None:
        input_scale = torch.as_tensor(input_scale, dtype=torch.float32).reshape(())
    return Fp8(data=data, scale=scale, input_scale=input_scale)


class AmaxObserver:
    """The running absolute maximum of every tensor observed (activations, k or v), for static scales."""

    def __init__(self):
        self.amax = torch.zeros((), dtype=torch.float32)

    def observe(self, x: torch.Tensor) -> None:
        """Fold the absolute max of x into the running maximum."""
        self.amax = torch.maximum(self.amax, x.detach().abs().max().float().cpu())

    def scale(self) -> torch.Tensor:
        """The e4m3 scale (float32 scalar) of everything observed so far."""
        return amax_scale(self.amax)
