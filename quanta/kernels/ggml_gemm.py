"""GGUF K-quant and IQ4 weights (and the 32-value types) times fp16/bf16 activations, read at their file's bytes.

`prepare()` moves each block field into a plane of its own (ggml/layout.py: the same bytes, permuted, nothing
decoded); `apply` takes its path by M from the ggml plan (ggml/plan.py): a GEMV for a few rows, a tl.dot GEMM
above, both decoding the blocks in registers. The registry tries the affine kernels first for Q4_0..Q8_0.
"""
from __future__ import annotations

import torch

from quanta.kernels.dequantized import reference  # noqa: F401  (the oracle)
from quanta.kernels.device_caps import device_caps
from quanta.kernels.ggml import layout, plan
from quanta.kernels.ggml.layout import GgmlState
from quanta.kernels.rotary import RopeStore
from quanta.kernels.triton_support import why_not_device
from quanta.quant.kinds.gguf import Gguf

NAME = "triton_ggml"


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the kernels decode the weight's GGML type and the device computes in `dtype`, else why not."""
    if not isinstance(weight, Gguf):
        return "not a gguf weight"
    return layout.why_not(weight, weight.type) or why_not_device(device, dtype)


def prepare(weight: Gguf, device: torch.device, dtype: torch.dtype) -> GgmlState:
    """The weight's blocks in plane layout on `device`: the file's bytes, no 16-bit copy."""
    return layout.prepare(weight, device, dtype)


def apply(x: torch.Tensor, state: GgmlState, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias by the path the plan gives x's rows."""
    return plan.matmul(x, state, bias)


def apply_glu(x: torch.Tensor, state: GgmlState, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for a weight stacking [gate; up]: made in the GEMV's epilogue where it can (plan.matmul_glu)."""
    return plan.matmul_glu(x, state, bias)


def apply_rope_store(x: torch.Tensor, state: GgmlState, bias: torch.Tensor | None,
                     rope: RopeStore) -> torch.Tensor | None:
    """x @ W.T + bias for W = [q; k; v] with q and k rotated and k, v stored in the paged caches by the GEMV's
    epilogue; None where the planned path has no such epilogue (plan.matmul_rope)."""
    return plan.matmul_rope(x, state, bias, rope)


def apply_rows(x: torch.Tensor, states: list[GgmlState], bias: torch.Tensor | None = None,
               rope: RopeStore | None = None) -> torch.Tensor | None:
    """x @ W.T + bias for W stacking the weights `states` (of different types: a mixed file's q/k/v) in one launch,
    with apply_rope_store's epilogue where `rope` is given; None where no path runs them together (plan.matmul_pair:
    two weights, one row), and the caller runs each."""
    return plan.matmul_pair(x, *states, bias, rope) if len(states) == 2 else None


def path(state: GgmlState, m: int) -> tuple[str, str]:
    """(NAME/the path that runs an M-row input on the state's device, why)."""
    name, reason = plan.explain(state, device_caps(state.planes[0].device), m)
    return f"{NAME}/{name}", reason
