"""Symmetric per-channel 8-bit weights on the CPU through torch's `_weight_int8pack_mm`
(W = q_signed * scale[n]): bnb LLM.int8 and channel-wise W8A16 checkpoints stay 8-bit in memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.qtensor import QTensor

NAME = "cpu_int8"


@dataclass
class State:
    codes: torch.Tensor     # int8 [N, K]
    scales: torch.Tensor    # [N] in the compute dtype


def reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What apply() computes, in float32 from the exact weight."""
    return torch.nn.functional.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return "CPU only"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"needs bfloat16 or float32 activations, compute dtype is {dtype}"
    scheme = weight.affine_scheme() if isinstance(weight, QTensor) else None
    if scheme is None:
        return "no exact affine form"
    if scheme.bits != 8 or scheme.num_groups != 1 or scheme.act_order or scheme.zero != "sym" \
            or weight.to_affine().zeros != 128:
        return f"needs symmetric per-channel 8-bit, weight is {weight.describe()}"
    return None


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    a = weight.to_affine()
    codes = (a.codes.to(torch.int16) - 128).to(torch.int8)
    return State(codes.contiguous(), a.effective_scales()[:, 0].to(dtype).contiguous())


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(state.scales.dtype), state.codes, state.scales)
    y = y.reshape(*lead, state.codes.shape[0]).to(x.dtype)
    return y if bias is None else y + bias
