"""What the CPU kernels of affine weights (cpu_int4, cpu_int8: torch's packed-integer GEMMs) share: the oracle,
the checks before a weight's affine scheme, and the end of apply()."""
from __future__ import annotations

import torch

from quanta.quant.ggml.blocks import q4_k_affine
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import AffineScheme, QTensor

DTYPES = (torch.bfloat16, torch.float32)        # the activations torch's CPU integer GEMMs take


def reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What apply() computes, in float32 from the exact weight."""
    return torch.nn.functional.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


def cpu_scheme(weight, device: torch.device, dtype: torch.dtype) -> tuple[AffineScheme | None, str | None]:
    """(the weight's exact affine scheme, None) where a CPU integer kernel may take it, else (None, why not)."""
    if torch.device(device).type != "cpu":
        return None, "CPU only"
    if dtype not in DTYPES:
        return None, f"computes in bfloat16 or float32, not {dtype}"
    if _is_q4_k(weight):
        return AffineScheme(4, 32, weight.shape[1] // 32, False, "float"), None
    scheme = weight.affine_scheme() if isinstance(weight, QTensor) else None
    return (scheme, None) if scheme is not None else (None, "no exact affine form")


def affine_form(weight: QTensor) -> Affine:
    """The exactly equal Affine form a CPU integer kernel repacks: the weight's own (to_affine), or for GGUF
    Q4_K its sub-blocks as groups of 32 with float32 scales and mins. Q4_K is the CPU's alone: a GPU kernel
    reads its blocks as stored, where float32 scales would cost a third more bytes than the file."""
    if not _is_q4_k(weight):
        return weight.to_affine()
    n, k = weight.shape
    codes, scales, mins = q4_k_affine(weight.data.reshape(-1, weight.type.type_size))
    return Affine(codes=codes.view(n, k), scales=scales.view(n, k // 32), bits=4, group_size=32,
                  mins=mins.view(n, k // 32), shape=(n, k))


def _is_q4_k(weight) -> bool:
    return isinstance(weight, Gguf) and weight.type.name == "q4_K"


def finish(y: torch.Tensor, lead: torch.Size, n: int, dtype: torch.dtype,
           bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM's [rows, N] output as [*lead, N] in the activations' dtype, plus the bias."""
    if bias is None and len(lead) == 1 and y.dtype == dtype:
        return y                                # already it (a step's rows in float32): no call on the hot path
    y = y.reshape(*lead, n).to(dtype)
    return y if bias is None else y + bias


def path(name: str, state_bits: int) -> tuple[str, str]:
    """(name, why) of a CPU integer kernel at any M."""
    return name, f"{state_bits}-bit codes kept packed: torch's CPU int{state_bits} GEMM"
