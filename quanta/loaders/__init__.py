"""Checkpoint loaders, one module per family; `load(path)` picks the family with `detect(path)`.
`write(dst, ckpt, fmt)` is the way back: one writer module beside each HF-family reader (WRITERS)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.checkpoint_write import WRITERS, write
from quanta.loaders.detect import detect, gguf_files_in
from quanta.quant.errors import UnsupportedError

# Family (as returned by detect) -> "module:function" of its loader, imported on first use.
LOADERS = {
    "gguf": "quanta.loaders.gguf:load_gguf",
    "hf": "quanta.loaders.hf:load_hf",
    "awq": "quanta.loaders.awq:load_awq",
    "gptq": "quanta.loaders.gptq:load_gptq",
    "bnb": "quanta.loaders.bnb:load_bnb",
    "fp8": "quanta.loaders.fp8:load_fp8",
    "compressed-tensors": "quanta.loaders.compressed_tensors:load_compressed_tensors",
}


def load(path: str | Path, **kw: Any) -> Checkpoint:
    """Load the checkpoint at `path` (file or directory) with the loader of its detected family.

    Keyword arguments go to the family's loader (e.g. `allow_pickle=True` for hf). UnsupportedError
    naming the family when no loader for it exists yet.
    """
    path = Path(path)
    family = detect(path)
    if family not in LOADERS:
        raise UnsupportedError(f"{path}: detected a {family!r} checkpoint, but quanta has no {family} loader yet "
                               f"(available: {', '.join(sorted(LOADERS))})")
    if family == "gguf" and path.is_dir():
        path = gguf_files_in(path)[0]
    module, _, function = LOADERS[family].partition(":")
    return getattr(importlib.import_module(module), function)(path, **kw)


__all__ = ["Checkpoint", "LOADERS", "WRITERS", "detect", "load", "write"]
