"""Build a C source that ships in the package into a shared library on first use, and load it with ctypes.

The library goes to $QUANTA_CACHE/native (default ~/.cache/quanta), keyed by the hash of the source and the headers
it includes, the flags and the machine (a home shared between machines keeps one library for each), built under a
temporary name and renamed into place (two processes may build at once). Flag sets are tried in order (the first is
the fastest; a later one drops what a compiler may lack); where none builds, or QUANTA_NATIVE=0, there is no library
and the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)


def enabled() -> bool:
    """False where QUANTA_NATIVE=0 turns the native code off."""
    return os.environ.get("QUANTA_NATIVE", "1") != "0"


def missing(library) -> str | None:
    """Why kernels on `library` (a function giving the loaded library or None) cannot run here, else None."""
    return None if enabled() and library() is not None else "no native library (no C compiler, or QUANTA_NATIVE=0)"


def load(source: Path, flag_sets: tuple[tuple[str, ...], ...], what: str) -> ctypes.CDLL | None:
    """The library built from `source` with the first of `flag_sets` that compiles, or None (logged, naming
    `what`) where none does."""
    if not enabled():
        return None
    text = source.read_bytes() + b"".join(h.read_bytes() for h in _headers(source))
    root = os.environ.get("QUANTA_CACHE", str(Path.home() / ".cache" / "quanta"))
    directory = Path(root or tempfile.gettempdir()) / "native"
    errors = []
    for flags in flag_sets:
        key = hashlib.sha256(text + " ".join((*flags, platform.machine(), _cpu())).encode()).hexdigest()[:16]
        path = directory / f"{source.stem}_{key}.so"
        try:
            if not path.is_file():
                _build(source, flags, path)
            return ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{' '.join(flags)}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    log.info("%s: not available (%s); the torch path runs", what, "; ".join(errors))
    return None


def _headers(source: Path) -> list[Path]:
    """The headers `source` includes by a quoted path (relative to the including file's folder), and theirs: the
    library's key must change when any of them does."""
    found, todo = [], [source]
    while todo:
        current = todo.pop()
        for name in re.findall(r'^#include "([^"]+)"', current.read_text(), re.M):
            path = (current.parent / name).resolve()
            if path not in found:
                found.append(path)
                todo.append(path)
    return found


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and its flags (Linux), else the processor's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "".join(line for line in lines[:40] if line.startswith(("model name", "flags", "Features")))


def _build(source: Path, flags: tuple[str, ...], path: Path) -> None:
    """Compile `source` into `path`, under a temporary name renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
    os.close(fd)
    try:
        compiler = os.environ.get("CC", "cc")
        subprocess.run([compiler, *flags, str(source), "-o", tmp, "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
