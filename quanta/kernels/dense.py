"""Plain float weights: torch's own matmul (cuBLAS / MKL / oneDNN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "dense"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    return None if isinstance(weight, torch.Tensor) else "not a plain tensor"


def prepare(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(device=device, dtype=dtype)


def apply(x: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, state, bias)


def path(state: torch.Tensor, m: int) -> tuple[str, str]:
    """(NAME, why) at any M: one torch matmul."""
    return NAME, f"{str(state.dtype).removeprefix('torch.')} weight: torch's matmul"
