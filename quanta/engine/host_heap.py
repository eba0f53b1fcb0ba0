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


M_MMAP_THRESHOLD = -3
LARGE_BLOCK = 1 << 20


def map_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """From now on give every allocation of `threshold` bytes or more its own mapping, returned to the OS the
    moment it is freed (glibc's mallopt(M_MMAP_THRESHOLD)); whether it did. glibc otherwise raises that
    threshold to the largest block freed so far, after which window-sized temporaries (logits, log-softmax
    blocks) come from the heap and stay resident between uses. For batch commands whose peak memory matters
    more than the page faults of fresh mappings (validate, convert): a process-wide setting, made at a
    command's entry, never by the library."""
    libc = _libc()
    fn = getattr(libc, "mallopt", None) if libc is not None else None
    return bool(fn(M_MMAP_THRESHOLD, threshold)) if fn is not None else False
