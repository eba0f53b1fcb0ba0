"""Fuzzing the GGUF reader (quanta/loaders/gguf/file.py, gguf.py); see tests/fuzz_support.py for the property.

The seed is a tiny but complete llama file written by gguf-py's GGUFWriter. It is read back with gguf-py's
GGUFReader into a `Model` (version, typed metadata, tensor infos, data) that this module's `encode` turns
back into exactly the writer's bytes, recording the span and kind of every structural field. Mutations then
work on that structure: a field set to an interesting value (counts, lengths, types, dims, offsets), a cut
at a field boundary, byte flips, or an edit of the model itself (a metadata value of another type or a
nested array, keys dropped or duplicated, tensor dims / types / offsets / names changed) re-encoded.
When quanta accepts a file, gguf-py (the oracle) must read the same metadata and tensor layout from it.
"""
from __future__ import annotations

import copy
import functools
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T
from hypothesis import given
from hypothesis import strategies as st

from fuzz_support import FUZZ, fuzz_dir, loads_or_refuses
from quanta.loaders.gguf.reader import load_gguf
from quanta.loaders.gguf.file import read_gguf
from quanta.quant.qtensor import QTensor

H, FF, HEADS, KV, VOCAB = 32, 256, 2, 1, 8
_DIR = fuzz_dir("gguf")
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
Q8_1 = 9


@dataclass
class Model:
    """A GGUF file as structure: metadata (key, value type, value) and tensors (name, ne, type, offset)."""

    version: int
    kvs: list[tuple[str, int, Any]]              # an array value is (item type, [values])
    tensors: list[tuple[str, list[int], int, int]]
    data: bytes
    alignment: int = 32
    spans: list[tuple[int, int, str]] = field(default_factory=list)   # (start, size, kind) filled by encode


@dataclass(frozen=True)
class Deep:
    """An array holding one array holding one array ... `depth` levels down, then an empty u32 array."""

    depth: int


def _value(out: bytearray, spans, vtype: int, value: Any) -> None:
    if vtype in SCALAR:
        spans.append((len(out), struct.calcsize(SCALAR[vtype]), f"scalar{vtype}"))
        out += struct.pack("<" + SCALAR[vtype], value)
    elif vtype == STRING:
        _string(out, spans, value)
    elif vtype == ARRAY and isinstance(value, Deep):   # written iteratively: deeper than recursion goes
        for _ in range(value.depth):
            out += struct.pack("<IQ", ARRAY, 1)
        out += struct.pack("<IQ", 4, 0)
    elif vtype == ARRAY:
        item, items = value
        spans.append((len(out), 4, "item_type"))
        out += struct.pack("<I", item)
        spans.append((len(out), 8, "array_len"))
        out += struct.pack("<Q", len(items))
        for v in items:
            _value(out, spans, item, v)
    else:
        raise AssertionError(vtype)


def _string(out: bytearray, spans, s: str | bytes) -> None:
    raw = s.encode() if isinstance(s, str) else s
    spans.append((len(out), 8, "str_len"))
    out += struct.pack("<Q", len(raw))
    spans.append((len(out), len(raw), "str_bytes"))
    out += raw


def encode(m: Model) -> bytes:
    """The bytes of `m`, laid out as GGUFWriter lays them out; fills m.spans."""
    out, spans = bytearray(b"GGUF"), []
    spans.append((0, 4, "magic"))
    for kind, fmt, v in (("version", "<I", m.version), ("n_tensors", "<Q", len(m.tensors)),
                         ("n_kv", "<Q", len(m.kvs))):
        spans.append((len(out), struct.calcsize(fmt), kind))
        out += struct.pack(fmt, v)
    for key, vtype, value in m.kvs:
        _string(out, spans, key)
        spans.append((len(out), 4, "value_type"))
        out += struct.pack("<I", vtype)
        _value(out, spans, vtype, value)
    for name, ne, gtype, offset in m.tensors:
        _string(out, spans, name)
        spans.append((len(out), 4, "n_dims"))
        out += struct.pack("<I", len(ne))
        for d in ne:
            spans.append((len(out), 8, "ne"))
            out += struct.pack("<Q", d)
        spans.append((len(out), 4, "ggml_type"))
        out += struct.pack("<I", gtype)
        spans.append((len(out), 8, "offset"))
        out += struct.pack("<Q", offset)
    out += bytes(-len(out) % m.alignment)
    spans.append((len(out), len(m.data), "data"))
    m.spans = spans
    return bytes(out + m.data)


def model_of(reader: GGUFReader, raw: bytes) -> Model:
    """The Model of a file as gguf-py's reader sees it."""
    kvs = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        vtype = int(f.types[0])
        if vtype == ARRAY:
            item = int(f.types[1])
            items = [bytes(f.parts[i]) if item == STRING else f.parts[i].tolist()[0] for i in f.data]
            kvs.append((name, vtype, (item, items)))
        elif vtype == STRING:
            kvs.append((name, vtype, bytes(f.parts[f.data[0]])))
        else:
            kvs.append((name, vtype, f.parts[f.data[0]].tolist()[0]))
    tensors = [(t.name, [int(x) for x in t.shape], int(t.tensor_type), int(t.data_offset - reader.data_offset))
               for t in reader.tensors]
    version = int(reader.fields["GGUF.version"].parts[-1][0])
    return Model(version, kvs, tensors, raw[reader.data_offset:])


def _blocks(shape: tuple[int, ...], t: T) -> np.ndarray:
    """Weights of `shape` in type `t`: gguf-py's quantization of random values, or random blocks for
    the types gguf-py cannot quantize (all block bytes are valid data)."""
    rng = np.random.default_rng(sum(shape))
    if shape == SEED_TENSORS["rope_freqs.weight"][0]:      # rope frequency divisors: positive
        return np.linspace(1.0, 4.0, shape[0], dtype=np.float32)
    if t in (T.IQ4_NL, T.Q2_K):
        block, size = GGML_QUANT_SIZES[t]
        return rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    return quants.quantize(rng.standard_normal(shape).astype(np.float32), t)


SEED_TENSORS = {   # gguf name: (numpy shape [N, K], type)
    "token_embd.weight": ((VOCAB, H), T.Q8_0), "blk.0.attn_norm.weight": ((H,), T.F32),
    "blk.0.ffn_norm.weight": ((H,), T.F32), "blk.0.attn_q.weight": ((H, H), T.Q4_0),
    "blk.0.attn_k.weight": ((KV * H // HEADS, H), T.Q5_1), "blk.0.attn_v.weight": ((KV * H // HEADS, H), T.Q4_1),
    "blk.0.attn_output.weight": ((H, H), T.Q5_0), "blk.0.ffn_gate.weight": ((FF, H), T.BF16),
    "blk.0.ffn_up.weight": ((FF, H), T.IQ4_NL), "blk.0.ffn_down.weight": ((H, FF), T.Q2_K),
    "output_norm.weight": ((H,), T.F32), "output.weight": ((VOCAB, H), T.F16),
    "rope_freqs.weight": ((H // HEADS // 2,), T.F32),
}


@functools.cache
def seed_file() -> tuple[Model, bytes]:
    """(Model, bytes) of the seed file; its encoding equals GGUFWriter's bytes exactly."""
    path = _DIR / "seed.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.embedding_length", H)
    w.add_uint32("llama.feed_forward_length", FF)
    w.add_uint32("llama.attention.head_count", HEADS)
    w.add_uint32("llama.attention.head_count_kv", KV)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint64("llama.context_length", 256)
    w.add_string("general.name", "seed")
    w.add_uint32("general.alignment", 32)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(VOCAB)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(VOCAB)])
    w.add_int32("tokenizer.ggml.bos_token_id", 1)
    w.add_int32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("llama.use_parallel_residual", False)
    for name, (shape, t) in SEED_TENSORS.items():
        w.add_tensor(name, _blocks(shape, t), raw_dtype=None if t in (T.F32, T.F16) else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = path.read_bytes()
    m = model_of(GGUFReader(path), raw)
    assert encode(m) == raw, "the test's encoder must reproduce GGUFWriter's bytes"
    return m, raw


def test_seed_loads():
    """The unmutated seed loads whole: the fuzz starts from a file every reader stage accepts."""
    raw = seed_file()[1]
    path = _DIR / "seed-copy.gguf"
    path.write_bytes(raw)
    assert loads_or_refuses("gguf-seed", lambda: load_everything(path), len(raw)) is None


# --- strategies ----------------------------------------------------------------------------------
EDGE_INTS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 64, 255, 256, 1023, 2**15, 2**16 - 1, 2**16, 2**31 - 1,
             2**31, 2**32 - 1, 2**32, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]


def interesting(width: int, old: int = 0) -> st.SearchStrategy[int]:
    """Unsigned values of `width` bytes worth trying: edges, the old value nudged, anything."""
    top = (1 << (8 * width)) - 1
    near = [v % (top + 1) for v in (old - 1, old + 1, old * 2, old + 2**32, -old)]
    return st.one_of(st.sampled_from([v for v in EDGE_INTS if v <= top] + near), st.integers(0, top))


def scalar_value(vtype: int) -> st.SearchStrategy[Any]:
    fmt = SCALAR[vtype]
    if fmt == "?":
        return st.booleans()
    if fmt in "fd":
        return st.floats(width=32 if fmt == "f" else 64)
    bits = 8 * struct.calcsize(fmt)
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if fmt.islower() else (0, (1 << bits) - 1)
    return st.one_of(st.sampled_from([lo, hi, 0, 1, -1 if lo else 2]), st.integers(lo, hi))


STRINGS = st.one_of(st.text(max_size=12), st.binary(max_size=12),
                    st.sampled_from(["llama", "qwen2", "mistral", "gpt2", "none", "linear", "yarn", ""]))


@st.composite
def typed_value(draw, depth: int = 0) -> tuple[int, Any]:
    """(value type, value) of any GGUF metadata type; arrays may nest."""
    vtype = draw(st.sampled_from(sorted(SCALAR) + [STRING, ARRAY] if depth < 3 else sorted(SCALAR) + [STRING]))
    if vtype in SCALAR:
        return vtype, draw(scalar_value(vtype))
    if vtype == STRING:
        return vtype, draw(STRINGS)
    item = draw(st.sampled_from(sorted(SCALAR) + [STRING, ARRAY] if depth < 2 else sorted(SCALAR) + [STRING]))
    if item == ARRAY:
        inner = draw(st.lists(typed_value(depth + 1), max_size=3))
        sub = draw(st.sampled_from(sorted(SCALAR) + [STRING]))
        return ARRAY, (ARRAY, [(sub, [v for t, v in inner if t == sub]) for _ in inner])
    items = draw(st.lists(scalar_value(item) if item in SCALAR else STRINGS, max_size=10))
    return ARRAY, (item, items)


KEYS = ["general.alignment", "general.architecture", "general.name", "llama.block_count",
        "llama.embedding_length", "llama.feed_forward_length", "llama.attention.head_count",
        "llama.attention.head_count_kv", "llama.attention.key_length", "llama.rope.dimension_count",
        "llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base", "llama.vocab_size",
        "llama.context_length", "llama.attention.sliding_window", "llama.rope.scaling.type",
        "llama.rope.scaling.factor", "tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id", "tokenizer.ggml.bos_token_id", "general.file_type",
        "tokenizer.chat_template"]
NAMES = list(SEED_TENSORS) + ["blk.0.attn_q.bias", "blk.0.attn_q_norm.weight", "blk.1.attn_q.weight",
                              "blk.x.attn_q.weight", "unknown.weight", "output", ""]
GGML_IDS = st.one_of(st.integers(0, 45), st.sampled_from([2**31, 2**32 - 1]))


@st.composite
def model_edit(draw, m: Model) -> Model:
    """One to three edits of the model's structure, re-encoded with consistent counts."""
    m = copy.deepcopy(m)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["set_kv", "set_kv", "drop_kv", "dup_kv", "add_kv", "deep_array", "dims",
                                   "type", "offset", "drop_tensor", "dup_tensor", "rename", "version",
                                   "data", "alignment"]))
        if op in ("set_kv", "drop_kv", "dup_kv") and m.kvs:
            i = draw(st.integers(0, len(m.kvs) - 1))
            if op == "set_kv":
                m.kvs[i] = (m.kvs[i][0], *draw(typed_value()))
            elif op == "drop_kv":
                del m.kvs[i]
            else:
                m.kvs.insert(draw(st.integers(0, len(m.kvs))), m.kvs[i])
        elif op == "add_kv":
            m.kvs.append((draw(st.sampled_from(KEYS)), *draw(typed_value())))
        elif op == "deep_array":          # arrays of arrays, nested far deeper than any real file
            m.kvs.append((draw(st.sampled_from(KEYS)), ARRAY, Deep(draw(st.integers(1, 5000)))))
        elif op in ("dims", "type", "offset", "drop_tensor", "dup_tensor", "rename") and m.tensors:
            i = draw(st.integers(0, len(m.tensors) - 1))
            name, ne, gtype, offset = m.tensors[i]
            if op == "dims":
                ne = draw(st.lists(st.one_of(st.sampled_from(EDGE_INTS), st.integers(0, 300)), max_size=5))
            elif op == "type":
                gtype = draw(GGML_IDS)
            elif op == "offset":
                offset = draw(st.one_of(interesting(8, offset), st.integers(0, 64).map(lambda x: 32 * x)))
            elif op == "rename":
                name = draw(st.sampled_from(NAMES))
            if op == "drop_tensor":
                del m.tensors[i]
            elif op == "dup_tensor":
                m.tensors.append(m.tensors[i])
            else:
                m.tensors[i] = (name, ne, gtype, offset)
        elif op == "version":
            m.version = draw(st.sampled_from([0, 1, 2, 3, 4, 2**16, 3 << 16, 2**32 - 1]))
        elif op == "data":
            cut = draw(st.integers(0, len(m.data)))
            m.data = m.data[:cut] + draw(st.binary(max_size=64))
        elif op == "alignment":
            m.alignment = draw(st.sampled_from([1, 8, 16, 64, 256]))
            m.kvs = [kv for kv in m.kvs if kv[0] != "general.alignment"]
            m.kvs.append(("general.alignment", draw(st.sampled_from([4, 10])), m.alignment))
    return m


@st.composite
def mutated(draw) -> bytes:
    """A mutation of the seed file, chosen among the structural kinds in the module docstring."""
    m, raw = seed_file()
    kind = draw(st.sampled_from(["field", "field", "cut", "flip", "model", "model", "model_then_field"]))
    if kind in ("model", "model_then_field"):
        m = draw(model_edit(m))
        raw = encode(m)
        if kind == "model":
            return raw
    data = bytearray(raw)
    if kind in ("field", "model_then_field"):
        for _ in range(draw(st.integers(1, 2))):
            start, size, what = draw(st.sampled_from([s for s in m.spans if s[1] and s[2] != "data"]))
            if what in ("str_bytes",) or size not in (1, 2, 4, 8):
                data[start:start + size] = draw(st.binary(min_size=size, max_size=size))
            else:
                old = int.from_bytes(data[start:start + size], "little")
                data[start:start + size] = draw(interesting(size, old)).to_bytes(size, "little")
        return bytes(data)
    if kind == "cut":
        bounds = sorted({b for s, n, _ in m.spans for b in (s, s + n)})
        at = draw(st.sampled_from(bounds)) + draw(st.integers(-2, 2))
        return bytes(data[:max(0, min(at, len(data) - 1))])
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


# --- the property ------------------------------------------------------------------------------
def load_everything(path: Path) -> None:
    """Load the checkpoint and read (and decode) every tensor."""
    ck = load_gguf(path, tokenizer=False)
    for name in ck.tensors:
        t = ck.tensors[name]
        if isinstance(t, QTensor):
            t.dequantize()


def same(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN, lists item by item."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)


def agrees_with_gguf_py(path: Path) -> None:
    """What quanta accepted, gguf-py reads alike: metadata values, tensor names, types, shapes, byte ranges."""
    ours = read_gguf(path)
    try:
        theirs = GGUFReader(path)
    except Exception:            # gguf-py refuses some files quanta accepts (it is no validator)
        return
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(ours.metadata)
    for key, f in fields.items():
        if ARRAY not in f.types[1:]:       # gguf-py's contents() gives [] for arrays of arrays
            assert same(f.contents(), ours.metadata[key]), key
    # q8_1 blocks are 36 bytes (ggml-common.h); gguf-py 0.19 still says 40, so its size is not compared.
    got = [(t.name, t.type.id, t.dims, t.start, t.nbytes * (t.type.id != Q8_1)) for t in ours.tensors]
    want = [(t.name, int(t.tensor_type), tuple(int(x) for x in reversed(t.shape)), t.data_offset,
             t.n_bytes * (int(t.tensor_type) != Q8_1)) for t in theirs.tensors]
    assert got == want


def check(raw: bytes) -> None:
    """The property for one file; a failing file is kept as _DIR/failing.gguf for a regression test."""
    path = _DIR / "fuzz.gguf"
    path.write_bytes(raw)
    try:
        if loads_or_refuses("gguf", lambda: load_everything(path), len(raw)) is None or \
                loads_or_refuses("gguf-header", lambda: read_gguf(path), len(raw)) is None:
            agrees_with_gguf_py(path)
    except BaseException:
        (_DIR / "failing.gguf").write_bytes(raw)
        raise


@FUZZ
@given(data=st.data())
def test_fuzz_gguf(data):
    check(data.draw(mutated()))
