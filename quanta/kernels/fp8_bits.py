"""FP8 bytes to fp16 with integer operations only, so FP8 data runs on chips without FP8 units (sm75, sm80).

Triton rejects the e4m3 type below sm89, so weights (and, later, the paged KV cache) are kept as uint8 and
converted here: e4m3 (bias 7) -> fp16 (bias 15) moves sign and magnitude into place and multiplies by
2**8; e5m2 is the top byte of an fp16. Both are exact for every finite value, subnormals included.
e4m3fn's NaN (0x7F / 0xFF) is not preserved; checkpoints hold no NaN weights.
"""
from __future__ import annotations

import torch

from quanta.kernels.triton_support import tl, triton


def e4m3_to_f16_reference(b: torch.Tensor) -> torch.Tensor:
    """The same bit operations in torch (uint8 -> float16), for tests and CPU fallbacks."""
    b = b.to(torch.int32)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(torch.int16).view(torch.float16) * 256.0


def e5m2_to_f16_reference(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 8).to(torch.int16).view(torch.float16)


@triton.jit
def e4m3_to_f16(b):
    """Byte values b (any int tensor, 0..255) read as float8_e4m3fn, returned as float16."""
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def e5m2_to_f16(b):
    """Byte values b (any int tensor, 0..255) read as float8_e5m2, returned as float16."""
    return (b << 8).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_to_f16(b, FMT: tl.constexpr):
    """FMT 0: e4m3fn, 1: e5m2."""
    if FMT == 0:
        return e4m3_to_f16(b)
    else:
        return e5m2_to_f16(b)
