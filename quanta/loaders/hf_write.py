"""Plain Hugging Face checkpoints (fp32 / fp16 / bf16 safetensors), the inverse of hf.load_hf.

Quantized weights are dequantized one at a time (QTensor.dequantize computes in float32, then casts).
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import DEFAULT_SHARD_SIZE, Layout, Tensor, write_checkpoint
from quanta.quant.errors import ConfigError
from quanta.quant.qtensor import QTensor

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class HfLayout(Layout):
    """Every tensor as a plain float tensor of one dtype."""

    fmt = "hf"

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__(config)
        self.dtype = config.torch_dtype if dtype is None else dtype

    def convert_plain(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not t.is_floating_point():
            raise ConfigError(f"{name}: a plain HF checkpoint holds float tensors, got {t.dtype}")
        return {name: t.to(self.dtype)}

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        return {name: qt.dequantize(self.dtype)}


def write_hf(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, Tensor]] | None = None, *,
             dtype: torch.dtype | str | None = None, overwrite: bool = False,
             max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a plain HF checkpoint: safetensors (sharded above `max_shard_size`), config.json, tokenizer.

    dtype: float32 / float16 / bfloat16 for every tensor; default the checkpoint's own `config.torch_dtype`.
    Peak memory: one shard plus one dequantized weight.
    """
    if dtype is None:
        dtype = ckpt.config.torch_dtype
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ConfigError(f"dtype {dtype!r} is not one a plain HF checkpoint holds (float32, float16, bfloat16)")
    return write_checkpoint(dst, ckpt, tensors, HfLayout(ckpt.config, dtype), overwrite=overwrite,
                            max_shard_size=max_shard_size)
