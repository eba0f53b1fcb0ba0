"""The compiled reference quantizers (quanta.quant.ggml.native) against the torch ones on blocks that take the
searches' rare branches, whatever the thread count, and the fallback when no compiler works. The golden-block
tests (test_ggml_quantize.py) and test_ggml_vs_llama_cpp.py hold both paths to llama.cpp's bytes."""
import shutil

import pytest
import torch

from quanta.quant.ggml import native
from quanta.quant.ggml.quantize import _LEGACY, QUANTIZERS, quantize
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def _edge_blocks(block: int) -> torch.Tensor:
    """Blocks of every kind that steers the searches: zero, constant, one live element, tiny (near the searches'
    1e-15 cut-off), huge, all positive or all negative, float16-exact, and plain random ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, block, generator=g) * 0.05
    x[0] = 0
    x[1] = 1.5
    x[2] = 0
    x[2, 7] = -0.3
    x[3] *= 1e-16
    x[4] *= 1e-6
    x[5] *= 3e3
    x[6] = x[6].abs()
    x[7] = -x[7].abs()
    x[8] = (x[8] * 100).half().float()
    x[9, : block // 2] = 0
    x[10] = torch.linspace(-1, 1, block)
    return x


@pytest.mark.parametrize("name", native.TYPES)
def test_native_bytes_equal_the_torch_quantizer(name, monkeypatch):
    block = GGML_TYPES_BY_NAME[name].block_size
    x = torch.cat([_edge_blocks(block), torch.randn(600, block) * 0.02])
    compiled = native.quantizer(name)
    assert compiled is not None
    want = QUANTIZERS[name](x, None, 1) if name in _LEGACY else QUANTIZERS[name](x, None)
    got = compiled(x)
    differ = (got != want).any(1)
    assert not differ.any(), f"{name}: blocks {differ.nonzero().flatten().tolist()[:10]} differ"


@pytest.mark.parametrize("name", native.WEIGHTED)
def test_native_bytes_with_an_imatrix_equal_the_torch_quantizer(name):
    block = GGML_TYPES_BY_NAME[name].block_size
    row_blocks = 3 if block == 32 else 1                 # the legacy types' sigma2 spans a whole row
    x = torch.cat([_edge_blocks(block)[:39], torch.randn(600, block) * 0.02])
    qw = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) + 0.05
    qw[5] = 0                                            # a block no calibration token reached
    want = QUANTIZERS[name](x, qw, row_blocks) if name in _LEGACY else QUANTIZERS[name](x, qw)
    got = native.quantizer(name, weighted=True)(x, qw, row_blocks)
    differ = (got != want).any(1)
    assert not differ.any(), f"{name}: blocks {differ.nonzero().flatten().tolist()[:10]} differ"


def test_threads_do_not_change_the_bytes():
    x = torch.randn(4 * native.PIECE_BLOCKS + 3, 256) * 0.02
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.quantizer("q4_K")(x)
        torch.set_num_threads(3)
        three = native.quantizer("q4_K")(x)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, three)


def test_no_compiler_leaves_the_torch_quantizers(monkeypatch, tmp_path):
    x = torch.randn(64, 512) * 0.02
    want = quantize(x, "q4_K").data
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("QUANTA_CACHE", str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        assert native.quantizer("q4_K") is None
        assert torch.equal(quantize(x, "q4_K").data, want)
        assert not list((tmp_path / "cache").rglob("*.so"))          # nothing half-built left behind
    finally:
        native._library.cache_clear()


def test_quanta_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    assert native.quantizer("q8_0") is None
