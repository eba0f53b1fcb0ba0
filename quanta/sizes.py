"""Byte sizes as people write them (`15GiB`, `16GB`, `512 MiB`, `4096`): one grammar for every flag and
argument that takes a size. Imports nothing of ours, so the command line can parse sizes before torch loads."""
from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str, unit_required: bool = False) -> int | None:
    """Bytes of `text` (a number with an optional binary or decimal unit), or None if it is not a size."""
    match = _SIZE.match(text)
    if match is None or (unit_required and match[2] is None):
        return None
    return int(float(match[1]) * UNITS[(match[2] or "b").lower()])
