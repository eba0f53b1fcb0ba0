"""Round-to-nearest into the canonical `Affine` kind, in the two conventions checkpoints are made with.

    rtn_affine(w [N, K] float, bits, group_size, symmetric, convention=None) -> Affine

Conventions, each the reference tool's formula per group of `group_size` input columns: "awq" (awq_params) and
"gptq" (gptq_params); codes = clamp(round(w / scale) + zero, 0, 2^b - 1). The default convention is "awq" for
asymmetric and "gptq" for symmetric weights (what each tool ships). `group_size` -1 (or K) means one group per
output row (per-channel).
"""
from __future__ import annotations

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ConfigError
from quanta.quant.kinds.affine import Affine

CONVENTIONS = ("awq", "gptq")


def check_scheme(name: str, shape: tuple[int, int], bits: int, group_size: int) -> int:
    """The effective group size for a weight `name` of `shape`, or ConfigError naming what is wrong."""
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ConfigError(f"{name}: bits must be an integer 2..8, got {bits!r}")
    k = shape[1]
    group = k if group_size in (-1, 0, None) else group_size
    if not isinstance(group, int) or group <= 0:
        raise ConfigError(f"{name}: group_size must be -1 (per channel) or a positive integer, got {group_size!r}")
    if k % group:
        raise ConfigError(f"{name}: in_features {k} is not divisible by group_size {group} "
                          f"(use a divisor of {k} or -1 for per-channel)")
    return group


def gptq_params(x: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ `find_params` over the rows of x [R, C]: (scale [R], zero [R]) as floats.

    The range always contains 0 (xmin = min(min, 0), xmax = max(max, 0)); an all-zero group gets [-1, 1].
        asym: scale = (xmax - xmin) / (2^b - 1),          zero = round(-xmin / scale)
        sym:  xmax = max(|xmin|, xmax), xmin = -xmax where xmin < 0, scale = (xmax - xmin) / (2^b - 1),
              zero = 2^(b-1)"""
    maxq = 2 ** bits - 1
    zero_t = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    xmin = torch.minimum(x.min(1)[0], zero_t)
    xmax = torch.maximum(x.max(1)[0], zero_t)
    if symmetric:
        xmax = torch.maximum(xmin.abs(), xmax)
        neg = xmin < 0
        xmin[neg] = -xmax[neg]
    empty = (xmin == 0) & (xmax == 0)
    xmin[empty] = -1
    xmax[empty] = 1
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if symmetric else torch.round(-xmin / scale)
    return scale, zero


def awq_params(x: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ `pseudo_quantize_tensor`'s (scale [R], zero [R]) over the rows of x [R, C], as floats.

        asym: scale = max(max - min, 1e-5) / (2^b - 1),  zero = clamp(-round(min / scale), 0, 2^b - 1)
        sym:  scale = max(absmax, 1e-5) / (2^(b-1) - 1), codes = round(w / scale) + 2^(b-1) in [0, 2^b - 1]"""
    if symmetric:
        scale = x.abs().amax(dim=1).clamp(min=1e-5) / (2 ** (bits - 1) - 1)
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    maxq = 2 ** bits - 1
    max_val, min_val = x.amax(dim=1), x.amin(dim=1)
    scale = (max_val - min_val).clamp(min=1e-5) / maxq
    zero = (-torch.round(min_val / scale)).clamp_(0, maxq)
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """codes = clamp(round(x / scale) + zero, 0, 2^b - 1) with scale/zero broadcast over x (float result)."""
    return torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1)


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, symmetric: bool, convention: str = "awq") -> torch.Tensor:
    """Quantize-dequantize w [..., K] in groups along the last dim (the tools' `pseudo_quantize_tensor`)."""
    shape = w.shape
    x = w.reshape(-1, group_size if group_size > 0 else shape[-1])
    params = awq_params if convention == "awq" else gptq_params
    scale, zero = params(x, bits, symmetric)
    scale, zero = scale.unsqueeze(1), zero.unsqueeze(1)
    return ((quantize_codes(x, scale, zero, bits) - zero) * scale).reshape(shape)


def rtn_affine(w: torch.Tensor, bits: int, group_size: int = -1, symmetric: bool = False,
               convention: str | None = None, name: str = "weight") -> Affine:
    """Round-to-nearest of w [N, K] into an `Affine` (awq_params / gptq_params give the formulas).

    Symmetric weights store their implicit zero 2^(b-1) as the int `zeros`; asymmetric ones a uint8
    zero per group. ConfigError (naming `name`) for bits outside 2..8 or K not divisible by the group.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ConfigError(f"{name}: RTN needs a 2-D float weight, got {w.dtype} {list(w.shape)}")
    convention = convention or ("gptq" if symmetric else "awq")
    if convention not in CONVENTIONS:
        raise ConfigError(f"{name}: convention must be one of {CONVENTIONS}, got {convention!r}")
    group = check_scheme(name, tuple(w.shape), bits, group_size)
    n, k = w.shape
    params = awq_params if convention == "awq" else gptq_params
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // group, dtype=torch.float32, device=w.device)
    zeros = torch.empty(n, k // group, dtype=torch.uint8, device=w.device)
    step = chunk_rows(k, w.device)
    for r in range(0, n, step):                 # a block of rows at a time: bounded float32 scratch
        x = w[r:r + step].float().reshape(-1, group)
        scale, zero = params(x, bits, symmetric)
        codes[r:r + step] = quantize_codes(x, scale.unsqueeze(1), zero.unsqueeze(1), bits).reshape(-1, k)
        scales[r:r + step] = scale.reshape(-1, k // group)
        zeros[r:r + step] = zero.reshape(-1, k // group)
    return Affine(codes=codes, scales=scales, bits=bits, group_size=group,
                  zeros=2 ** (bits - 1) if symmetric else zeros)
