"""Memory-mapped checkpoint pages given back once their contents live elsewhere.

A tensor read from a safetensors or GGUF file is a view of the file's mapping; every page read stays in the
process's resident set while the mapping lives, though the loader copied it away (merged q/k/v, a repacked or
dequantized weight, a weight moved to the GPU). `release` asks the kernel to page such ranges out
(MADV_PAGEOUT): clean file pages are dropped at once, and a page read again later is simply read back, so the
call never changes a value, only what stays resident. Where the call is unknown (not Linux, older kernels),
nothing happens.
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys

import torch

MADV_PAGEOUT = 21
PAGE = 4096

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _madvise = ctypes.CDLL(None, use_errno=True).madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):      # no libc symbol: leave pages as they are
        _madvise = None


def tensors_of(obj, depth: int = 4) -> list[torch.Tensor]:
    """The tensors inside `obj`: a tensor, a QTensor or other dataclass, a list / tuple / dict of them, or an
    object's attributes (a kernel's prepared state), `depth` levels down."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in tensors_of(item, depth - 1)]


def release(sources, keep=()) -> None:
    """Page out the mapped bytes of the CPU tensors in `sources` (anything tensors_of reads) whose storage none
    of the tensors in `keep` shares (those are still in use where they lie)."""
    if _madvise is None:
        return
    held = {t.untyped_storage().data_ptr() for t in tensors_of(keep) if t.device.type == "cpu"}
    for t in tensors_of(sources):
        if t.device.type != "cpu" or t.untyped_storage().data_ptr() in held:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE     # whole pages inside the tensor only
        if last > first:
            _madvise(first, last - first, MADV_PAGEOUT)
