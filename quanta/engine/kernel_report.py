"""What runs each GEMM of a built model, for each M (tokens in a step): the answer `LLM.kernels()` gives
and `quanta inspect` prints, read from the layers as they were loaded, so it cannot differ from what runs.

A kernel module may declare, besides the registry's interface,
    path(state, m) -> (path_name, reason)      which of its paths runs at M rows, and why
    compute_dtype(dtype) -> dtype              what its arithmetic runs in for activations of `dtype`
Without them, the module itself is the one path (with the registry's reason) and computes in the
layer's dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.engine.layers import MergedQuantLinear, QuantLinear
from quanta.engine.model_loader import weight_modules


class KernelPath(NamedTuple):
    path: str
    reason: str


def gemm_layers(model: torch.nn.Module) -> list[tuple[str, QuantLinear]]:
    """(name, layer) of every GEMM as it runs, in model order, the lm_head last. Merged projections are
    one row named by their parts, e.g. `model.layers.0.self_attn.q_proj+k_proj+v_proj`."""
    rows = []
    for name, module in weight_modules(model):
        if isinstance(module, MergedQuantLinear):
            parent = name.rsplit(".", 1)[0]
            rows += [(f"{parent}.{parts}", layer) for parts, layer in module.linears()]
        elif isinstance(module, QuantLinear):
            rows.append((name, module))
    return rows


def layer_paths(layer: QuantLinear, ms: tuple[int, ...]) -> dict[int, KernelPath]:
    """The path of `layer`'s kernel at each M."""
    path = getattr(layer.kernel, "path", None)
    if path is None:
        return {m: KernelPath(layer.kernel.NAME, layer.kernel_reason) for m in ms}
    return {m: KernelPath(*path(layer.state, m)) for m in ms}


def compute_dtype(layer: QuantLinear) -> torch.dtype:
    """What `layer`'s GEMM arithmetic runs in."""
    return layer.compute_dtype()


def kernel_report(model: torch.nn.Module, ms: tuple[int, ...] = (1, 16, 256)) -> list[dict]:
    """Per GEMM: name, shape [N, K], scheme, dtype (its activations), compute_dtype, kernel and the
    registry's reason for it, and paths {M: KernelPath(path, reason)}."""
    return [{"name": name, "shape": [layer.out_features, layer.in_features], "scheme": layer.scheme,
             "dtype": dtype_name(layer.dtype), "compute_dtype": dtype_name(compute_dtype(layer)),
             "kernel": layer.kernel.NAME, "reason": layer.kernel_reason, "paths": layer_paths(layer, ms)}
            for name, layer in gemm_layers(model)]


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")
