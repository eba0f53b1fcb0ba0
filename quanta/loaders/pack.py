"""Bit packing for the checkpoint writers: the exact inverse of `quantized.unpack_bits`.

Values are laid out as a dense little-endian bit stream along one dimension: value i occupies bits
[i*b, (i+1)*b) of the concatenated int32 words, straddling a word boundary when 32 % b != 0 (GPTQ and
compressed-tensors 3-bit). For b in {2, 4, 8} this is the plain sequential nibble/byte order.

Packing and unpacking work in int64, eight bytes per value, so both go a block of rows at a time
(quant.chunks): their scratch stays bounded whatever the tensor's size, never several int64 copies of a
whole weight.
"""
from __future__ import annotations

import math

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ShapeError


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding unsigned 32-bit values -> the same bits as int32 (two's complement)."""
    return ((words.to(torch.int64) + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def pack_bits(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit `values` (any int dtype, each < 2**bits) along `dim` into int32 words.

    The result has ceil(count * bits / 32) words along `dim`; the padding bits of the last word are zero.
    """
    v = values.movedim(dim, -1)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ShapeError(f"cannot pack values outside 0..{(1 << bits) - 1} into {bits} bits")
    lead, count = v.shape[:-1], v.shape[-1]
    rows = v.reshape(math.prod(lead), count)
    nwords = -(-count * bits // 32)
    offsets = torch.arange(count, device=v.device) * bits
    idx, shift = offsets // 32, offsets % 32
    shape = list(values.shape)
    shape[dim] = nwords
    result = torch.empty(shape, dtype=torch.int32, device=v.device)
    out = result.movedim(dim, -1)           # 2-D: the result's rows of words, written in place
    flat = out if out.dim() == 2 else torch.empty(rows.shape[0], nwords, dtype=torch.int32, device=v.device)
    step = chunk_rows(count, v.device)
    for r in range(0, rows.shape[0], step):
        shifted = rows[r:r + step].to(torch.int64) << shift     # < 2**39: fits int64, may spill into idx + 1
        words = torch.zeros(shifted.shape[0], nwords + 1, dtype=torch.int64, device=v.device)
        words.index_add_(-1, idx, shifted & 0xFFFFFFFF)           # bit fields never overlap: add == or
        words.index_add_(-1, idx + 1, shifted >> 32)
        flat[r:r + step] = as_int32(words[:, :nwords])
    if flat is not out:
        out.copy_(flat.reshape(out.shape))
    return result
