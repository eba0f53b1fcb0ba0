"""Published model shapes by name (KNOWN_MODELS): what `quanta plan llama-3-8b` plans and what synthetic models
(`synthetic:llama-3-8b:w4g128`) are built at.

The shapes are the published config.json values (the Instruct releases where base and Instruct differ:
Qwen2.5's Instruct configs say 32768 positions). Llama 3.1 has Llama 3's shapes with 131072 positions
and llama3 RoPE scaling; Qwen2.5 carries a q/k/v bias. All were published in bfloat16.
"""
from __future__ import annotations

from typing import Any

import torch

from quanta.loaders.checkpoint import ModelConfig
from quanta.quant.errors import ConfigError

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, head_dim=128,
               torch_dtype=torch.bfloat16)
_QWEN25 = dict(model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True,
               max_position_embeddings=32768, torch_dtype=torch.bfloat16)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _shape(hidden: int, inter: int, layers: int, heads: int, kv: int, **kw: Any) -> dict[str, Any]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, **kw)


KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {**_LLAMA3, **_shape(4096, 14336, 32, 32, 8), "max_position_embeddings": 8192},
    "llama-3-70b": {**_LLAMA3, **_shape(8192, 28672, 80, 64, 8), "max_position_embeddings": 8192},
    "llama-3.1-8b": {**_LLAMA3, **_shape(4096, 14336, 32, 32, 8), "max_position_embeddings": 131072,
                     "rope_scaling": _llama3_rope(8.0)},
    "llama-3.1-70b": {**_LLAMA3, **_shape(8192, 28672, 80, 64, 8), "max_position_embeddings": 131072,
                      "rope_scaling": _llama3_rope(8.0)},
    "llama-3.2-1b": {**_LLAMA3, **_shape(2048, 8192, 16, 32, 8), "head_dim": 64, "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "rope_scaling": _llama3_rope(32.0)},
    "llama-3.2-3b": {**_LLAMA3, **_shape(3072, 8192, 28, 24, 8), "tie_word_embeddings": True,
                     "max_position_embeddings": 131072, "rope_scaling": _llama3_rope(32.0)},
    "qwen2.5-0.5b": {**_QWEN25, **_shape(896, 4864, 24, 14, 2), "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {**_QWEN25, **_shape(1536, 8960, 28, 12, 2), "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-3b": {**_QWEN25, **_shape(2048, 11008, 36, 16, 2), "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN25, **_shape(3584, 18944, 28, 28, 4), "vocab_size": 152064},
    "qwen2.5-14b": {**_QWEN25, **_shape(5120, 13824, 48, 40, 8), "vocab_size": 152064},
    "qwen2.5-32b": {**_QWEN25, **_shape(5120, 27648, 64, 40, 8), "vocab_size": 152064},
    "qwen2.5-72b": {**_QWEN25, **_shape(8192, 29568, 80, 64, 8), "vocab_size": 152064},
    "mistral-7b": {"model_type": "mistral", **_shape(4096, 14336, 32, 32, 8), "vocab_size": 32768,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
                   "torch_dtype": torch.bfloat16},
}


def known_config(name: str) -> ModelConfig:
    """The ModelConfig of a known shape name (case-insensitive); ConfigError listing the known names."""
    key = name.strip().lower()
    if key not in KNOWN_MODELS:
        raise ConfigError(f"unknown model {name!r}: not a file or directory, and not a known shape "
                          f"({', '.join(KNOWN_MODELS)})")
    return ModelConfig(**KNOWN_MODELS[key])
