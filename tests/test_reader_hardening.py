"""Regression tests for reader bugs the fuzzers (tests/test_fuzz_*.py) found: each a small explicit input
that used to crash with an untyped exception, hang, or load nonsense, and now gets a typed QuantaError."""
from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest

from quanta.loaders.awq import awq_settings
from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.compressed_tensors import groups as ct_groups
from quanta.loaders.fp8 import fp8_settings
from quanta.loaders.gguf.reader import load_gguf
from quanta.loaders.gptq import gptq_settings
from quanta.loaders.hf import model_config_from_hf
from quanta.loaders.safetensors_io import SAFETENSORS_INDEX, SafetensorsDir, read_config, read_safetensors_header
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError, UnsupportedError
from test_fuzz_gguf import ARRAY, Deep, encode, seed_file


def gguf_with(tmp_path, kvs=None, tensors=None, name="x.gguf"):
    """The fuzz seed file with metadata entries replaced / added (`kvs`: key -> (type, value)) and tensor
    infos edited (`tensors`: name -> (ne, type) or None to drop)."""
    m = copy.deepcopy(seed_file()[0])
    for key, (vtype, value) in (kvs or {}).items():
        m.kvs = [kv for kv in m.kvs if kv[0] != key] + [(key, vtype, value)]
    for tname, edit in (tensors or {}).items():
        m.tensors = [t if t[0] != tname else (tname, *edit, t[3]) for t in m.tensors if t[0] != tname or edit]
    path = tmp_path / name
    path.write_bytes(encode(m))
    return path


def test_gguf_deeply_nested_array(tmp_path):
    """Was RecursionError: an array of arrays 5000 deep."""
    with pytest.raises(CorruptFileError, match="x.gguf.*nested more than 8 deep"):
        load_gguf(gguf_with(tmp_path, {"general.name": (ARRAY, Deep(5000))}), tokenizer=False)


@pytest.mark.parametrize("key, vtype, value, match", [
    ("llama.attention.head_count", 8, "two", "'llama.attention.head_count' must be an integer, got str two"),
    ("llama.embedding_length", 9, (4, [32]), "'llama.embedding_length' must be an integer, got list"),
    ("llama.block_count", 7, True, "'llama.block_count' must be an integer, got bool"),
    ("llama.rope.freq_base", 8, "1e4", "'llama.rope.freq_base' must be a number"),
])
def test_gguf_metadata_of_the_wrong_type(tmp_path, key, vtype, value, match):
    """Were TypeError / ValueError from arithmetic on the value (or a bool taken as 1)."""
    with pytest.raises(ConfigError, match=f"x.gguf: GGUF metadata {match}"):
        load_gguf(gguf_with(tmp_path, {key: (vtype, value)}), tokenizer=False)


def test_gguf_zero_heads(tmp_path):
    """Was ZeroDivisionError computing head_dim = hidden // heads."""
    with pytest.raises(ConfigError, match="x.gguf.*num_attention_heads must be a positive integer, got 0"):
        load_gguf(gguf_with(tmp_path, {"llama.attention.head_count": (4, 0)}), tokenizer=False)


@pytest.mark.parametrize("value, match", [(float("nan"), "rope_theta.*nan"), (0.0, "rope_theta.*0.0")])
def test_gguf_rope_theta_not_positive_finite(tmp_path, value, match):
    """Were accepted, then NaN or divide-by-zero in the rope frequencies."""
    with pytest.raises(ConfigError, match=f"x.gguf.*{match}"):
        load_gguf(gguf_with(tmp_path, {"llama.rope.freq_base": (6, value)}), tokenizer=False)


def test_gguf_empty_rope_freqs(tmp_path):
    """Was RuntimeError from torch viewing 0 bytes as float32."""
    with pytest.raises(CorruptFileError, match="x.gguf: tensor 'rope_freqs.weight' has shape \\[0\\]"):
        load_gguf(gguf_with(tmp_path, tensors={"rope_freqs.weight": ([0], 0)}), tokenizer=False)


def test_gguf_tensor_shape_disagrees_with_metadata(tmp_path):
    """Was accepted: token_embd with 16 rows in a file whose vocabulary is 8 tokens."""
    with pytest.raises(ShapeError, match=r"x.gguf: tensor 'token_embd.weight' has shape \[16, 32\].*\[8, 32\]"):
        load_gguf(gguf_with(tmp_path, tensors={"token_embd.weight": ([32, 16], 8)}), tokenizer=False)


def test_gguf_layer_beyond_block_count(tmp_path):
    """Was accepted: a blk.3 tensor in a file whose block_count is 1."""
    m = copy.deepcopy(seed_file()[0])
    m.tensors = [(n.replace("blk.0.attn_norm", "blk.3.attn_norm"), *rest) for n, *rest in m.tensors]
    (tmp_path / "x.gguf").write_bytes(encode(m))
    with pytest.raises(CorruptFileError, match="x.gguf: tensor 'blk.3.attn_norm.weight' is not part of the 1-layer"):
        load_gguf(tmp_path / "x.gguf", tokenizer=False)


def test_model_config_refuses_non_numbers():
    """ModelConfig itself: bools, NaN and non-integer token ids are refused by name."""
    base = dict(model_type="llama", vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    ModelConfig(**base)
    for field, value in (("hidden_size", True), ("rms_norm_eps", float("nan")), ("eos_token_id", "2"),
                         ("max_position_embeddings", 0), ("sliding_window", -4), ("rope_scaling", [1])):
        with pytest.raises(ConfigError, match=f"model config: .*{field}"):
            ModelConfig(**{**base, field: value})


# --- safetensors ---------------------------------------------------------------------------------
def st_file(tmp_path, header: bytes | dict, data: bytes = bytes(16)) -> Path:
    """A .safetensors file of a raw or dict header and `data`."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, match", [
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON as Python reads it \\(RecursionError"),
    (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 16]}}',
     "not valid JSON as Python reads it \\(ValueError"),                                        # was ValueError
    (b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 16]}}', "shape must be a list of sizes"),
    ({"a": entry(dtype=["F32"])}, "dtype must be a string"),                                # was TypeError
    ({"a": entry(shape=(-1, -4))}, "shape must be a list of sizes"),                        # was accepted
    ({"a": entry(shape=(2.0, 2))}, "shape must be a list of sizes"),                        # was accepted
    ({"a": entry(offsets=(0, 16, 3))}, "data_offsets must be"),
    ({"a": entry(), "b": entry(shape=(1,), offsets=(12, 16))}, "'b' starts at data byte 12, expected 16"),
    ({"__metadata__": [], "a": entry()}, "__metadata__ must map strings to strings"),       # was accepted
    ({"__metadata__": {"k": 1}, "a": entry()}, "__metadata__ must map strings to strings"),
])
def test_safetensors_bad_header(tmp_path, header, match):
    """Each was an untyped exception, or accepted only for safetensors to refuse it at the first read."""
    with pytest.raises(CorruptFileError, match=f"x.safetensors.*{match}"):
        read_safetensors_header(st_file(tmp_path, header))


def test_safetensors_unknown_dtype(tmp_path):
    """Was accepted at open, then failed at the first read."""
    with pytest.raises(UnsupportedError, match="x.safetensors: tensor 'a' has dtype 'XYZ'"):
        read_safetensors_header(st_file(tmp_path, {"a": entry(dtype="XYZ")}))


@pytest.mark.parametrize("shard", ["/etc/hostname", "../model.safetensors", "a/../../b.safetensors", "", ["x"]])
def test_index_shard_outside_the_directory(tmp_path, shard):
    """A weight_map entry naming a file outside the checkpoint (was opened) or not a string (TypeError)."""
    st_file(tmp_path, {"a": entry()})
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(CorruptFileError, match="tensor 'a' is mapped to .* not a file name inside"):
        SafetensorsDir(tmp_path)


def test_index_metadata_not_an_object(tmp_path):
    """Was ValueError from dict() of a list."""
    (tmp_path / SAFETENSORS_INDEX).write_text(json.dumps({"weight_map": {"a": "x.safetensors"}, "metadata": [[]]}))
    with pytest.raises(CorruptFileError, match="'weight_map' and 'metadata' must be JSON objects"):
        SafetensorsDir(tmp_path)


def test_config_json_nested_too_deep(tmp_path):
    """Was RecursionError from json.loads."""
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptFileError, match="config.json: not valid JSON"):
        read_config(tmp_path)


# --- config.json and quantization configs ---------------------------------------------------------
BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.mark.parametrize("edit, match", [
    ({"architectures": {"a": 1}}, "architectures must be a list of strings, got dict"),      # was KeyError
    ({"architectures": [["x"]]}, "architectures must be a list of strings"),                 # was TypeError
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a finite number, got str"),            # was ValueError
    ({"rope_theta": [1]}, "rope_theta must be a finite number, got list"),                   # was TypeError
    ({"rope_scaling": [[]]}, "rope_scaling must be a JSON object"),                          # was ValueError
    ({"max_position_embeddings": {}}, "max_position_embeddings must be an integer"),         # was TypeError
    ({"hidden_size": 32.0}, "hidden_size must be an integer, got float"),
])
def test_hf_config_field_of_the_wrong_type(edit, match):
    with pytest.raises(ConfigError, match=f"config.json: {match}"):
        model_config_from_hf({**BASE, **edit}, "config.json")


def test_hf_sliding_window_layer_count_is_not_enumerated():
    """Was a hang: qwen2's sliding layers were listed one by one for num_hidden_layers = 2**40."""
    cfg = {**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64,
           "num_hidden_layers": 2**40, "max_window_layers": 28}
    with pytest.raises(UnsupportedError, match="mixes sliding and full attention"):
        model_config_from_hf(cfg, "config.json")
    assert model_config_from_hf({**cfg, "max_window_layers": 0}, "config.json").sliding_window == 64


@pytest.mark.parametrize("settings, qc, match", [
    (awq_settings, {"bits": "gemv", "group_size": 32}, "bits must be an integer, got str"),       # was ValueError
    (awq_settings, {"bits": 4, "group_size": [128]}, "group_size must be an integer, got list"),  # was TypeError
    (awq_settings, {"bits": 4, "group_size": 32, "modules_to_not_convert": 5}, "modules_to_not_convert must be a list"),
    (awq_settings, {"bits": 4, "group_size": 32, "zero_point": "false"}, "zero_point must be true or false"),
    (gptq_settings, {"bits": 4, "group_size": {}}, "group_size must be an integer, got dict"),    # was TypeError
    (gptq_settings, {"bits": 4, "group_size": -5}, "group_size must be a positive integer or -1"),
])
def test_quant_settings_of_the_wrong_type(settings, qc, match):
    with pytest.raises(ConfigError, match=f"config.json: {match}"):
        settings(qc, Path("config.json"))


@pytest.mark.parametrize("group, match", [
    (1.5, "config_groups.g.weights is missing"),                                                  # was AttributeError
    ({"weights": {"num_bits": {}}, "format": "pack-quantized"}, "num_bits must be an integer"),   # was TypeError
    ({"weights": {"num_bits": 4}, "targets": [{"re": 1}], "format": "pack-quantized"}, "targets must be a list of "
                                                                                        "strings"),  # AttributeError
    ({"weights": {"num_bits": 4}, "targets": ["re:("], "format": "pack-quantized"}, "not a valid regular expression"),
])
def test_compressed_tensors_groups_of_the_wrong_type(group, match):
    with pytest.raises(ConfigError, match=match):
        ct_groups({"config_groups": {"g": group}}, Path("config.json"))


def test_block_sizes_of_the_wrong_type(tmp_path):
    """FP8 weight_block_size / compressed-tensors block_structure: were TypeError from tuple() of an int."""
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}}
    with pytest.raises(ConfigError, match="weight_block_size must be \\[rows, columns\\] of positive integers"):
        fp8_settings(tmp_path, cfg)
    group = {"weights": {"type": "float", "strategy": "block", "block_structure": [128, -1]},
             "format": "float-quantized"}
    with pytest.raises(ConfigError, match="block_structure must be \\[rows, columns\\]"):
        ct_groups({"config_groups": {"g": group}}, Path("config.json"))
