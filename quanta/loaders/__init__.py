"""Checkpoint I/O, one module (or folder: gguf/) per family, reader and writer side by side; the format
table (formats.FORMATS) says which is which. `load(path)` reads with the family `detect(path)` finds,
`write(dst, ckpt, fmt)` writes with the family's writer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from quanta.loaders.formats import FORMATS, get, resolve, writable
from quanta.quant.errors import UnsupportedError


def __getattr__(name):
    # Checkpoint and detect bring torch and the GGUF reader: imported when first asked for, so that the table
    # (formats.py) and the command line's argument parsing stay light
    if name == "Checkpoint":
        from quanta.loaders.checkpoint import Checkpoint
        return Checkpoint
    if name == "detect":
        from quanta.loaders.detection import detect
        return detect
    raise AttributeError(name)


def load(path: str | Path, **kw: Any):
    """Load the checkpoint at `path` (file, directory or `synthetic:` spec) with its detected family's reader.

    Keyword arguments go to the family's reader (e.g. `allow_pickle=True` for hf, `device` for synthetic).
    """
    from quanta.loaders.detection import detect, gguf_files_in
    family = detect(path)
    if family == "gguf" and Path(path).is_dir():
        path = gguf_files_in(Path(path))[0]
    elif family != "synthetic":
        path = Path(path)
    return resolve(get(family).reader)(path, **kw)


def write(dst: str | Path, ckpt, fmt: str, tensors=None, **format_options: Any) -> Path:
    """Write `ckpt` (or the `tensors` stream in its place) as format `fmt` at `dst` (a directory; a file for
    GGUF) with the family's writer; UnsupportedError naming the formats quanta writes."""
    if fmt not in FORMATS or FORMATS[fmt].writer is None:
        raise UnsupportedError(f"no checkpoint writer for format {fmt!r} (available: {', '.join(writable())})")
    return resolve(FORMATS[fmt].writer)(dst, ckpt, tensors, **format_options)


__all__ = ["Checkpoint", "FORMATS", "detect", "load", "write"]
