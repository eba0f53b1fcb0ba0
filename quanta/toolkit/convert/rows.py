"""A conversion's whole-weight arithmetic a block of rows at a time (quant.chunks): dequantizing, casting and
measuring the error of a weight holds the weights themselves and block-sized scratch, never float32
temporaries the size of the largest tensor.

    dequantize(q, dtype)           q's values [N, K] in `dtype`
    cast(t, dtype)                 (t in `dtype`, whether every value is unchanged, the relative error)
    rel_error(approx, exact)       ||approx - exact|| / ||exact||, of tensors or QTensors
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.kinds import Codebook, Fp8
from quanta.quant.qtensor import QTensor
from quanta.quant.shard import take_rows

Tensor = torch.Tensor | QTensor


def row_blocks(*ts: Tensor) -> Iterator[tuple[int, int]]:
    """[start, stop) of consecutive row blocks covering tensors `ts` of one shape; a block ends where each
    kind can be cut (whole fp8 scale blocks, whole bitsandbytes blocks of the flattened weight). A tensor of
    one dimension is one block."""
    t = ts[0]
    if len(t.shape) < 2:
        yield 0, t.shape[0]
        return
    n, k = t.shape[0], math.prod(t.shape[1:])
    unit = math.lcm(*(_row_unit(x, k) for x in ts))
    step = -(-chunk_rows(k, t.device) // unit) * unit
    for start in range(0, n, step):
        yield start, min(start + step, n)


def _row_unit(t: Tensor, k: int) -> int:
    """The rows a cut of `t` must keep together."""
    if isinstance(t, Fp8) and t.block_size is not None:
        return t.block_size[0]
    if isinstance(t, Codebook):
        return t.blocksize // math.gcd(k, t.blocksize)
    return 1


def _cuttable(t: Tensor) -> Tensor:
    """`t` in a form whose row cuts are plain slices: a kind that does work on every cut (a double-quantized
    codebook undoes its nested absmax) does it once here, exactly."""
    return take_rows(t, 0, t.shape[0]) if isinstance(t, QTensor) else t


def _block(t: Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of `t`: a QTensor's dequantized to float32, a tensor's as they are."""
    if isinstance(t, QTensor):
        return take_rows(t, start, stop).dequantize(torch.float32)
    return t[start:stop]


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q.dequantize(dtype)`, the same values, made a block of rows at a time."""
    q = _cuttable(q)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for start, stop in row_blocks(q):
        out[start:stop] = _block(q, start, stop)            # float32, rounded to `dtype` as q.dequantize does
    return out


def cast(t: Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool, float]:
    """(`t`'s values in `dtype`, whether every value is unchanged, the relative error of the cast); a QTensor's
    values are its float32 dequantization. A tensor already in `dtype` comes back as it is."""
    if isinstance(t, torch.Tensor) and t.dtype == dtype:
        return t, True, 0.0
    if isinstance(t, torch.Tensor) and t.dim() == 0:
        out, same, error = cast(t.reshape(1), dtype)
        return out.reshape(()), same, error
    t = _cuttable(t)
    out = torch.empty(tuple(t.shape), dtype=dtype, device=t.device)
    same = True
    for start, stop in row_blocks(t):
        exact = _block(t, start, stop)
        rows = exact.to(dtype)
        out[start:stop] = rows
        wide = torch.promote_types(dtype, exact.dtype)          # compared where both are exact
        same = same and bool(torch.equal(rows.to(wide), exact.to(wide)))
    return out, same, 0.0 if same else rel_error(out, t)


def rel_error(approx: Tensor, exact: Tensor) -> float:
    """||approx - exact|| / ||exact|| of the float32 values, the squares summed in float64 block by block (0 for an
    all-zero `exact` that is matched); a QTensor is dequantized block by block."""
    approx, exact = _cuttable(approx), _cuttable(exact)
    diff = norm = 0.0
    for start, stop in row_blocks(approx, exact):
        a, e = _block(approx, start, stop).float(), _block(exact, start, stop).float()
        norm += float(torch.sum(torch.square(e), dtype=torch.float64))
        diff += float(torch.sum(torch.square(a - e), dtype=torch.float64))
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.sqrt(diff)
