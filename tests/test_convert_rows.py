"""convert_rows: a conversion's dequantize / cast / error figure made a block of rows at a time equal what the
whole tensor gives: each kind's own `dequantize()` (the oracle every kernel is held to) and the error written
out in float64. quant.chunks.CHUNK is made small so that every weight takes many blocks, some of which must
round up to whole fp8 scale blocks and bitsandbytes blocks."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from quanta.quant import chunks
from quanta.quant.codebook_quant import quantize_4bit
from quanta.quant.fp8_quant import fp8_weight
from quanta.quant.ggml.quantize import quantize
from quanta.quant.kinds import Fp8
from quanta.quant.rtn import rtn_affine
from quanta.toolkit.convert.rows import cast, dequantize, rel_error, row_blocks


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK", 700)         # 2 rows of 256 per block (more where a kind needs it)


W = 0.02 * torch.randn(300, 256, generator=torch.Generator().manual_seed(0))


def _fp8_block() -> Fp8:
    scale = torch.rand(3, 2, generator=torch.Generator().manual_seed(1)) + 0.5
    return Fp8(data=fp8_weight(W, "channel").data, scale=scale, block_size=(128, 128))


KINDS = {
    "affine": lambda: rtn_affine(W, 4, 128, symmetric=False),
    "affine act-order": lambda: dataclasses.replace(rtn_affine(W, 4, 128, symmetric=False),
                                                    g_idx=torch.arange(256).flip(0) % 2),
    "gguf q4_K": lambda: quantize(W, "q4_K"),
    "gguf q8_0": lambda: quantize(W, "q8_0"),
    "fp8 channel": lambda: fp8_weight(W, "channel"),
    "fp8 block 128": _fp8_block,
    "nf4 double-quant b64": lambda: quantize_4bit(W, "nf4", 64, double_quant=True),
    "nf4 b4096 over K=96": lambda: quantize_4bit(W[:, :96].contiguous(), "nf4", 4096, double_quant=True),
    "fp4 b256 over K=100": lambda: quantize_4bit(W[:, :100].contiguous(), "fp4", 256),
}


def error64(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.double() - exact.double()).norm() / exact.double().norm())


@pytest.mark.parametrize("kind", list(KINDS))
def test_blockwise_equals_the_whole_tensor(kind):
    q = KINDS[kind]()
    whole = q.dequantize(torch.float32)
    blocks = list(row_blocks(q))
    assert len(blocks) > 1 and blocks[0][0] == 0 and blocks[-1][1] == q.shape[0]
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(dequantize(q, dtype), q.dequantize(dtype)), dtype
        out, same, error = cast(q, dtype)
        assert torch.equal(out, whole.to(dtype)) and same == torch.equal(whole.to(dtype).float(), whole)
        assert error == 0.0 if same else math.isclose(error, error64(out, whole), rel_tol=1e-6)
    g = torch.Generator().manual_seed(1)
    exact = whole + 0.001 * torch.randn(whole.shape, generator=g)
    assert math.isclose(rel_error(q, exact), error64(whole, exact), rel_tol=1e-6)
    assert rel_error(q, whole) == 0.0


def test_plain_tensors_cast_and_compare_by_value():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 256, generator=g)
    out, same, error = cast(w, torch.float16)
    assert torch.equal(out, w.half()) and not same and math.isclose(error, error64(w.half(), w), rel_tol=1e-6)
    assert cast(w.half(), torch.float32)[1:] == (True, 0.0)            # widening keeps every value
    h = w.half()
    assert cast(h, torch.float16)[0] is h                                  # already the dtype: as it is
    assert cast(torch.tensor(0.5), torch.bfloat16)[1] is True              # 0-D and 1-D tensors: one block
    out, same, _ = cast(torch.tensor([1.0, 1 + 2 ** -10]), torch.bfloat16)
    assert not same and out.tolist() == [1.0, 1.0]
    assert rel_error(torch.zeros(4, 8), torch.zeros(4, 8)) == 0.0
