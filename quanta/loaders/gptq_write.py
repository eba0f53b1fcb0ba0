"""GPTQ checkpoints as GPTQModel / transformers save them, the inverse of gptq.read_gptq.

qweight int32 [ceil(K*b/32), N]: a dense little-endian bit stream along K; qzeros int32 [G, ceil(N*b/32)]
the same along N, holding z - 1 in format v1 ("gptq", the default every tool reads) or z in "gptq_v2";
scales fp16 [G, N]; g_idx int32 [K] (always written: arange(K) // G without act-order). The config is
GPTQModel's QuantizeConfig.to_dict: bits, group_size, desc_act, sym, lm_head, quant_method/method,
checkpoint_format/format, pack_dtype, dynamic (unquantized modules as "-:" patterns), meta.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quanta.version import quanta_version
from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import (DEFAULT_SHARD_SIZE, Layout, Tensor, affine_of, common_group_size,
                                             exact_cast, module_of, write_checkpoint, zeros_of)
from quanta.loaders.gptq import BITS, FORMATS
from quanta.loaders.pack import pack_bits
from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.quant.qtensor import QTensor


class GptqLayout(Layout):
    """Affine int2/3/4/8 (integer zeros, plain groups or act-order g_idx) -> GPTQ tensors."""

    fmt = "GPTQ"
    float_only = ("model.embed_tokens.weight",)     # a quantized lm_head: GPTQModel's `lm_head` true (vLLM reads it)

    def __init__(self, config: ModelConfig, checkpoint_format: str = "gptq", round_scales: bool = False):
        super().__init__(config)
        if checkpoint_format not in FORMATS:
            raise ConfigError(f"GPTQ checkpoint_format {checkpoint_format!r} is not one quanta writes ({FORMATS})")
        self.checkpoint_format, self.round_scales = checkpoint_format, round_scales
        self.layers: dict[str, tuple[int, int, int]] = {}
        self.bits: dict[int, str] = {}
        self.sym, self.desc_act = True, False

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        a = affine_of(name, qt, "GPTQ")
        n, k = a.shape
        if a.bits not in BITS:
            raise UnsupportedError(f"{name}: {a.describe()}: GPTQ stores {', '.join(map(str, BITS))}-bit codes, "
                                   f"not {a.bits}-bit")
        self.bits.setdefault(a.bits, name)
        if len(self.bits) > 1:
            (b1, n1), (b2, n2) = list(self.bits.items())[:2]
            raise UnsupportedError(f"{n2} is {b2}-bit but {n1} is {b1}-bit: a GPTQ config declares one bit width")
        group = k if a.num_groups == 1 else a.group_size
        if a.num_groups != -(-k // group):
            raise UnsupportedError(f"{name}: {a.num_groups} groups with group_size {group} do not tile K={k} "
                                   "the way GPTQ's g_idx does (ceil(K / group_size) groups)")
        zeros = zeros_of(a)
        mid = 1 << (a.bits - 1)
        self.sym &= not isinstance(a.zeros, torch.Tensor) and int(a.zeros) == mid
        if self.checkpoint_format == "gptq" and bool((zeros == 0).any()):
            raise UnsupportedError(f"{name}: a zero point of 0 cannot be stored in GPTQ format v1 (it stores z - 1); "
                                   "write checkpoint_format='gptq_v2'")
        if a.g_idx is not None:
            self.desc_act = True
            g_idx = a.g_idx.to(torch.int32)
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= a.num_groups:
                raise UnsupportedError(f"{name}: g_idx holds groups outside 0..{a.num_groups - 1}")
        else:
            g_idx = (torch.arange(k, device=a.codes.device) // group).to(torch.int32)
        module = module_of(name)
        self.layers[module] = (group, a.num_groups, k)
        stored_zeros = zeros - 1 if self.checkpoint_format == "gptq" else zeros
        return {module + ".qweight": pack_bits(a.codes.T, a.bits, dim=0),
                module + ".qzeros": pack_bits(stored_zeros.T, a.bits, dim=1),
                module + ".scales": exact_cast(a.scales, torch.float16, f"{name}: scales", self.round_scales).T,
                module + ".g_idx": g_idx}

    def quantization_config(self) -> dict[str, Any]:
        if not self.layers:
            raise UnsupportedError("no quantized weight came: a GPTQ checkpoint needs at least one Affine layer")
        dynamic = {"-:" + re.escape(m): {} for m in self.plain_linears} or None
        fmt = self.checkpoint_format
        return {"bits": next(iter(self.bits)), "group_size": common_group_size(self.layers, "GPTQ"),
                "desc_act": self.desc_act, "sym": self.sym, "lm_head": "lm_head" in self.layers, "quant_method": "gptq",
                "method": "gptq", "checkpoint_format": fmt, "format": fmt, "pack_dtype": "int32",
                "dynamic": dynamic, "meta": {"quantizer": [f"quanta:{quanta_version()}"],
                                             "static_groups": False, "true_sequential": True}}


def write_gptq(dst: str | Path, ckpt: Checkpoint, tensors: Iterable[tuple[str, Tensor]] | None = None, *,
               checkpoint_format: str = "gptq", round_scales: bool = False, overwrite: bool = False,
               max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a GPTQ checkpoint (config.json with GPTQModel's quantization_config).

    Quantized linear weights must be (or convert exactly to) Affine with 2, 3, 4 or 8 bits, integer zero
    points, one bit width and one group size for all layers; g_idx (act-order) is kept. Format v1 ("gptq")
    cannot hold a zero point of 0: use checkpoint_format="gptq_v2". Scales are stored fp16 (refused when not
    exact unless `round_scales`). Unquantized decoder linears are excluded through `dynamic`; a quantized
    lm_head (in the same scheme) is written as one, the config's `lm_head` true.
    Peak memory: one shard plus one layer's packed tensors.
    """
    layout = GptqLayout(ckpt.config, checkpoint_format, round_scales)
    return write_checkpoint(dst, ckpt, tensors, layout, overwrite=overwrite,
                            max_shard_size=max_shard_size)


def options_for(ckpt: Checkpoint) -> dict[str, Any]:
    """The writer options that hold `ckpt`'s weights exactly: GPTQ v1 ("gptq", what every tool reads) unless
    the source may hold a zero point of 0, which v1 cannot store (it stores z - 1): asymmetric AWQ and
    GPTQ v2 sources are written as "gptq_v2"."""
    qc = ckpt.quant_config
    stored = str(qc.get("checkpoint_format", qc.get("format", "")))
    v2 = ckpt.format == "awq" or (ckpt.format == "gptq" and "v2" in stored)
    return {"checkpoint_format": "gptq_v2" if v2 else "gptq"}
