"""Blocks of rows for whole-weight arithmetic: bit packing, rounding, error sums.

Work that makes int64 or float32 temporaries the size of its input goes a block of rows at a time, so
the scratch stays within CHUNK values (or one row, where a row is longer) whatever the weight's size: a
conversion's memory is then the weights it holds, not a multiple of the largest one. On an accelerator
every pass costs kernel launches, so the blocks there are DEVICE_CHUNK values.
"""
from __future__ import annotations

import torch

CHUNK = 1 << 16             # values per pass on the host: half a MB for each int64 temporary
DEVICE_CHUNK = 1 << 24      # values per pass on an accelerator: few, large passes


def chunk_rows(row_values: int, device: torch.device) -> int:
    """Rows per pass when each row holds `row_values` values: about CHUNK values on the host
    (DEVICE_CHUNK elsewhere), at least one row."""
    chunk = CHUNK if device.type == "cpu" else DEVICE_CHUNK
    return max(1, chunk // max(1, row_values))
