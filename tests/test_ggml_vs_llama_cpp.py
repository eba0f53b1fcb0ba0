"""`quanta quantize --method gguf` against llama.cpp's own `llama_model_quantize` on the same float32 GGUF of the
default model: every tensor's bytes identical, for the K-quant types and the mixes. Needs llama-cpp-python (its
bundled libllama); skipped where it is not installed."""
from __future__ import annotations

import numpy as np
import pytest

import quanta

pytestmark = pytest.mark.slow            # quantizes the 135M model several times on two cores
llama_cpp = pytest.importorskip("llama_cpp")

# llama_ftype of each mix / type (llama.h). The default model's rows of 576 are not whole 256-wide K-quant blocks:
# the mixes fall back per tensor as llama-quantize does, while a plain K type is refused (quantize's own check).
FTYPES = {"Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q4_0": 2, "Q5_1": 9, "Q8_0": 7}


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory, default_model_path):
    """The default model as one float32 GGUF file, the input both quantizers read."""
    out = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    quanta.convert(default_model_path, "gguf:F32", out, validate=False, quiet=True)
    return out


def llama_quantize(src, dst, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"


def tensors(path) -> dict[str, tuple[int, bytes]]:
    from gguf import GGUFReader
    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("name", list(FTYPES))
def test_every_tensor_is_byte_identical_with_llama_quantize(name, f32_gguf, tmp_path):
    theirs, ours = tmp_path / "llama.gguf", tmp_path / "quanta.gguf"
    llama_quantize(f32_gguf, theirs, FTYPES[name])
    quanta.quantize(f32_gguf, ours, "gguf", type=name, quiet=True)
    a, b = tensors(theirs), tensors(ours)
    assert set(a) == set(b)
    wrong_type = sorted(n for n in a if a[n][0] != b[n][0])
    differ = sorted(n for n in a if a[n] != b[n])
    assert wrong_type == [] and differ == [], f"{name}: types differ in {wrong_type}, bytes in {len(differ)}: {differ}"
