"""What every loader returns: a normalized model config, canonical tensors and the tokenizer."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from quanta.quant.errors import ConfigError
from quanta.quant.qtensor import QTensor

# Architectures the llama-family decoder implements (HF `architectures[0]` / GGUF general.architecture).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive_int(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    """The llama-family hyper-parameters, normalized from config.json or GGUF metadata.

    Names follow transformers' LlamaConfig so that `to_hf_dict()` builds a transformers config.
    """

    model_type: str                     # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None         # defaults to hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # bias on q/k/v (Qwen2)
    qk_norm: bool = False               # per-head RMSNorm on q and k (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: torch.dtype = torch.float32   # the checkpoint's own float dtype

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model config: num_attention_heads={self.num_attention_heads} is not a multiple "
                              f"of num_key_value_heads={self.num_key_value_heads}")
        # NaN, infinite or negative values would only surface as NaN logits, far from their cause.
        if not (_is_real(self.rms_norm_eps) and 0 <= self.rms_norm_eps < math.inf):
            raise ConfigError(f"model config: rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        if not (_is_real(self.rope_theta) and 0 < self.rope_theta < math.inf):
            raise ConfigError(f"model config: rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"model config: rope_scaling must be a mapping or absent, got {self.rope_scaling!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if not all(i is None or _is_int(i) for i in [self.bos_token_id, *eos]):
            raise ConfigError(f"model config: bos_token_id {self.bos_token_id!r} / eos_token_id "
                              f"{self.eos_token_id!r} must be token ids (integers)")

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def to_hf_dict(self) -> dict[str, Any]:
        """This config as a transformers config.json dict, the inverse of `hf.model_config_from_hf`.

        The rope settings go out in transformers-5 `rope_parameters` and also in the v4 keys `rope_theta` /
        `rope_scaling`, so older readers (vLLM, transformers 4) do not fall back to their default theta.
        """
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        out: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta, "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "dtype": str(self.torch_dtype).removeprefix("torch."), "use_cache": True,
        }
        if scaling:
            out["rope_scaling"] = scaling
        if self.model_type != "qwen2":              # Qwen2's q/k/v bias is implied by its architecture
            out["attention_bias"] = self.attention_bias
        if self.model_type in ("qwen2", "qwen3"):   # one window for every layer, or none
            out |= {"use_sliding_window": self.sliding_window is not None, "sliding_window": self.sliding_window,
                    "max_window_layers": 0 if self.sliding_window is not None else self.num_hidden_layers}
        else:
            out["sliding_window"] = self.sliding_window
        return out


@dataclass
class Checkpoint:
    """A loaded model: config, tensors under canonical HF llama names, tokenizer.

    `tensors` maps names like "model.layers.0.self_attn.q_proj.weight" to a plain torch.Tensor
    (norms, embeddings and unquantized layers) or a QTensor (quantized linear weights). It may be
    lazy (a Mapping that reads on access), so iterate it once.
    """

    path: Path
    format: str                                  # "gguf" | "hf" | "awq" | "gptq" | "bnb" | "fp8" | ...
    config: ModelConfig
    tensors: Mapping[str, torch.Tensor | QTensor]
    tokenizer: Any = None                        # transformers PreTrainedTokenizerBase
    quant_config: dict[str, Any] = field(default_factory=dict)   # the source's quantization metadata
    # Calibrated FP8 KV-cache scales by canonical name, "model.layers.{i}.self_attn.{k,v}_scale".
    kv_cache_scales: dict[str, torch.Tensor] = field(default_factory=dict)
    chat_template: str | None = None

    def read_on(self, device: torch.device | str) -> None:
        """Have quantized weights unpacked on `device` as they are read, where the loader can (the packed
        HF families: AWQ, GPTQ, bitsandbytes, FP8, compressed-tensors); other loaders hand out host tensors
        and the kernels' prepare moves them."""
        read_on = getattr(self.tensors, "read_on", None)
        if read_on is not None:
            read_on(device)
