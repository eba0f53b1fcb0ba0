"""Synthetic checkpoints (quanta/loaders/synthetic.py): every tensor of the model's config made lazily, at the
published shapes too; GGUF formats hold every weight in the type llama-quantize gives it, as the memory plan
counts it; formats with zero points are asymmetric."""
from __future__ import annotations

import pytest
import torch

import quanta
from quanta.engine import LLM, SamplingParams
from quanta.loaders import load
from quanta.loaders.gguf.mix import assign
from quanta.loaders.gguf.writer import gguf_name
from quanta.loaders.hf import canonical_shapes
from quanta.loaders.shapes import known_config
from quanta.quant.errors import ConfigError
from quanta.quant.kinds import Affine, Gguf


def test_a_published_shape_has_its_config_and_every_tensor():
    """Qwen2.5-0.5B's shape: q/k/v biases, a tied lm_head (no tensor of its own), float16 unless bf16."""
    ckpt = load("synthetic:qwen2.5-0.5b:w4g128", device="cpu")
    want = known_config("qwen2.5-0.5b")
    assert (ckpt.config.hidden_size, ckpt.config.num_hidden_layers, ckpt.config.model_type) == (896, 24, "qwen2")
    assert ckpt.config.attention_bias and ckpt.config.tie_word_embeddings and ckpt.config.torch_dtype == torch.float16
    assert set(ckpt.tensors) == set(canonical_shapes(want)) and "lm_head.weight" not in ckpt.tensors
    bias = ckpt.tensors["model.layers.3.self_attn.k_proj.bias"]
    assert tuple(bias.shape) == (2 * 64,) and bias.abs().max() > 0


def test_a_biased_tied_model_generates():
    with LLM("synthetic:tiny-qwen2:w4g128", device="cpu", max_model_len=64, num_kv_blocks=8, quiet=True) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_gguf_mix_holds_the_types_llama_quantize_gives():
    """gguf-q4_K_M: every weight, the embedding and lm_head included, in its assigned type (the plan's)."""
    ckpt = load("synthetic:tiny-tp:gguf-q4_K_M", device="cpu")
    types = assign("Q4_K_M", ckpt.config)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.1.mlp.up_proj.weight"):
        t = ckpt.tensors[name]
        assert isinstance(t, Gguf) and t.type.name == types.of_tensor(gguf_name(name)), name
    assert quanta.plan("synthetic:tiny-tp:gguf-q4_K_M").quantization == "gguf:q4_K_M"


def test_zero_points_make_an_awq_style_weight():
    w = load("synthetic:tiny:w4g64z", device="cpu").tensors["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(w, Affine) and isinstance(w.zeros, torch.Tensor) and w.zeros.shape == w.scales.shape
    assert quanta.plan("synthetic:tiny:w4g64z").quantization.startswith("awq (4-bit, groups of 64, zero points")


@pytest.mark.parametrize("spec", ["synthetic:llama-9-400b:w4", "synthetic:tiny:gguf-q4_K_X", "synthetic:tiny:w4g64y"])
def test_an_unknown_shape_or_format_is_refused(spec):
    with pytest.raises(ConfigError, match="unknown synthetic"):
        load(spec)
