"""Symmetric per-channel 8-bit weights on the CPU through torch's `_weight_int8pack_mm`
(W = q_signed * scale[n]): bnb LLM.int8 and channel-wise W8A16 checkpoints stay 8-bit in memory."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.kernels.cpu import affine as cpu_affine
from quanta.kernels.cpu.affine import reference  # noqa: F401  (the oracle)
from quanta.quant.qtensor import QTensor

NAME = "cpu_int8"


@dataclass
class State:
    codes: torch.Tensor     # int8 [N, K]
    scales: torch.Tensor    # [N] in the compute dtype


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    scheme, why_not = cpu_affine.cpu_scheme(weight, device, dtype)
    if why_not is not None:
        return why_not
    if scheme.bits != 8 or scheme.num_groups != 1 or scheme.act_order or scheme.zero != "sym" \
            or cpu_affine.affine_form(weight).zeros != 128:
        return f"needs symmetric per-channel 8-bit, weight is {weight.describe()}"
    return None


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    a = cpu_affine.affine_form(weight)
    codes = (a.codes.to(torch.int16) - 128).to(torch.int8)
    return State(codes.contiguous(), a.effective_scales()[:, 0].to(dtype).contiguous())


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(state.scales.dtype), state.codes, state.scales)
    return cpu_affine.finish(y, x.shape[:-1], state.codes.shape[0], x.dtype, bias)


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return cpu_affine.path(NAME, 8)
