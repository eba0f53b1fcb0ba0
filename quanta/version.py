"""The installed distribution's version, as pip recorded it from pyproject.toml (its one source)."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def quanta_version() -> str:
    """quanta's version, or "unknown" when it runs from a tree that was never installed."""
    try:
        return version("quanta")
    except PackageNotFoundError:
        return "unknown"
