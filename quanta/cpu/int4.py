"""4-bit affine weights on the CPU through torch's own int4 kernel (`_weight_int4pack_mm_for_cpu`,
the one torchao and gpt-fast use): weights stay packed at 4 bits, activations in bfloat16.

torch's format computes W = (q - 8) * scale + zero with float zeros, so every affine form maps
onto it exactly in real arithmetic: integer zeros z give zero = (8 - z) * s, float mins m give
zero = m + 8 * s. Scales and zeros are then held in bfloat16, the kernel's only accepted dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.cpu import affine as cpu_affine, ggml as cpu_ggml
from quanta.cpu.affine import reference  # noqa: F401  (the oracle)
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor

NAME = "cpu_int4"
GROUP_SIZES = (32, 64, 128, 256)


@dataclass
class State:
    packed: torch.Tensor           # uint8, torch's CPU int4 tile layout
    scales_zeros: torch.Tensor     # bf16 [K / group, N, 2]
    group_size: int
    out_features: int


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    scheme, why_not = cpu_affine.cpu_scheme(weight, device, dtype)
    if why_not is not None:
        return why_not
    n, k = weight.shape
    if scheme.bits != 4 or scheme.act_order:
        return f"needs plain 4-bit groups, weight is {weight.describe()}"
    if scheme.group_size not in GROUP_SIZES or k % scheme.group_size:
        return f"group size {scheme.group_size} with K={k} (needs one of {GROUP_SIZES} dividing K)"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    held = n * k // 2 + 4 * n * (k // scheme.group_size)
    if isinstance(weight, Gguf) and held > weight.nbytes and cpu_ggml.supports(weight, device, dtype) is None:
        return (f"cpu_ggml holds its blocks at their {weight.nbytes} bytes; the packed form would hold {held} "
                f"(a bfloat16 scale and zero a group of {scheme.group_size})")
    return None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the GEMM's arithmetic runs in for activations of `dtype`: torch's int4 kernel is fast only
    at bfloat16 input (its float32 and float16 paths are reference loops), so inputs are rounded to it."""
    return torch.bfloat16


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    a = cpu_affine.affine_form(weight)
    scales = a.effective_scales()
    if a.mins is not None:
        zero = a.mins.float() + 8 * scales
    elif isinstance(a.zeros, torch.Tensor):
        zero = (8 - a.zeros.float()) * scales
    else:
        zero = (8 - float(a.zeros)) * scales
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(a.codes.to(torch.int32), 1)
    scales_zeros = torch.stack([scales.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()
    return State(packed, scales_zeros, a.group_size, a.shape[0])


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.reshape(-1, x.shape[-1]).to(torch.bfloat16), state.packed, state.group_size, state.scales_zeros)
    return cpu_affine.finish(y, x.shape[:-1], state.out_features, x.dtype, bias)


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return cpu_affine.path(NAME, 4)
