"""Shared by the kernel tests: interpreter set-up, device, random weights, the tolerance table.

Importing this module before any quanta.kernels Triton module makes the kernels run under Triton's
interpreter on a machine without CUDA (the flag is read when the kernels are decorated).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# relative error ||y - ref|| / ||ref|| against a float64 oracle, per compute dtype
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
WEIRD = (3, 73, 92, 213, 423)        # Liger's odd sizes


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(y).any(), "NaN in the output"
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def interpreter_bf16_dot() -> bool:
    """Triton 3.9's interpreter computes bf16 tl.dot wrongly (checked: a 16x16 product is off by 1e10);
    GPU runs cover those cases."""
    return DEVICE == "cpu"


def bf16_rounds_to_nearest() -> bool:
    """Triton 3.9's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): bit-exact bf16
    comparisons hold only on a GPU."""
    return DEVICE == "cuda"


def cpu_4bit_kernel() -> tuple[str, str]:
    """(kernel, compute dtype) that runs plain 4-bit groups on this CPU: cpu_vnni on its 8-bit activation blocks
    where the CPU has AVX512-VNNI or AVX2 (and a C compiler), else torch's int4 GEMM at bfloat16 input."""
    from quanta.cpu import vnni
    if vnni._library() is not None and vnni._library().quanta_vnni_available():
        return "cpu_vnni", "int8"
    return "cpu_int4", "bfloat16"
