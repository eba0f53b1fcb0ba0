"""Affine integer weights (AWQ, GPTQ, RTN, HQQ, bnb int8, GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) times fp16/bf16
activations, dequantized in registers: the registry's kernel module for affine weights on CUDA.

    layout   the kernel layout (AffineState, prepare, pack) and the decoding every path shares
    gemv     M = 1..2, no tensor cores                    mma     the decoded weight as the MMA's register operand
    splitk   the split-K tl.dot GEMM                      wgmma   Gluon, one asynchronous wgmma per code (sm90)
    cublas   dequantize + cuBLAS                          plan    which path runs M rows, from DeviceCaps
The path modules import only `layout` and the Triton helpers; `plan` imports them.
"""
from __future__ import annotations

import dataclasses

import torch

from quanta.kernels.affine import layout, plan
from quanta.kernels.affine.layout import AffineState
from quanta.kernels.dequantized import reference  # noqa: F401  (the oracle of every path)
from quanta.kernels.device_caps import device_caps
from quanta.kernels.lora_epilogue import LoRAEpilogue
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import why_not_device

NAME = "triton_affine"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the weight has an exact affine form these kernels pack and the device computes in `dtype`."""
    return layout.why_not(weight) or why_not_device(device, dtype)


def prepare(weight, device: torch.device, dtype: torch.dtype) -> AffineState:
    """The weight in kernel layout (layout.prepare): GGUF blocks converted losslessly, no 16-bit copy."""
    return layout.prepare(weight, device, dtype)


def apply(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None = None,
          lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y = x @ W.T + bias by the path the plan gives x's rows; `lora`: adapter products the GEMV's epilogue adds
    (where lora_fuses says it runs)."""
    return plan.matmul(x, state, bias, lora=lora)


def lora_fuses(state: AffineState, m: int) -> bool:
    """Whether m rows run on a path whose epilogue adds LoRA products (the GEMV; plan.lora_fuses)."""
    return plan.lora_fuses(state, m)


def apply_glu(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None = None,
              lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """silu(gate) * up for a weight stacking [gate; up], fused into the GEMV's epilogue where the GEMV runs."""
    return plan.matmul_glu(x, state, bias, lora)


def apply_rope_store(x: torch.Tensor, state: AffineState, bias: torch.Tensor | None,
                     rope: RopeStore, lora: LoRAEpilogue | None = None) -> torch.Tensor | None:
    """x @ W.T + bias for W = [q; k; v] with q and k rotated and k, v stored in the paged caches by the GEMV's
    epilogue; None where the planned path is not such a GEMV (plan.matmul_rope)."""
    return plan.matmul_rope(x, state, bias, rope, lora)


def take_input_order(state: AffineState) -> tuple[torch.Tensor | None, AffineState]:
    """(perm, the state without it) for an act-order weight, whose sorted columns read x[:, perm] (every path
    gathers x through perm, tile by tile): the caller then passes x[:, perm] itself, made where x is made, and
    the kernels read it in order. (None, state) where the columns are in the model's order."""
    if state.perm is None:
        return None, state
    return state.perm, dataclasses.replace(state, perm=None)


def path(state: AffineState, m: int) -> tuple[str, str]:
    """(NAME/the path that runs an M-row input on the state's device, why)."""
    name, reason = plan.explain(state, device_caps(state.packed.device), m)
    return f"{NAME}/{name}", reason
