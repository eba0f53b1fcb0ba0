"""GGUF header encoding (loaders/gguf/encode.py) against gguf-py's GGUFWriter, byte for byte, and the reader's
bulk string arrays (a vocabulary cut or damaged inside is reported as the one-string path reports it)."""
import struct

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as T

from quanta.loaders.gguf.encode import encode_header
from quanta.loaders.gguf.file import read_gguf
from quanta.quant.errors import CorruptFileError, UnsupportedError

METADATA = {
    "general.name": "tiny", "general.empty": "", "llama.block_count": 2, "flag": True, "eps": 1e-5,
    "tokenizer.ggml.tokens": ["<s>", "</s>", "héllo", "wörld 🚀", ""], "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
    "tokenizer.ggml.scores": [0.0, -1.5, 2.25, 1e-7, -3.0], "flags": [True, False, True], "none": [],
    "nested": [[1, 2], ["a", "b"], [[0.5]]], "raw": [b"\x00\xff", bytearray(b"ab")],
}
TENSORS = [("a.weight", (4, 32), T.Q8_0, 34 * 4), ("b", (7,), T.F32, 28), ("c.weight", (3, 256), T.Q4_K, 144 * 3)]


def gguf_py_header(tmp_path, metadata, tensors) -> bytes:
    """What GGUFWriter writes up to the tensor data, for `_add`-style calls (ints as uint32)."""
    w = GGUFWriter(str(tmp_path / "ref.gguf"), "llama")
    for key, value in metadata.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, dims, t, nbytes in tensors:
        w.add_tensor_info(name, dims, np.dtype(np.float32), nbytes, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    data = (tmp_path / "ref.gguf").read_bytes()
    return data + bytes(-len(data) % 32)


def ours(metadata, tensors) -> bytes:
    infos, offset = [], 0
    for name, dims, t, nbytes in tensors:
        infos.append((name, dims, int(t), offset))
        offset += -(-nbytes // 32) * 32
    return encode_header({"general.architecture": "llama", **metadata}, infos)


def test_header_is_gguf_py_s(tmp_path):
    assert ours(METADATA, TENSORS) == gguf_py_header(tmp_path, METADATA, TENSORS)


def test_real_vocabulary_round_trips(tmp_path):
    tokens = [f"tok{i}" if i % 7 else f"ü{i}é" for i in range(50000)]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 50000}
    head = ours(meta, TENSORS[:1])
    assert head == gguf_py_header(tmp_path, meta, TENSORS[:1])
    path = tmp_path / "v.gguf"
    path.write_bytes(head + bytes(34 * 4))
    assert read_gguf(path).metadata["tokenizer.ggml.tokens"] == tokens
    assert "tokenizer.ggml.tokens" not in read_gguf(path, vocabularies=False).metadata
    assert read_gguf(path, vocabularies=False).tensors == read_gguf(path).tensors


@pytest.mark.parametrize("value", [[1, 2.0], [1, True], [None], [[]], [2**31], [1e39], 2**32, -1, None])
def test_refused_values_are_typed(value):
    with pytest.raises(UnsupportedError, match="'k'"):
        ours({"k": value}, TENSORS[:1])


def test_cut_or_bad_string_in_a_vocabulary(tmp_path):
    head = ours({"tokenizer.ggml.tokens": ["aa", "bbb", "cccc"]}, TENSORS[:1])
    at = head.index(b"bbb")
    for data, words in ((head[:at + 1], "truncated or damaged"), (head[:at - 3], "truncated or damaged"),
                        (head[:at] + b"\xff" + head[at + 1:], "not valid UTF-8")):
        path = tmp_path / "bad.gguf"
        path.write_bytes(data)
        with pytest.raises(CorruptFileError, match=words) as e:
            read_gguf(path)
        assert "tokenizer.ggml.tokens" in str(e.value)
    assert struct.unpack_from("<Q", head, at - 8)[0] == 3
