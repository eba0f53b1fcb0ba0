"""What an engine holds, in bytes: weights per kind and kernel (from the built layers' states), the KV
cache, the activation peak, the CUDA graphs and what is free; `LLM.memory()` returns it.

A weight's bytes are those of the tensors its kernel's state holds (each storage counted once), plus
its bias; `stored_bytes` are the canonical weight's as read from the checkpoint. Kernels that hold a
weight dequantized (the `dequantized` fallback) say by how much they expanded it: bytes / stored_bytes.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from quanta.engine.layers import Embedding, MergedQuantLinear, QuantLinear, RMSNorm
from quanta.quant.qtensor import QTensor

FALLBACK_KERNELS = ("dequantized",)


def held_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages reachable from `obj` (a tensor, QTensor, dataclass, NamedTuple,
    dict, list or tuple of them), each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        key = storage.data_ptr() if storage.data_ptr() else id(storage)
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(obj, QTensor):
        return sum(held_bytes(t, seen) for t in obj.tensors().values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(held_bytes(getattr(obj, f.name), seen) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(held_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v, seen) for v in obj)
    return 0


def linears(model: torch.nn.Module) -> list[QuantLinear]:
    """Every loaded GEMM of the model (the parts of a merged layer as it runs them)."""
    found = []
    for module in model.modules():
        if isinstance(module, MergedQuantLinear):
            continue
        if isinstance(module, QuantLinear) and module.kernel is not None:
            found.append(module)
    return found


def weight_memory(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """{"<scheme> -> <kernel>": {"bytes", "stored_bytes", "layers"[, "expanded_by"]}} for the linear layers,
    plus "embedding <scheme>" and "norms" ({"bytes", "layers"}) entries; "total" sums the bytes held."""
    out: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for layer in linears(model):
        entry = out.setdefault(f"{layer.scheme} -> {layer.kernel.NAME}", {"bytes": 0, "stored_bytes": 0, "layers": 0})
        entry["bytes"] += held_bytes(layer.state, seen) + held_bytes(layer.bias, seen)
        entry["stored_bytes"] += layer.stored_bytes + held_bytes(layer.bias, set())
        entry["layers"] += 1
    for key, entry in out.items():
        if key.rsplit(" -> ", 1)[1] in FALLBACK_KERNELS and entry["stored_bytes"]:
            entry["expanded_by"] = round(entry["bytes"] / entry["stored_bytes"], 2)
    for module in model.modules():
        if isinstance(module, Embedding) and module.table is not None:
            table = module.table
            scheme = table.describe() if hasattr(table, "describe") else f"dense {table.dtype}"
            size = held_bytes(table, seen)
            out[f"embedding {scheme}"] = {"bytes": size, "stored_bytes": module.stored_bytes, "layers": 1}
        elif isinstance(module, RMSNorm):
            entry = out.setdefault("norms", {"bytes": 0, "layers": 0})
            entry["bytes"] += held_bytes(module.weight.data, seen)
            entry["layers"] += 1
    return {"total": sum(e["bytes"] for e in out.values()), **out}


def free_bytes(device: torch.device) -> int:
    """Free memory of `device`: the driver's figure on CUDA, available physical pages on the host."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
