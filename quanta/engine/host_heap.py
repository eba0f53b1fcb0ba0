"""Giving the host's freed heap back to the operating system."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def trim() -> bool:
    """Return the C heap's free memory to the OS (glibc's malloc_trim), whether it did so. A CPU load frees
    many large temporaries (dequantized and stacked copies); glibc keeps freed heap memory for reuse, which
    would stay in the process' resident memory beside the weights. A no-op where the C library has no
    malloc_trim (musl, macOS)."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    return bool(fn(0)) if fn is not None else False
