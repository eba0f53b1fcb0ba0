"""Tensor-parallel cuts of a weight, for every canonical kind, returning the same kind.

    shard_rows(w, rank, world)   rows (output features) of piece `rank` of `world` equal pieces:
                                 column-parallel layers (q/k/v, gate/up, a vocab-parallel lm_head)
    shard_cols(w, rank, world)   columns (input features): row-parallel layers (o_proj, down_proj)
    take_rows(w, start, stop) / take_cols(w, start, stop)     the same for any range
    widened_cols(w, start, stop)  a row-parallel piece widened to whole groups / blocks, with the zero input
                                 columns that keep its product exact

A cut never requantizes: it keeps whole scale groups and blocks, so the piece dequantizes exactly to
the same slice of the full weight; where it would split one, take_* raise ShardError.
"""
from __future__ import annotations

import dataclasses

import torch

from quanta.quant.errors import ConfigError
from quanta.quant.kinds import Affine, Codebook, Fp8, Gguf


class ShardError(ConfigError):
    """A weight cannot be cut where tensor parallelism needs it (a group or block would straddle ranks).

    Raised where a cut would split a group or block (an affine group along K, a bitsandbytes block of the
    row-major flattened weight, an fp8 scale block, a ggml block along K), naming the weight, the cut and the
    unit it would split."""


def split_range(size: int, rank: int, world: int, what: str = "dimension") -> tuple[int, int]:
    """[start, stop) of piece `rank` when `size` is cut into `world` equal pieces; ShardError otherwise."""
    if size % world:
        raise ShardError(f"{what} of {size} does not split into {world} equal pieces")
    step = size // world
    return rank * step, (rank + 1) * step


def shard_rows(w, rank: int, world: int, name: str = "weight"):
    """Rows of piece `rank` of `world` (see the module docstring)."""
    start, stop = split_range(w.shape[0], rank, world, f"{name}: {w.shape[0]} rows")
    return take_rows(w, start, stop, name)


def shard_cols(w, rank: int, world: int, name: str = "weight"):
    """Columns of piece `rank` of `world` (see the module docstring)."""
    start, stop = split_range(w.shape[1], rank, world, f"{name}: {w.shape[1]} columns")
    return take_cols(w, start, stop, name)


def _check(name: str, what: str, start: int, stop: int, full: int, unit: int) -> None:
    """ShardError unless [start, stop) begins on a unit boundary and ends on one (or at `full`)."""
    if start % unit or (stop % unit and stop != full):
        raise ShardError(f"{name}: cutting {what} [{start}, {stop}) of {full} would split its {unit}-wide "
                         f"scale groups / blocks; a size that divides into whole groups would work")


def take_rows(w, start: int, stop: int, name: str = "weight"):
    """Rows [start, stop) of `w` (a tensor or any QTensor kind), as the same kind. A plain tensor is a dense
    weight, or a bias or norm as a 1-D tensor cut along its only dimension."""
    if isinstance(w, torch.Tensor):
        return w[start:stop]
    n, k = w.shape
    if isinstance(w, Affine):
        rows = {f: getattr(w, f)[start:stop] for f in ("codes", "scales", "mins", "zeros")
                if isinstance(getattr(w, f), torch.Tensor)}
        return dataclasses.replace(w, **rows, shape=(stop - start, k))
    if isinstance(w, Codebook):
        # blocks run over the flattened weight: the rows must begin and end on a block boundary
        _check(name, "rows (flattened)", start * k, stop * k, n * k, w.blocksize)
        b0, b1 = start * k // w.blocksize, -(-stop * k // w.blocksize)
        absmax = w.block_absmax()[b0:b1] if w.double_quant else w.absmax[b0:b1]
        # double quantization is undone (its nested blocks need not align with the cut); values equal
        return dataclasses.replace(w, codes=w.codes[start:stop], absmax=absmax, nested_table=None,
                                   nested_absmax=None, nested_offset=0.0, shape=(stop - start, k))
    if isinstance(w, Fp8):
        if w.block_size is not None:
            bn = w.block_size[0]
            _check(name, "rows", start, stop, n, bn)
            scale = w.scale[start // bn: -(-stop // bn)]
        else:
            scale = w.scale if w.scale.numel() == 1 else w.scale.reshape(-1)[start:stop].reshape(
                (stop - start,) + tuple(w.scale.shape[1:]))
        return dataclasses.replace(w, data=w.data[start:stop], scale=scale, shape=(stop - start, k))
    if isinstance(w, Gguf):
        return w.take_rows(slice(start, stop))
    raise ShardError(f"{name}: {type(w).__name__} weights cannot be cut for tensor parallelism")


def take_cols(w, start: int, stop: int, name: str = "weight"):
    """Columns [start, stop) of `w` (a 2-D tensor or any QTensor kind), as the same kind."""
    if isinstance(w, torch.Tensor):
        return w[:, start:stop]
    n, k = w.shape
    if isinstance(w, Affine):
        return _affine_cols(w, start, stop, name)
    if isinstance(w, Codebook):
        if k % w.blocksize:
            raise ShardError(f"{name}: its {w.blocksize}-blocks run across rows of {k} columns, so no "
                             "column cut keeps them whole")
        _check(name, "columns", start, stop, k, w.blocksize)
        per_row = k // w.blocksize
        absmax = w.block_absmax().view(n, per_row)[:, start // w.blocksize: stop // w.blocksize]
        return dataclasses.replace(w, codes=w.codes[:, start:stop], absmax=absmax.reshape(-1),
                                   nested_table=None, nested_absmax=None, nested_offset=0.0,
                                   shape=(n, stop - start))
    if isinstance(w, Fp8):
        scale = w.scale
        if w.block_size is not None:
            bk = w.block_size[1]
            _check(name, "columns", start, stop, k, bk)
            scale = w.scale[:, start // bk: -(-stop // bk)]
        return dataclasses.replace(w, data=w.data[:, start:stop], scale=scale, shape=(n, stop - start))
    if isinstance(w, Gguf):
        t = w.type
        _check(name, f"columns ({t.name} blocks)", start, stop, k, t.block_size)
        b0, b1 = start // t.block_size * t.type_size, stop // t.block_size * t.type_size
        return Gguf(data=w.data[:, b0:b1], ggml_type=w.ggml_type, shape=(n, stop - start))
    raise ShardError(f"{name}: {type(w).__name__} weights cannot be cut for tensor parallelism")


def _affine_cols(w: Affine, start: int, stop: int, name: str) -> Affine:
    """Columns [start, stop) of an Affine. Act-order weights (g_idx) keep, for their columns, only the groups
    those columns use, renumbered in order: the piece is exact, though its groups are no longer `group_size`
    columns each."""
    k = w.shape[1]
    per_group = ("scales", "mins") + (("zeros",) if isinstance(w.zeros, torch.Tensor) else ())
    if w.g_idx is None and w.num_groups == 1:          # per channel: one scale serves any columns
        return dataclasses.replace(w, codes=w.codes[:, start:stop], shape=(w.shape[0], stop - start))
    if w.g_idx is None:
        _check(name, "columns", start, stop, k, w.group_size)
        g0, g1 = start // w.group_size, -(-stop // w.group_size)
        groups = {f: getattr(w, f)[:, g0:g1] for f in per_group if getattr(w, f) is not None}
        return dataclasses.replace(w, codes=w.codes[:, start:stop], **groups, shape=(w.shape[0], stop - start))
    used, g_idx = torch.unique(w.g_idx[start:stop].long(), sorted=True, return_inverse=True)
    groups = {f: getattr(w, f)[:, used] for f in per_group if getattr(w, f) is not None}
    return dataclasses.replace(w, codes=w.codes[:, start:stop], **groups, g_idx=g_idx.to(w.g_idx.dtype),
                               shape=(w.shape[0], stop - start))


def column_unit(w) -> int | None:
    """The columns a kind keeps together along K (a ggml block, a scale group, a block of an fp8 or
    bitsandbytes weight), or None where any column range can be cut as it is (per-channel scales, act-order
    groups renumbered per piece, dense weights)."""
    if isinstance(w, Gguf):
        return w.type.block_size
    if isinstance(w, Affine):
        return w.group_size if w.g_idx is None and w.num_groups > 1 else None
    if isinstance(w, Codebook):
        return w.blocksize if w.shape[1] % w.blocksize == 0 else None
    if isinstance(w, Fp8) and w.block_size is not None:
        return w.block_size[1]
    return None


def widened_range(start: int, stop: int, full: int, unit: int | None) -> tuple[int, int]:
    """[lo, hi) ⊇ [start, stop): the range widened to whole units of `unit` columns (capped at `full`)."""
    if unit is None:
        return start, stop
    return start // unit * unit, min(-(-stop // unit) * unit, full)


def widened_cols(w, start: int, stop: int, name: str = "weight"):
    """(piece, (left, right)): the columns [lo, hi) of `w` covering [start, stop) in whole units (column_unit),
    and how many of them lie left and right of [start, stop). A row-parallel layer gets its input columns
    [start, stop) only; given `left` zero columns before them and `right` after, its product over the widened
    piece is exactly the product over [start, stop), since the columns it holds for a neighbour rank meet
    zeros. So a group or block that straddles two ranks is held whole by both."""
    lo, hi = widened_range(start, stop, w.shape[1], column_unit(w))
    return take_cols(w, lo, hi, name), (start - lo, hi - stop)


def cut(w, dim: int, start: int, stop: int, name: str = "weight"):
    """(piece, (left, right)): take_rows (dim 0) or widened_cols (dim 1) of `w`, holding only its own memory (a
    piece kept as it is cut, such as a dense lm_head or embedding table, which no kernel repacks, would otherwise
    pin the whole weight's storage on every rank), and the zero input columns a row-parallel piece needs on
    each side (none for rows)."""
    piece, pad = (take_rows(w, start, stop, name), (0, 0)) if dim == 0 else widened_cols(w, start, stop, name)
    if isinstance(piece, torch.Tensor):
        return _own(piece), pad
    fields = {f.name: _own(getattr(piece, f.name)) for f in dataclasses.fields(piece)
              if isinstance(getattr(piece, f.name), torch.Tensor)}
    return dataclasses.replace(piece, **fields), pad


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied where it is a view into a larger storage."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t

