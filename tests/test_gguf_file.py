"""The GGUF container reader: what a damaged file is reported as, with the `gguf` package as the oracle
for where each metadata entry, tensor info and tensor's data lies in the file."""
import re
import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, quants
from gguf.constants import GGMLQuantizationType as T

from quanta.loaders.gguf.reader import load_gguf
from quanta.loaders.gguf.file import read_gguf
from quanta.quant.errors import CorruptFileError, QuantaError, UnsupportedError

INTERNAL = re.compile(r"IndexError|ValueError|KeyError|struct\.error|OverflowError|out of bounds|Traceback")
TENSORS = {"a.weight": ((64, 32), T.F32), "b.weight": ((8, 64), T.Q8_0), "c.weight": ((4, 96), T.Q4_0),
           "d.weight": ((16,), T.F16)}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small GGUF file written by gguf.GGUFWriter, its bytes and gguf-py's reading of it."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_string("general.name", "small")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "héllo", "wörld"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5, 3.5])
    w.add_float32("llama.rope.freq_base", 10000.0)
    for name, (shape, t) in TENSORS.items():
        data = quants.quantize(rng.standard_normal(shape).astype(np.float32), t)
        w.add_tensor(name, data, raw_dtype=None if t in (T.F32, T.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, path.read_bytes(), GGUFReader(path)


def cut(tmp_path, data: bytes, keep: int, name="cut.gguf"):
    path = tmp_path / name
    path.write_bytes(data[:keep])
    return path


def error_of(path, load=read_gguf) -> str:
    with pytest.raises(QuantaError) as e:
        load(path)
    msg = str(e.value)
    assert not INTERNAL.search(msg), msg
    assert str(path) in msg
    return msg


def kv_fields(reader):
    return [f for name, f in reader.fields.items() if not name.startswith("GGUF.")]


def test_reads_what_gguf_reads(small):
    path, _, ref = small
    f = read_gguf(path)
    assert f.version == 3 and f.size == path.stat().st_size
    for field in kv_fields(ref):
        assert f.metadata[field.name] == field.contents(), field.name
    assert [t.name for t in f.tensors] == [t.name for t in ref.tensors]
    for ours, theirs in zip(f.tensors, ref.tensors):
        assert ours.dims == tuple(reversed(theirs.shape.tolist())) and ours.type.id == int(theirs.tensor_type)
        assert (ours.start, ours.nbytes) == (theirs.data_offset, theirs.n_bytes)
        assert np.array_equal(f.read(ours), np.asarray(theirs.data).view(np.uint8).reshape(-1))


def test_tensors_are_private_views_a_write_never_reaches_the_file(small, tmp_path):
    path, data, _ = small
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(data)
    f = read_gguf(copy)
    t = f.tensors[0]
    view = f.read(t)
    assert not view.flags.owndata                      # the file's bytes, not a copy of them
    before = view.copy()
    view[:] = 0xAB                                     # a loader writing into its tensor
    assert copy.read_bytes() == data                   # the file on disk is untouched
    assert np.array_equal(read_gguf(copy).read(t), before)      # and a second reader sees the file's bytes


def test_empty_garbage_and_wrong_magic(tmp_path):
    assert "is empty (0 bytes)" in error_of(cut(tmp_path, b"", 0, "empty.gguf"))
    garbage = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    assert "not a GGUF file" in error_of(cut(tmp_path, b"\x89PNG" + garbage, 4100, "garbage.gguf"))
    assert "not a GGUF file" in error_of(cut(tmp_path, b"GG", 2, "short.gguf"))
    msg = error_of(cut(tmp_path, b"GGUF" + struct.pack("<I", 3) + garbage, 4104, "noise.gguf"))
    assert "ends at byte 4104" in msg


@pytest.mark.parametrize("version, words", [(1, "GGUF version 1 is not supported"),
                                            (4, "GGUF version 4 is not supported"),
                                            (0x03000000, "big-endian")])
def test_unsupported_version(small, tmp_path, version, words):
    data = bytearray(small[1])
    struct.pack_into("<I", data, 4, version)
    path = cut(tmp_path, bytes(data), len(data), "version.gguf")
    with pytest.raises(UnsupportedError, match=words):
        read_gguf(path)


def test_cut_inside_the_header(small, tmp_path):
    msg = error_of(cut(tmp_path, small[1], 13))
    assert "the file ends at byte 13 but the GGUF header (version and counts) needs bytes up to 16" in msg


def test_cut_inside_metadata_names_the_entry_and_key(small, tmp_path):
    _, data, ref = small
    fields = kv_fields(ref)
    for i, field in enumerate(fields):
        key_end = field.offset + 8 + len(field.name.encode())
        # inside the key: the entry and where it starts are known, its key not yet
        msg = error_of(cut(tmp_path, data, field.offset + 5))
        assert f"ends at byte {field.offset + 5} but metadata entry {i} of {len(fields)} " \
               f"(from byte {field.offset}) needs bytes up to {field.offset + 8}" in msg
        # inside the value: the key is named
        keep = key_end + 4 + 2
        msg = error_of(cut(tmp_path, data, keep))
        assert f"ends at byte {keep} but metadata entry {i} of {len(fields)} (key {field.name!r}, " \
               f"from byte {field.offset})" in msg


def test_cut_inside_tensor_infos_names_the_tensor(small, tmp_path):
    _, data, ref = small
    for i, t in enumerate(ref.tensors):
        keep = t.field.offset + 8 + len(t.name) + 6           # inside the dims
        msg = error_of(cut(tmp_path, data, keep))
        assert f"ends at byte {keep} but tensor info {i} of {len(ref.tensors)} ({t.name!r}, " \
               f"from byte {t.field.offset})" in msg


def test_cut_inside_data_names_the_tensor_and_bytes(small, tmp_path):
    _, data, ref = small
    for t in ref.tensors:
        for keep in (t.data_offset, t.data_offset + t.n_bytes // 2, t.data_offset + t.n_bytes - 1):
            msg = error_of(cut(tmp_path, data, keep))
            assert f"the file ends at byte {keep} but tensor {t.name!r}" in msg
            assert f"needs bytes up to {t.data_offset + t.n_bytes}" in msg


def test_every_header_cut_is_a_typed_error_naming_its_byte(small, tmp_path):
    _, data, ref = small
    end = max(t.data_offset + t.n_bytes for t in ref.tensors)
    for keep in [*range(4, ref.data_offset + 8), *range(ref.data_offset + 8, end, 61), end - 1]:
        with pytest.raises(CorruptFileError) as e:
            read_gguf(cut(tmp_path, data, keep))
        assert f"ends at byte {keep} but " in str(e.value) and not INTERNAL.search(str(e.value)), keep
    read_gguf(cut(tmp_path, data, end))                         # only alignment padding after it


def test_bad_offset_dims_and_value_type(small, tmp_path):
    path, data, ref = small
    t = ref.tensors[1]
    at = t.field.offset + 8 + len(t.name)                      # n_dims, then ne[], type, offset
    bad = bytearray(data)
    struct.pack_into("<Q", bad, at + 4 + 8 * len(t.shape) + 4, int(t.data_offset - ref.data_offset) + 1)
    assert "data offset" in error_of(cut(tmp_path, bytes(bad), len(bad)))
    bad = bytearray(data)
    struct.pack_into("<I", bad, at, 7)
    assert f"tensor {t.name!r}: 7 dimensions" in error_of(cut(tmp_path, bytes(bad), len(bad)))
    field = ref.fields["llama.block_count"]
    bad = bytearray(data)
    struct.pack_into("<I", bad, field.offset + 8 + len(field.name), 42)
    assert "(key 'llama.block_count', from byte" in error_of(cut(tmp_path, bytes(bad), len(bad)))
    assert "unknown metadata value type 42" in error_of(cut(tmp_path, bytes(bad), len(bad)))


# --- the real model file, cut ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(default_model_path):
    return default_model_path, GGUFReader(default_model_path)


def test_real_file_cut_inside_metadata(real, tmp_path):
    path, ref = real
    merges = ref.fields["tokenizer.ggml.merges"]
    keep = merges.offset + 100_000                              # inside the merges' strings
    with open(path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(keep))
    msg = error_of(tmp_path / "cut.gguf", lambda p: load_gguf(p, tokenizer=False))
    i = [f.name for f in kv_fields(ref)].index("tokenizer.ggml.merges")
    assert f"the file ends at byte {keep} but metadata entry {i} of {len(kv_fields(ref))} " \
           f"(key 'tokenizer.ggml.merges', from byte {merges.offset})" in msg


def test_real_file_cut_inside_data(real, tmp_path):
    path, ref = real
    t = ref.tensors[5]
    keep = t.data_offset + 1000
    with open(path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(keep))
    msg = error_of(tmp_path / "cut.gguf", lambda p: load_gguf(p, tokenizer=False))
    assert isinstance(msg, str) and f"the file ends at byte {keep} but tensor {t.name!r}" in msg
    assert f"needs bytes up to {t.data_offset + t.n_bytes}" in msg
