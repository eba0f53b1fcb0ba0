"""Where a conversion writes: a staging folder beside the destination, committed by renames at the end.

    with Staging(dst, is_file, force) as stage:
        write(stage.main, ...)                 # the checkpoint directory or GGUF file
        stage.sidecar("convert").write_text(...)
    # dst (and its sidecars) now exist; on any exception (KeyboardInterrupt, SIGTERM turned into one)
    # nothing exists at dst and the staging folder is gone
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from quanta.quant.errors import ConfigError

SIDECARS = {"convert": "quanta_convert.json", "validation": "quanta_validation.json"}


def check_paths(src: Path, dst: Path, force: bool) -> None:
    """ConfigError when dst is the source, holds the source, or exists without `force`."""
    s, d = src.resolve(), dst.resolve()
    if s == d or d in s.parents:
        raise ConfigError(f"{dst}: is the source checkpoint {src} (or holds it); convert to another path")
    if s.is_dir() and s in d.parents:
        raise ConfigError(f"{dst}: inside the source checkpoint directory {src}; convert to a path outside it")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise ConfigError(f"{dst}: already exists; pass --force (force=True) to replace it")
    if not dst.parent.is_dir():
        raise ConfigError(f"{dst.parent}: the destination folder does not exist")


def sidecar_path(dst: Path, is_file: bool, kind: str) -> Path:
    """Where sidecar `kind` ("convert" or "validation") of output `dst` lives."""
    return dst.parent / f"{dst.name}.{kind}.json" if is_file else dst / SIDECARS[kind]


class Staging:
    """The staging folder of one conversion (a context manager; see the module docstring).

    The staging folder is `dst.parent/.<dst.name>.tmp-XXXX`; a process killed outright (SIGKILL) leaves it
    behind under that name, never at dst. Sidecars of a directory output are files inside it
    (quanta_convert.json, quanta_validation.json); of a GGUF file, `<file>.convert.json` and
    `<file>.validation.json` beside it. The sidecars are renamed first and the output itself last, so dst
    exists only once everything is in place."""

    def __init__(self, dst: Path, is_file: bool, force: bool):
        self.dst, self.is_file, self.force = Path(dst), is_file, force
        self.root: Path | None = None

    @property
    def main(self) -> Path:
        """The staged output: the path the writer writes (it does not exist yet)."""
        return self.root / self.dst.name

    def sidecar(self, kind: str) -> Path:
        """The staged path of sidecar `kind`."""
        return sidecar_path(self.main, self.is_file, kind)

    def __enter__(self) -> Staging:
        self.root = Path(tempfile.mkdtemp(dir=self.dst.parent, prefix=f".{self.dst.name}.tmp-"))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._commit()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _commit(self) -> None:
        dst = self.dst
        if (dst.exists() or dst.is_symlink()) and not self.force:   # it may have appeared while we wrote
            raise ConfigError(f"{dst}: appeared during the conversion; pass --force to replace it")
        if self.is_file:
            for kind in SIDECARS:
                staged = self.sidecar(kind)
                final = sidecar_path(dst, True, kind)
                if staged.exists():
                    os.replace(staged, final)
                elif final.exists():
                    final.unlink()              # a stale sidecar of the file being replaced
            os.replace(self.main, dst)
            return
        old = None
        if dst.exists() or dst.is_symlink():
            old = self.root / ".replaced"
            os.replace(dst, old)            # deleted with the staging folder, after the new one is in place
        try:
            os.replace(self.main, dst)
        except BaseException:
            if old is not None and not dst.exists():
                os.replace(old, dst)
            raise
