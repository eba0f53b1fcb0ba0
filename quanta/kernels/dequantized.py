"""Any QTensor, dequantized once at load to the compute dtype, then torch's matmul.

The universal fallback and the float oracle of every kernel: exact up to the matmul's own
rounding, but it gives up the memory saving, so the registry names it as a fallback when it runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quanta.kernels import dense
from quanta.quant.qtensor import QTensor

NAME = "dequantized"


def reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(W).T + bias, computed in x's dtype."""
    return F.linear(x, weight.dequantize(x.dtype).to(x.device), bias)


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    return None if isinstance(weight, QTensor) else "not a QTensor"


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(device).dequantize(dtype)


apply = dense.apply         # the state is a plain float weight: dense's matmul, batch-invariant on the CPU


def path(state: torch.Tensor, m: int) -> tuple[str, str]:
    """(NAME, why) at any M: the weight was dequantized at load."""
    return NAME, f"dequantized to {str(state.dtype).removeprefix('torch.')} at load, then torch's matmul"
