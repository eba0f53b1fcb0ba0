"""AutoAWQ GEMM checkpoints, the inverse of awq.read_awq (layout in awq.py's docstring).

qweight int32 [K, N/8] and qzeros int32 [K/G, N/8]: word w of a row holds logical columns 8w + AWQ_ORDER[j]
at nibble j (AutoAWQ WQLinear_GEMM.from_linear, order_map [0,2,4,6,1,3,5,7]); scales fp16 [K/G, N].
The config is `AwqConfig.to_transformers_dict`'s: quant_method, zero_point, group_size, bits, version,
modules_to_not_convert. AWQ holds 4-bit integer codes with integer zero points, plain groups only.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import (DEFAULT_SHARD_SIZE, Layout, Tensor, affine_of, common_group_size,
                                             exact_cast, module_of, write_checkpoint, zeros_of)
from quanta.loaders.pack import pack_bits
from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import UnsupportedError
from quanta.quant.qtensor import QTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_gemm(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] (logical column order, values < 16) -> AWQ GEMM int32 [R, N/8], a block of rows at a time
    (the reordered copy of the values stays as small as pack_bits' scratch)."""
    r, n = values.shape
    order = torch.tensor(AWQ_ORDER, device=values.device)
    cols = (torch.arange(0, n, 8, device=values.device).unsqueeze(1) + order).reshape(-1)
    out = torch.empty(r, n // 8, dtype=torch.int32, device=values.device)
    step = chunk_rows(n, values.device)
    for i in range(0, r, step):
        out[i:i + step] = pack_bits(values[i:i + step, cols], 4, dim=1)
    return out


class AwqLayout(Layout):
    """Affine int4 (integer zeros, plain groups) -> AWQ GEMM tensors."""

    fmt = "AWQ"

    def __init__(self, config: ModelConfig, round_scales: bool = False):
        super().__init__(config)
        self.round_scales = round_scales
        self.layers: dict[str, tuple[int, int, int]] = {}

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        a = affine_of(name, qt, "AWQ")
        n, k = a.shape
        if a.bits != 4:
            raise UnsupportedError(f"{name}: {a.describe()} has {a.bits}-bit codes; AWQ (AutoAWQ WQLinear_GEMM) "
                                   "packs only 4-bit")
        if a.g_idx is not None:
            raise UnsupportedError(f"{name}: {a.describe()} has an act-order g_idx, which AWQ cannot store "
                                   "(write it as GPTQ)")
        group = k if a.num_groups == 1 else a.group_size
        if n % 8 or k % group:
            raise UnsupportedError(f"{name}: AWQ GEMM needs N % 8 == 0 and K % group_size == 0, got [{n}, {k}] "
                                   f"with group_size {group}")
        module = module_of(name)
        self.layers[module] = (group, a.num_groups, k)
        scales = exact_cast(a.scales, torch.float16, f"{name}: scales", self.round_scales)
        return {module + ".qweight": pack_gemm(a.codes.T),
                module + ".qzeros": pack_gemm(zeros_of(a).T),
                module + ".scales": scales.T.contiguous()}

    def quantization_config(self) -> dict[str, Any]:
        if not self.layers:
            raise UnsupportedError("no quantized weight came: an AWQ checkpoint needs at least one Affine int4 layer")
        return {"quant_method": "awq", "zero_point": True, "group_size": common_group_size(self.layers, "AWQ"),
                "bits": 4, "version": "gemm", "modules_to_not_convert": self.plain_linears or None}


def write_awq(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, Tensor]] | None = None, *,
              round_scales: bool = False, overwrite: bool = False,
              max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write an AutoAWQ GEMM checkpoint (config.json with transformers' AWQ quantization_config).

    Quantized linear weights must be (or convert exactly to) Affine int4 with integer zero points, one group
    size for all layers, no g_idx, N % 8 == 0; anything else is UnsupportedError before the rename. Scales
    are stored fp16: scales not exactly fp16 are refused unless `round_scales`. Unquantized decoder linears
    are listed in modules_to_not_convert. Peak memory: one shard plus one layer's packed tensors.
    """
    return write_checkpoint(dst, ckpt, tensors, AwqLayout(ckpt.config, round_scales), overwrite=overwrite,
                            max_shard_size=max_shard_size)
