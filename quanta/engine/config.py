"""EngineConfig: the LLM(...) arguments, validated once (nano-vllm's Config)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quanta.quant.errors import ConfigError

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    quantization: str = "auto"          # "auto" or the family detect() must find (gguf, awq, ...)
    dtype: str | torch.dtype = "auto"   # compute dtype; auto: bf16 on CPU, the checkpoint's on GPU
    device: str | None = None           # default: cuda if available, else cpu
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    seed: int = 0
    tokenizer: str | None = None        # a tokenizer directory overriding the checkpoint's own
    kernel: str | None = None           # force one kernel (by NAME) for every quantized layer

    def __post_init__(self):
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for but no CUDA GPU is available")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Build from LLM(**kwargs), rejecting unknown names instead of ignoring them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"LLM: unknown argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def compute_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cpu":
            return torch.bfloat16
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.float16
