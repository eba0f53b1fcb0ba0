"""Batch-invariant F.linear on the CPU: a row's result does not depend on how many rows come with it.

torch's CPU matmul picks its kernel by the row count M, and the kernels sum over K in different orders:
MKL's float32 GEMM has a GEMV for one row and other kernels for small and large M; oneDNN's 16-bit GEMM
keeps one order from 2 to 32 rows and changes it above (AMX tiles, on CPUs that have them), and at one
row for some shapes. Within one kernel a row's result depends on that row alone. So every call here
holds a row count from one fixed range per dtype, ROWS[dtype] = (lo, hi): longer inputs are cut into
pieces of hi rows, a piece shorter than lo is padded with zero rows. float32 runs in tiles of exactly
16 rows; bfloat16 and float16 in pieces of 2 to 32 rows, which leaves a decode step's few rows (and its
memory-bound weight read) as they were. The engine's other CPU GEMMs, torch's packed int4 / int8
kernels, are row-invariant as they stand (tests/test_batch_invariance.py checks all of them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = {torch.float32: (16, 16), torch.bfloat16: (2, 32), torch.float16: (2, 32)}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] on the CPU, each call over a row count from ROWS."""
    lo, hi = ROWS.get(x.dtype, (1, 1 << 62))
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m == 0 or lo <= m <= hi:
        return F.linear(x, weight, bias)
    pieces = []
    for start in range(0, m, hi):
        piece = rows[start:start + hi]
        n = piece.shape[0]
        if n < lo:
            piece = torch.cat([piece, piece.new_zeros(lo - n, piece.shape[1])])
        pieces.append(F.linear(piece, weight, bias)[:n])
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.reshape(*x.shape[:-1], out.shape[-1])
