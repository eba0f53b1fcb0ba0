"""Which kernel computes a weight: one table from scheme to candidate kernel modules, tried in order.

`select()` returns the first module that supports the weight, and a reason naming why earlier
candidates were passed over; the engine logs a fallback once and `quanta inspect` shows it. The
interface every kernel module exposes is listed above the table (CANDIDATES).
"""
from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.quant.qtensor import QTensor

log = logging.getLogger(__name__)

# Every kernel module exposes
#     NAME: str
#     supports(weight, device, dtype) -> str | None   None if it can run this weight, else why not
#     prepare(weight, device, dtype) -> state          repack once at load time (kernel layout)
#     apply(x, state, bias) -> y                       y = x @ W.T + bias, x [..., K] -> [..., N]
#     path(state, m) -> (name, reason)                 what runs an M-row input ("triton_affine/gemv"), and why
# and may expose
#     apply_glu(x, state, bias) -> y                   silu(g) * u for [g | u] = x @ W.T + bias, fused
#     apply_rope_store(x, state, bias, rope) -> y|None [q | k | v] = x @ W.T + bias with q and k rotated and k, v
#                                                      stored in the paged caches (rotary.RopeStore), fused; None
#                                                      where this input's kernel cannot
#     compute_dtype(dtype) -> dtype                    what the GEMM's arithmetic runs in for `dtype` activations,
#                                                      where that is not `dtype` itself
#     take_input_order(state) -> (order|None, state)   the order the kernel gathers x's columns in (act-order), and
#                                                      the state that reads x already in it
#
# (weight kind, device type) -> kernel modules, best first. "dense" is a plain torch.Tensor weight.
CANDIDATES: dict[tuple[str, str], tuple[str, ...]] = {
    ("dense", "cpu"): ("quanta.kernels.dense",),
    ("dense", "cuda"): ("quanta.kernels.dense",),
    ("affine", "cpu"): ("quanta.cpu.vnni", "quanta.cpu.int4", "quanta.cpu.int8",
                        "quanta.cpu.rows", "quanta.kernels.dequantized"),
    ("affine", "cuda"): ("quanta.kernels.affine", "quanta.kernels.dequantized"),
    ("gguf", "cpu"): ("quanta.cpu.vnni", "quanta.cpu.int4",                   # Q4_0, Q4_1, Q8_0 at their bytes
                      "quanta.cpu.ggml", "quanta.cpu.int8",                   # on cpu_vnni (else Q4_1 on torch's
                      "quanta.cpu.rows", "quanta.kernels.dequantized"),       # int4); the rest as stored
    ("gguf", "cuda"): ("quanta.kernels.affine", "quanta.kernels.codebook_gemm",    # Q4_0..Q8_0, IQ4_NL (fp16)
                       "quanta.kernels.ggml_gemm", "quanta.kernels.dequantized"),   # converted exactly; the rest
                                                                                    # at their bytes
    ("codebook", "cpu"): ("quanta.cpu.lut", "quanta.cpu.rows", "quanta.kernels.dequantized"),
    ("codebook", "cuda"): ("quanta.kernels.codebook_gemm", "quanta.kernels.dequantized"),
    ("fp8", "cpu"): ("quanta.cpu.lut", "quanta.cpu.rows", "quanta.kernels.dequantized"),
    ("fp8", "cuda"): ("quanta.kernels.fp8_gemm", "quanta.kernels.dequantized"),
}

_warned: set[tuple[str, str]] = set()


def weight_kind(weight: torch.Tensor | QTensor) -> str:
    return weight.kind if isinstance(weight, QTensor) else "dense"


def select(weight: torch.Tensor | QTensor, device: torch.device, dtype: torch.dtype,
           force: str | None = None, avoid: dict[str, str] | None = None) -> tuple[ModuleType, str]:
    """The kernel module for `weight` on `device` computing in `dtype`, and the reason for the choice.

    `force` names a kernel (its NAME) to use for quantized weights regardless of order; it must still
    support the weight. `avoid` maps kernel NAMEs this layer must pass over to the reason (as a caller
    knows what the kernel cannot: the lm_head's size). Plain tensors always run the dense kernel.
    """
    device = torch.device(device)
    if not isinstance(weight, QTensor):
        force = None
    key = (weight_kind(weight), device.type)
    names = CANDIDATES.get(key)
    if names is None:
        raise UnsupportedError(f"no kernel for {key[0]} weights on {key[1]}")
    passed = []
    modules = [importlib.import_module(path) for path in names]
    if force is not None and force not in {m.NAME for m in modules}:
        raise ConfigError(f"kernel {force!r} cannot run {_describe(weight)} on {device.type}; the kernels for "
                          f"these weights are {', '.join(m.NAME for m in modules)} (kernel=None, or 'auto', lets "
                          f"quanta choose)")
    for module in modules:
        if force is not None and module.NAME != force:
            continue
        why_not = (avoid or {}).get(module.NAME) or module.supports(weight, device, dtype)
        if why_not is None:
            reason = "first choice" if not passed else "fallback: " + "; ".join(passed)
            # debug, not info: a fallback is how these weights run here, not news (LLM.kernels() and
            # `quanta inspect` report every choice with its reason)
            if passed and (module.NAME, reason) not in _warned:
                _warned.add((module.NAME, reason))
                log.debug("kernel %s for %s on %s (%s)", module.NAME, _describe(weight), device.type, reason)
            return module, reason
        passed.append(f"{module.NAME}: {why_not}")
    raise UnsupportedError(f"no kernel can run {_describe(weight)} on {device.type} in {dtype}: "
                              + "; ".join(passed))


def _describe(weight: torch.Tensor | QTensor) -> str:
    return weight.describe() if isinstance(weight, QTensor) else f"dense {weight.dtype}"
