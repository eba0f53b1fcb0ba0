"""Fuzzing the safetensors reader (quanta/loaders/safetensors_io.py) under the plain HF loader.

The seed is a tiny llama checkpoint: config.json and weights written by safetensors.torch.save_file,
either one model.safetensors or two shards and a model.safetensors.index.json. A mutation parses the
file's structure (u64 header length, JSON header, data section) and edits it: a header entry's dtype,
shape or data_offsets set to another value or type, entries dropped, renamed or duplicated,
`__metadata__` of another type, the whole header replaced by other JSON (deep nesting, huge numbers,
NaN), the length field set to an edge value, the data cut at a tensor boundary, bytes flipped; or the
index's weight_map edited (shard names that are missing, absolute or climb out of the directory).
Besides the property of tests/fuzz_support.py: a header quanta accepts, safetensors itself (the oracle)
must open, and read every tensor of, with the same dtype and shape.
"""
from __future__ import annotations

import functools
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from fuzz_support import FUZZ, fuzz_dir, loads_or_refuses
from quanta.loaders.hf import load_hf
from quanta.loaders.safetensors_io import read_safetensors_header

H, FF, HEADS, KV, VOCAB = 32, 64, 2, 1, 8
_DIR = fuzz_dir("st")
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": H,
          "intermediate_size": FF, "num_hidden_layers": 1, "num_attention_heads": HEADS,
          "num_key_value_heads": KV, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False}


def seed_tensors() -> dict[str, torch.Tensor]:
    """The tiny llama's tensors, written out by name (not from quanta's canonical_shapes)."""
    g, d = torch.Generator().manual_seed(0), H // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, H), "model.layers.0.self_attn.q_proj.weight": (H, H),
              "model.layers.0.self_attn.k_proj.weight": (KV * d, H), "model.layers.0.self_attn.v_proj.weight": (KV * d, H),
              "model.layers.0.self_attn.o_proj.weight": (H, H), "model.layers.0.mlp.gate_proj.weight": (FF, H),
              "model.layers.0.mlp.up_proj.weight": (FF, H), "model.layers.0.mlp.down_proj.weight": (H, FF),
              "model.layers.0.input_layernorm.weight": (H,), "model.layers.0.post_attention_layernorm.weight": (H,),
              "model.norm.weight": (H,), "lm_head.weight": (VOCAB, H)}
    out = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    out["model.layers.0.mlp.down_proj.weight"] = out["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16)
    out["model.norm.weight"] = out["model.norm.weight"].to(torch.float16)
    return out


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header JSON, data section) of a safetensors file."""
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: Any, data: bytes, pad: int = 0) -> bytes:
    """A safetensors file of `header` (any JSON-able value) and `data`; `pad` spaces after the JSON."""
    text = json.dumps(header, allow_nan=True).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


@functools.cache
def seed() -> dict[str, bytes]:
    """file name -> bytes of the single-file seed and the sharded seed (prefixed "sharded/")."""
    tensors = seed_tensors()
    save_file(tensors, str(_DIR / "model.safetensors"), metadata={"format": "pt"})
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:6]}, str(_DIR / "a.safetensors"))
    save_file({n: tensors[n] for n in names[6:]}, str(_DIR / "b.safetensors"))
    index = {"metadata": {"total_size": 0},
             "weight_map": {n: "model-00001-of-00002.safetensors" if i < 6 else "model-00002-of-00002.safetensors"
                            for i, n in enumerate(names)}}
    return {"model.safetensors": (_DIR / "model.safetensors").read_bytes(),
            "sharded/model-00001-of-00002.safetensors": (_DIR / "a.safetensors").read_bytes(),
            "sharded/model-00002-of-00002.safetensors": (_DIR / "b.safetensors").read_bytes(),
            "sharded/model.safetensors.index.json": json.dumps(index).encode()}


# --- strategies ----------------------------------------------------------------------------------
EDGE = [0, 1, 2, -1, -2, 7, 8, 31, 32, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE), st.integers(),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
JSON_ANY = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=12)
DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3",
          "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "C64", "f32", "", "XYZ"]


@st.composite
def entry_edit(draw, header: dict[str, Any]) -> dict[str, Any]:
    """The header with one tensor entry edited, dropped, renamed or duplicated."""
    names = [n for n, e in header.items() if n != "__metadata__" and isinstance(e, dict)]
    if not names:
        return header
    name = draw(st.sampled_from(names))
    e = dict(header[name])
    op = draw(st.sampled_from(["dtype", "shape", "shape", "offsets", "offsets", "drop_field", "extra_field",
                               "not_a_dict", "drop", "rename", "dup"]))
    if op == "dtype":
        e["dtype"] = draw(st.one_of(st.sampled_from(DTYPES), JSON_ANY))
    elif op == "shape":
        e["shape"] = draw(st.one_of(st.lists(st.one_of(st.sampled_from(EDGE), st.integers(0, 64)), max_size=5),
                                    st.lists(JSON_SCALARS, max_size=3), JSON_ANY))
    elif op == "offsets":
        offsets = e.get("data_offsets")
        ok = isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
        begin, end = offsets if ok else (0, 0)
        e["data_offsets"] = draw(st.one_of(
            st.tuples(st.sampled_from(EDGE + [begin, end, begin + 1, end - 1]),
                      st.sampled_from(EDGE + [begin, end, begin + 1, end + 1])).map(list),
            st.lists(st.integers(-4, 10**6), max_size=4), JSON_ANY))
    elif op == "drop_field" and e:
        del e[draw(st.sampled_from(sorted(e)))]
    elif op == "extra_field":
        e[draw(st.text(max_size=6))] = draw(JSON_ANY)
    header = dict(header)
    if op == "not_a_dict":
        header[name] = draw(JSON_ANY)
    elif op == "drop":
        del header[name]
    elif op == "rename":
        header[draw(st.sampled_from(names + ["", "__metadata__", "x" * 300]))] = header.pop(name)
    elif op == "dup":
        header[draw(st.sampled_from(names))] = e
    else:
        header[name] = e
    return header


@st.composite
def mutated_file(draw, raw: bytes) -> bytes:
    """A structural mutation of one safetensors file (see the module docstring)."""
    header, data = split(raw)
    start = len(raw) - len(data)            # the structure's boundaries, for cuts: before any edit
    bounds = sorted({start + x for e in header.values() if "data_offsets" in e for x in e["data_offsets"]}
                    | {0, 4, 8, start})
    kind = draw(st.sampled_from(["entry", "entry", "entry", "metadata", "header", "deep", "number", "length",
                                 "cut", "flip", "pad", "entry_then_cut"]))
    if kind in ("entry", "entry_then_cut"):
        for _ in range(draw(st.integers(1, 2))):
            header = draw(entry_edit(header))
        raw = join(header, data)
        if kind == "entry":
            return raw
    if kind == "metadata":
        return join({**header, "__metadata__": draw(JSON_ANY)}, data)
    if kind == "header":
        return join(draw(JSON_ANY), data)
    if kind == "deep":
        depth = draw(st.integers(1, 200_000))
        text = b"[" * depth + b"]" * depth
        return struct.pack("<Q", len(text)) + text + data
    if kind == "number":
        text = draw(st.sampled_from([b'{"a": 1e400}', b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}',
                                     b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}',
                                     b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
                                     b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}',
                                     b'\xff\xfe{}', b'{"a": 1', b"", b"null"]))
        return struct.pack("<Q", len(text)) + text + data[:4]
    if kind == "pad":
        return join(header, data, pad=draw(st.integers(1, 64)))
    if kind == "length":
        (n,) = struct.unpack_from("<Q", raw)
        value = draw(st.sampled_from([0, 1, 2, n - 1, n + 1, n + 8, len(raw), len(raw) - 8, 2**32, 2**63, 2**64 - 1,
                                      100 * 1024 * 1024 + 1]))
        return struct.pack("<Q", value % 2**64) + raw[8:]
    if kind in ("cut", "entry_then_cut"):
        at = draw(st.sampled_from(bounds)) + draw(st.integers(-2, 2))
        return raw[:max(0, min(at, len(raw) - 1))]
    out = bytearray(raw)
    for _ in range(draw(st.integers(1, 8))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
    return bytes(out)


@st.composite
def mutated_index(draw) -> dict[str, Any]:
    """A sharded checkpoint's index with its weight_map (or the whole index) edited."""
    index = json.loads(seed()["sharded/model.safetensors.index.json"])
    wm = index["weight_map"]
    op = draw(st.sampled_from(["shard_name", "shard_name", "drop", "weight_map", "metadata", "index"]))
    if op == "shard_name":
        name = draw(st.sampled_from(sorted(wm)))
        wm[name] = draw(st.one_of(st.sampled_from(["missing.safetensors", "/etc/hostname", "../model.safetensors",
                                                   "sub/../model-00001-of-00002.safetensors", "", ".",
                                                   "model-00002-of-00002.safetensors"]), JSON_ANY))
    elif op == "drop":
        del wm[draw(st.sampled_from(sorted(wm)))]
    elif op == "weight_map":
        index["weight_map"] = draw(JSON_ANY)
    elif op == "metadata":
        index["metadata"] = draw(JSON_ANY)
    else:
        index = draw(JSON_ANY)
    return index


@st.composite
def mutated(draw) -> dict[str, bytes]:
    """A whole checkpoint directory (file name -> bytes) with one file mutated."""
    files = seed()
    if draw(st.booleans()):
        return {"model.safetensors": draw(mutated_file(files["model.safetensors"]))}
    sharded = {k.removeprefix("sharded/"): v for k, v in files.items() if k.startswith("sharded/")}
    target = draw(st.sampled_from(sorted(sharded)))
    if target.endswith(".json"):
        sharded[target] = json.dumps(draw(mutated_index()), allow_nan=True).encode()
    else:
        sharded[target] = draw(mutated_file(sharded[target]))
    return sharded


# --- the property ------------------------------------------------------------------------------
def load_everything(path: Path) -> None:
    """Load the checkpoint and read every tensor."""
    ck = load_hf(path, tokenizer=False)
    for name in ck.tensors:
        ck.tensors[name]


def agrees_with_safetensors(file: Path) -> None:
    """A header quanta accepted, safetensors opens alike, and reads every tensor of."""
    infos, _ = read_safetensors_header(file)
    with safe_open(str(file), framework="pt") as f:
        assert sorted(f.keys()) == sorted(infos)
        for name, info in infos.items():
            t = f.get_slice(name)
            assert (t.get_dtype(), tuple(t.get_shape())) == (info.dtype, info.shape), name
            f.get_tensor(name)


def check(files: dict[str, bytes]) -> None:
    """The property for one checkpoint directory; a failing one is kept as _DIR/failing/."""
    ckpt = _DIR / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    for name, raw in files.items():
        (ckpt / name).write_bytes(raw)
    size = sum(map(len, files.values()))
    try:
        loads_or_refuses("safetensors", lambda: load_everything(ckpt), size)
        for name in files:
            if name.endswith(".safetensors") and \
                    loads_or_refuses("safetensors-header", lambda: read_safetensors_header(ckpt / name), size) is None:
                agrees_with_safetensors(ckpt / name)
    except BaseException:
        shutil.rmtree(_DIR / "failing", ignore_errors=True)
        shutil.copytree(ckpt, _DIR / "failing")
        raise


def test_seed_loads():
    """Both unmutated seeds load whole, so the fuzz starts from checkpoints every stage accepts."""
    files = seed()
    check({"model.safetensors": files["model.safetensors"]})
    check({k.removeprefix("sharded/"): v for k, v in files.items() if k.startswith("sharded/")})
    assert loads_or_refuses("seed", lambda: load_everything(_DIR / "ckpt"), 1) is None


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors(data):
    check(data.draw(mutated()))
