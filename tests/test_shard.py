"""Tensor-parallel cuts of every canonical kind (quanta/quant/shard.py): each piece is the same kind and
dequantizes exactly to the same slice of the full weight's dequantization (DESIGN: dequantize() is the
oracle; the GGUF legacy blocks come from the `gguf` package's own quantizer), and a cut that would
split a group or block is refused with ShardError."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quanta.loaders.synthetic import quantized_weight
from quanta.quant.errors import ConfigError
from quanta.quant.kinds import Gguf
from quanta.quant.shard import (ShardError, column_unit, shard_cols, shard_rows, split_range, take_cols, take_rows,
                                widened_cols)

SHAPE = (128, 1024)
FORMATS = ["w4g128", "w4g64act", "w8", "nf4", "fp8", "fp8b32", "gguf-q4_K", "gguf-q6_K", "gguf-q2_K"]


def weight(fmt: str, shape=SHAPE, seed=0):
    return quantized_weight(fmt, shape, 0.05, torch.Generator().manual_seed(seed), torch.device("cpu"))


def gguf_legacy(type_name: str, shape=SHAPE) -> Gguf:
    """Blocks made by the gguf package's quantizer (Q4_0 .. Q8_0), independent of our code."""
    from gguf import GGMLQuantizationType, quants
    t = GGMLQuantizationType[type_name.upper()]
    data = quants.quantize(np.random.default_rng(0).standard_normal(shape).astype(np.float32), t)
    return Gguf(data=torch.from_numpy(np.ascontiguousarray(data)), ggml_type=int(t), shape=shape)


def pieces_match(w, world: int) -> None:
    full = w.dequantize()
    for rank in range(world):
        rows, cols = shard_rows(w, rank, world), shard_cols(w, rank, world)
        assert type(rows) is type(w) and type(cols) is type(w)
        r0, r1 = split_range(w.shape[0], rank, world)
        c0, c1 = split_range(w.shape[1], rank, world)
        assert torch.equal(rows.dequantize(), full[r0:r1])
        assert torch.equal(cols.dequantize(), full[:, c0:c1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("world", [2, 4])
def test_pieces_dequantize_to_the_slices(fmt, world):
    pieces_match(weight(fmt), world)


@pytest.mark.parametrize("type_name", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_gguf_legacy_blocks_from_the_gguf_package(type_name):
    pieces_match(gguf_legacy(type_name), 4)


def test_act_order_piece_keeps_only_its_groups():
    w = weight("w4g64act")
    piece = shard_cols(w, 1, 4)
    used = torch.unique(w.g_idx[256:512].long())
    assert piece.scales.shape[1] == len(used) and int(piece.g_idx.max()) == len(used) - 1
    assert torch.equal(piece.scales, w.scales[:, used])


def test_double_quantized_codebook_rows_and_cols():
    w = weight("nf4")
    # double quantization as bitsandbytes stores it: 8-bit codes of absmax - mean, in blocks of 256
    offset = float(w.absmax.mean())
    nested_absmax = (w.absmax - offset).abs().reshape(-1, 256).amax(1) if w.absmax.numel() % 256 == 0 else None
    table = torch.linspace(-1, 1, 256)
    codes = ((w.absmax - offset).reshape(-1, 256) / nested_absmax[:, None]).reshape(-1)
    codes = (codes[:, None] - table).abs().argmin(1).to(torch.uint8)
    dq = type(w)(codes=w.codes, table=w.table, blocksize=64, absmax=codes, nested_table=table,
                 nested_absmax=nested_absmax, nested_blocksize=256, nested_offset=offset)
    pieces_match(dq, 4)


def test_plain_tensors_and_biases():
    w = torch.randn(8, 12)
    assert torch.equal(shard_rows(w, 1, 2), w[4:]) and torch.equal(shard_cols(w, 2, 3), w[:, 8:])
    assert torch.equal(shard_rows(torch.arange(8), 3, 4), torch.tensor([6, 7]))


@pytest.mark.parametrize("fmt, cut, match", [
    ("w4g128", lambda w: shard_cols(w, 1, 16), "128-wide"),          # 64 columns a rank: half a group
    ("nf4", lambda w: shard_cols(w, 1, 32), "64-wide"),             # 32 columns: half a block
    ("fp8b32", lambda w: shard_rows(w, 1, 8), "32-wide"),           # 16 rows: half a scale block
    ("gguf-q4_K", lambda w: shard_cols(w, 1, 8), "q4_K blocks"),    # 128 columns: half a 256-block
    ("w4g128", lambda w: shard_rows(w, 1, 5), "does not split"),    # 128 rows over 5
])
def test_cuts_that_would_split_a_group_are_refused(fmt, cut, match):
    with pytest.raises(ShardError, match=match) as e:
        cut(weight(fmt))
    assert isinstance(e.value, ConfigError)


def test_codebook_blocks_across_rows_cannot_be_cut_along_k():
    w = weight("nf4", shape=(64, 96))             # 96 columns: blocks of 64 straddle rows
    with pytest.raises(ShardError, match="across rows"):
        take_cols(w, 0, 48)
    assert torch.equal(take_rows(w, 0, 32).dequantize(), w.dequantize()[:32])     # 32 x 96 = 48 blocks


@pytest.mark.parametrize("fmt", ["gguf-q4_K", "gguf-q6_K", "w4g128", "nf4", "fp8b32", "w8", "w4g64act"])
@pytest.mark.parametrize("world", [3, 5])
def test_widened_pieces_make_the_exact_product_of_their_columns(fmt, world):
    """A row-parallel cut of 1280 columns (widths 426/427 and 256 a rank cut 256-wide blocks and 128-wide
    groups): each piece covers its range in whole units, and x padded with zeros on the columns it holds for its
    neighbours gives the product over its own columns (to float64 summation order); kinds without such units are
    cut as they are."""
    w = weight(fmt, shape=(64, 1280))
    full = w.dequantize().double()
    x = torch.randn(3, 1280, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bounds = [1280 * r // world for r in range(world + 1)]
    total = torch.zeros(3, 64, dtype=torch.float64)
    for start, stop in zip(bounds, bounds[1:]):
        piece, (left, right) = widened_cols(w, start, stop)
        lo, hi = start - left, stop + right
        assert type(piece) is type(w) and piece.shape == (64, hi - lo) and lo <= start < stop <= hi <= 1280
        assert torch.equal(piece.dequantize().double(), full[:, lo:hi])
        unit = column_unit(w)
        assert (left, right) == (0, 0) if unit is None else (lo % unit == 0 and (hi % unit == 0 or hi == 1280))
        xs = torch.nn.functional.pad(x[:, start:stop], (left, right))
        product = xs @ piece.dequantize().double().T              # the zero columns add exact zeros
        torch.testing.assert_close(product, x[:, start:stop] @ full[:, start:stop].T, rtol=1e-13, atol=1e-12)
        total += product
    torch.testing.assert_close(total, x @ full.T)
