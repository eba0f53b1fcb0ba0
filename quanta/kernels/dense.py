"""Plain float weights: torch's own matmul (cuBLAS; on the CPU MKL / oneDNN in batch-invariant row pieces,
cpu/matmul.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quanta.cpu import matmul as cpu_matmul

NAME = "dense"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    return None if isinstance(weight, torch.Tensor) else "not a plain tensor"


def prepare(weight: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(device=device, dtype=dtype)


def apply(x: torch.Tensor, state: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu":
        return cpu_matmul.linear(x, state, bias)
    return F.linear(x, state, bias)


def path(state: torch.Tensor, m: int) -> tuple[str, str]:
    """(NAME, why) at any M: one torch matmul."""
    return NAME, f"{str(state.dtype).removeprefix('torch.')} weight: torch's matmul"
