"""GGML quantizers against foreign oracles: gguf-py's quantizers (legacy types) and golden blocks made
by llama.cpp's own ggml_quantize_chunk (tests/fixtures/make_gguf_quant_fixtures.py), on both CPU paths (the
compiled reference quantizers and the torch ones)."""
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from quanta.quant import chunks  # noqa: E402
from quanta.quant.errors import CorruptFileError, ShapeError, UnsupportedError  # noqa: E402
from quanta.quant.ggml import native  # noqa: E402
from quanta.quant.ggml.quantize import Imatrix, affine_to_gguf, quantize  # noqa: E402
from quanta.quant.kinds.affine import Affine  # noqa: E402
from quanta.quant.kinds.gguf import Gguf  # noqa: E402

GOLDENS = Path(__file__).parent / "fixtures" / "ggml_quant" / "goldens.npz"
LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
SEARCHED = ["q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs"]       # K-quants and IQ4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The searches are thousands of small ops: extra threads only contend on a shared machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def goldens():
    return dict(np.load(GOLDENS))


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Both quantizer paths on the CPU: the compiled reference quantizers (native.py) and the torch ones."""
    if request.param == "torch":
        monkeypatch.setenv("QUANTA_NATIVE", "0")
    return request.param


def _check_path(path, name, imatrix=None):
    if path == "native" and name not in (native.TYPES if imatrix is None else native.WEIGHTED):
        pytest.skip("the torch quantizer is the only one for this case")
    if path == "native" and shutil.which(os.environ.get("CC", "cc")):
        assert native.quantizer(name, weighted=imatrix is not None) is not None, \
            "a C compiler is here, yet the native quantizers did not build"


def _qtype(name):
    return getattr(gguf.GGMLQuantizationType, name.upper())


@pytest.mark.parametrize("name", LEGACY)
def test_legacy_bit_exact_with_gguf_py(goldens, name, path):
    _check_path(path, name)
    x = goldens["x"]
    ours = quantize(torch.from_numpy(x), name)
    assert np.array_equal(ours.data.numpy(), gguf.quants.quantize(x, _qtype(name)))


@pytest.mark.parametrize("suffix", ["", "_imatrix"])
@pytest.mark.parametrize("name", LEGACY + SEARCHED)
def test_bit_exact_with_llama_cpp(goldens, name, suffix, path):
    x = torch.from_numpy(goldens["x"])
    imatrix = torch.from_numpy(goldens["imatrix"]) if suffix else None
    _check_path(path, name, imatrix)
    ours = quantize(x, name, imatrix=imatrix)
    want = goldens[name + suffix]
    same_blocks = (ours.data.numpy().reshape(-1, ours.type.type_size)
                   == want.reshape(-1, ours.type.type_size)).all(1)
    assert same_blocks.all(), f"{name}{suffix}: {int((~same_blocks).sum())} of {same_blocks.size} blocks differ"
    ref = gguf.quants.dequantize(want, _qtype(name))
    assert np.array_equal(ours.dequantize().numpy(), ref)


@pytest.mark.parametrize("chunk", [None, 64], ids=["one-pass", "row-blocks"])
def test_affine_round_trip_is_exact(goldens, chunk, monkeypatch):
    if chunk:                               # to_affine reads the codes a few ggml blocks at a time
        monkeypatch.setattr(chunks, "CHUNK", chunk)
    x = goldens["x"][:, :256]
    for name in LEGACY:
        blocks = gguf.quants.quantize(x, _qtype(name))
        src = Gguf(torch.from_numpy(blocks), int(_qtype(name)), x.shape)
        back = affine_to_gguf(src.to_affine())
        assert back is not None and back.ggml_type == src.ggml_type
        assert np.array_equal(back.data.numpy(), blocks), name


def test_affine_without_a_legacy_form():
    codes = torch.randint(0, 16, (4, 64), dtype=torch.uint8)
    assert affine_to_gguf(Affine(codes, torch.rand(4, 1), 4, 64, zeros=8)) is None           # group 64
    assert affine_to_gguf(Affine(codes, torch.rand(4, 2) + 0.1, 4, 32, zeros=8)) is None     # not f16 values
    assert affine_to_gguf(Affine(codes, torch.rand(4, 2).half(), 4, 32, zeros=8)) is not None


def test_imatrix_is_mean_square_per_column():
    m = Imatrix(3)
    m.add(torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0]]))
    m.add(torch.tensor([[[1.0, 1.0, 1.0]]]))
    assert torch.equal(m.weights(), torch.tensor([11 / 3, 5 / 3, 2 / 3]))
    with pytest.raises(ShapeError, match="2 columns, expected 3"):
        m.add(torch.zeros(1, 2))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["q4_0", "q4_K", "iq4_xs"])
def test_non_finite_weights_are_refused(name, bad):
    w = torch.randn(4, 256)
    w[2, 17] = bad
    with pytest.raises(CorruptFileError, match=r"blk.2.ffn_up \[4, 256\]: holds NaN or infinite values"):
        quantize(w, name, what="blk.2.ffn_up")


def test_huge_finite_weights_are_not_taken_for_corrupt():
    """Values whose squares overflow float32 (the chunk's norm is inf) are finite: quantized, not refused."""
    w = torch.randn(4, 256)
    w[1, 3] = 3e38
    assert quantize(w, "q8_0").data.shape == (4, 272)


def test_bad_requests_are_typed():
    with pytest.raises(ShapeError, match="not a whole number of q4_K blocks of 256"):
        quantize(torch.zeros(2, 576), "q4_K", what="blk.0.attn_q")
    with pytest.raises(UnsupportedError, match="iq2_xxs"):
        quantize(torch.zeros(2, 256), "iq2_xxs")
    with pytest.raises(ShapeError, match="imatrix must have shape"):
        quantize(torch.zeros(2, 256), "q4_K", imatrix=torch.ones(3))


def test_sqrtf_is_the_correctly_rounded_root():
    """The K-quant searches weight values by square roots; C's sqrtf is correctly rounded, and so must ours be
    (numpy's float32 sqrt is IEEE's, the oracle) over every scale of input, subnormals and zero included."""
    from quanta.quant.ggml.qsearch import sqrtf
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(2_000_000, generator=g) * 10.0 ** torch.randint(-40, 38, (2_000_000,), generator=g),
                   torch.tensor([0.0, 1e-45, 1.17e-38, 3.4e38, 1.0, 2.0])]).float()
    assert np.array_equal(sqrtf(x).numpy(), np.sqrt(x.numpy()))
