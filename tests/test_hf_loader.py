"""Plain HF checkpoints: config normalization, exact tensors, sharding, dtypes, detect() and typed errors."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from tiny_models import ARCHS, build_tiny_hf, make_tiny_hf, tokenizer_dir  # noqa: E402

from quanta.loaders import load  # noqa: E402
from quanta.loaders.checkpoint import ModelConfig  # noqa: E402
from quanta.loaders.detection import detect  # noqa: E402
from quanta.loaders.hf import load_hf, load_tokenizer, model_config_from_hf  # noqa: E402
from quanta.loaders.safetensors_io import open_weights, read_config  # noqa: E402
from quanta.quant.errors import (ConfigError, CorruptFileError, QuantaError, ShapeError,  # noqa: E402
                                 UnsupportedError)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """One saved tiny checkpoint per architecture (qwen3 tied), built once: name -> (dir, model)."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: build_tiny_hf(arch, root / arch, tie=arch == "qwen3") for arch in ARCHS}


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def expected_fields(hf) -> dict:
    """What ModelConfig should hold, read independently from the transformers config object."""
    rope = dict(hf.rope_parameters)
    theta = rope.pop("rope_theta")
    return dict(
        model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rms_norm_eps=hf.rms_norm_eps, rope_theta=theta,
        rope_scaling=None if rope.get("rope_type") == "default" else rope,
        max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=hf.tie_word_embeddings,
        attention_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=hf.model_type == "qwen3", sliding_window=getattr(hf, "sliding_window", None),
        bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id, torch_dtype=hf.dtype)


# --- loading ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_and_tensors_match_transformers(models, arch):
    from transformers import AutoConfig

    path, model = models[arch]
    ckpt = load_hf(path)
    hf = AutoConfig.from_pretrained(path)
    got = {name: getattr(ckpt.config, name) for name in ModelConfig.field_names()}
    assert got == expected_fields(hf)
    state = model.state_dict()
    if hf.tie_word_embeddings:
        del state["lm_head.weight"]
    assert sorted(ckpt.tensors) == sorted(state)
    for name, tensor in ckpt.tensors.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name
    assert ckpt.format == "hf" and ckpt.quant_config == {}
    assert ckpt.chat_template is not None
    assert load(path).config == ckpt.config                      # dispatch through detect()


def test_specific_fields(models):
    assert load_hf(models["llama3_rope"][0]).config.rope_scaling["rope_type"] == "llama3"
    assert load_hf(models["llama3_rope"][0]).config.rope_theta == 500000.0
    assert load_hf(models["mistral"][0]).config.sliding_window == 16
    qwen2 = load_hf(models["qwen2"][0])
    assert qwen2.config.attention_bias and "model.layers.1.self_attn.k_proj.bias" in qwen2.tensors
    qwen3 = load_hf(models["qwen3"][0])
    assert qwen3.config.qk_norm and qwen3.config.head_dim == 32 and qwen3.config.tie_word_embeddings
    assert "lm_head.weight" not in qwen3.tensors and "model.layers.0.self_attn.q_norm.weight" in qwen3.tensors


def test_transformers4_config_layout(tmp_path):
    """A v4-style config.json (rope_theta + rope_scaling with 'type', torch_dtype) normalizes the same."""
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16"}
    config = model_config_from_hf(cfg, tmp_path / "config.json")
    assert config.rope_theta == 500000.0 and config.torch_dtype == torch.bfloat16
    assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    qwen2 = dict(cfg, architectures=["Qwen2ForCausalLM"], rope_scaling=None, sliding_window=32768,
                 use_sliding_window=False)
    assert model_config_from_hf(qwen2, tmp_path).sliding_window is None


def test_sharded_equals_unsharded(models, tmp_path):
    path, model = models["llama"]
    make_tiny_hf("llama", tmp_path / "sharded", max_shard_size="1MB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    a, b = load_hf(path), load_hf(tmp_path / "sharded")
    assert a.config == b.config and sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    with open_weights(tmp_path / "sharded") as store:
        assert store.metadata["total_size"] > 0 and store.info("model.norm.weight").shape == (64,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_kept(tmp_path, dtype):
    _, model = build_tiny_hf("llama", tmp_path / "m", dtype=dtype, tie=True)
    ckpt = load_hf(tmp_path / "m", tokenizer=False)
    assert ckpt.config.torch_dtype == dtype and ckpt.tokenizer is None
    state = model.state_dict()
    for name, tensor in ckpt.tensors.items():
        assert tensor.dtype == dtype and torch.equal(tensor, state[name]), name


def test_tokenizer_same_for_every_arch(models):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    text = "Hello world, the quick brown fox."
    for path, _ in models.values():
        assert load_tokenizer(path)(text)["input_ids"] == reference(text)["input_ids"]


# --- detect ------------------------------------------------------------------------------------------
QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "bnb": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "float-quantized"},
}
SIDECARS = {
    "quant_config.json": ({"w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}, "awq"),
    "quantize_config.json": ({"bits": 4, "group_size": 128, "desc_act": True}, "gptq"),
    "hf_quant_config.json": ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}, "fp8"),
}


def write_config(path: Path, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **extra}))
    return path


@pytest.mark.parametrize("family", list(QUANT_CONFIGS))
def test_detect_quantization_config(tmp_path, family):
    path = write_config(tmp_path / "model", quantization_config=QUANT_CONFIGS[family])
    assert detect(path) == family
    with pytest.raises(UnsupportedError, match=f"use the {family} loader"):
        load_hf(path)


@pytest.mark.parametrize("sidecar", list(SIDECARS))
def test_detect_sidecar(tmp_path, sidecar):
    content, family = SIDECARS[sidecar]
    path = write_config(tmp_path / "model")
    (path / sidecar).write_text(json.dumps(content))
    assert detect(path) == family


def test_detection_and_loaders_read_sidecars_in_one_order(tmp_path):
    from quanta.loaders.quantized import quant_config
    path = write_config(tmp_path / "model")
    for name, (content, _) in SIDECARS.items():
        (path / name).write_text(json.dumps(content))
    for name in ("quantize_config.json", "quant_config.json", "hf_quant_config.json"):
        content, family = SIDECARS[name]
        assert detect(path) == family, name
        want = {"quant_method": "modelopt", **content["quantization"]} if family == "fp8" else content
        assert quant_config(path, {}) == want, name
        (path / name).unlink()
    with pytest.raises(ConfigError, match="no quantization_config"):
        quant_config(path, {})


def test_detect_gguf_by_magic_not_name(tmp_path, models):
    (tmp_path / "weights.bin").write_bytes(b"GGUF" + b"\0" * 60)
    assert detect(tmp_path / "weights.bin") == "gguf"
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(UnsupportedError, match="fake.gguf"):
        detect(tmp_path / "fake.gguf")
    one = tmp_path / "dir"
    one.mkdir()
    (one / "model.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    assert detect(one) == "gguf"
    (one / "other.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(UnsupportedError, match="2 GGUF files"):
        detect(one)
    assert detect(models["llama"][0]) == "hf"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedError, match="empty: no config.json"):
        detect(tmp_path / "empty")
    with pytest.raises(UnsupportedError, match="'hqq'"):
        detect(write_config(tmp_path / "hqq", quantization_config={"quant_method": "hqq"}))


# --- errors name the file ----------------------------------------------------------------------------
def test_truncated_safetensors(models, tmp_path):
    path = copy_model(models["llama"][0], tmp_path / "m")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match=r"model\.safetensors.*truncated"):
        load_hf(path)


def test_garbage_and_bad_json_header(models, tmp_path):
    path = copy_model(models["llama"][0], tmp_path / "m")
    (path / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(CorruptFileError, match=r"model\.safetensors"):
        load_hf(path)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"{not json}")
    with pytest.raises(CorruptFileError, match=r"model\.safetensors.*not valid JSON"):
        load_hf(path)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 160]}}).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CorruptFileError, match=r"model\.safetensors.*'x'"):
        load_hf(path)


def test_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    make_tiny_hf("llama", path, max_shard_size="1MB", tokenizer=False)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CorruptFileError, match=shard.name):
        load_hf(path)


def test_missing_and_corrupt_config(models, tmp_path):
    path = copy_model(models["llama"][0], tmp_path / "m")
    (path / "config.json").write_text("{oops")
    with pytest.raises(CorruptFileError, match=r"config\.json"):
        load_hf(path)
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json"):
        read_config(path)
    with pytest.raises(UnsupportedError, match=str(path)):
        detect(path)


def test_unknown_architecture_and_bad_shapes(models, tmp_path):
    path = copy_model(models["llama"][0], tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedError, match=r"config\.json.*GPT2LMHeadModel"):
        load_hf(path)
    edit_config(path, architectures=["LlamaForCausalLM"], intermediate_size=96)
    with pytest.raises(ShapeError, match=r"model\.safetensors.*mlp\.gate_proj"):
        load_hf(path)


def test_missing_tokenizer(models, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(models["llama"][0] / f, path / f)
    assert load_hf(path).tokenizer is None
    with pytest.raises(QuantaError, match=rf"{path}.*tokenizer\.json"):
        load_tokenizer(path)
    with pytest.raises(QuantaError, match=str(path)):
        load_hf(path, tokenizer=True)


def test_pickle_refused_unless_opted_in(models, tmp_path):
    src, model = models["qwen2"]
    path = tmp_path / "m"
    path.mkdir()
    shutil.copy(src / "config.json", path / "config.json")
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    with pytest.raises(UnsupportedError, match=r"pytorch_model\.bin.*allow_pickle=True"):
        load_hf(path)
    ckpt = load(path, allow_pickle=True)
    state = model.state_dict()
    for name, tensor in ckpt.tensors.items():
        assert torch.equal(tensor, state[name]), name
