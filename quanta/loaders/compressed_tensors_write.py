"""compressed-tensors checkpoints as llm-compressor saves them, the inverse of compressed_tensors.read_ct.

- `pack-quantized` (Affine): weight_packed int32 [N, ceil(K*b/32)] (codes, already offset by 2**(b-1)),
  weight_scale [N, G] in the scales' dtype, weight_zero_point packed along N [ceil(N*b/32), G] (asymmetric
  only), weight_shape int64 [2]. No act-order g_idx: compressed-tensors dropped actorder "group".
- `float-quantized` (Fp8 e4m3): weight float8_e4m3fn [N, K], weight_scale [1] (tensor) / [N, 1] (channel) /
  [N/bn, K/bk] (block), input_scale [1] for static activations (dynamic ones: per-token, no tensor).
- KV-cache scales: model.layers.{i}.self_attn.{k,v}_scale [1] with a `kv_cache_scheme`.
One config group per distinct scheme: targets ["Linear"] when there is one, the module names otherwise.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import DEFAULT_SHARD_SIZE, Layout, Tensor, affine_of, module_of, \
    write_checkpoint, zeros_of
from quanta.loaders.pack import pack_bits
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds import Fp8
from quanta.quant.qtensor import QTensor

CT_VERSION = "0.19.0"           # the compressed-tensors release whose config layout this mirrors
KV_SCALE = "model.layers.{}.self_attn.{}_scale"


def args(num_bits: int, type_: str, strategy: str, *, symmetric: bool = True, group_size: int | None = None,
         block: list[int] | None = None, dynamic: bool | str = False,
         observer: str | None = "memoryless_minmax") -> dict[str, Any]:
    """A QuantizationArgs dict with every field compressed-tensors serializes."""
    return {"actorder": None, "block_structure": block, "dynamic": dynamic, "group_size": group_size,
            "num_bits": num_bits, "observer": observer, "observer_kwargs": {}, "scale_dtype": None,
            "strategy": strategy, "symmetric": symmetric, "type": type_,
            "zp_dtype": None if symmetric or type_ == "float" else "torch.int8"}


class CtLayout(Layout):
    """Affine -> pack-quantized, Fp8 e4m3 -> float-quantized; KV-cache scales appended."""

    fmt = "compressed-tensors"

    def __init__(self, config: ModelConfig, kv_cache_scales: dict[str, torch.Tensor] | None = None):
        super().__init__(config)
        kv_cache_scales = kv_cache_scales or {}
        self.schemes: dict[str, list[str]] = {}     # scheme (JSON) -> modules using it
        valid = {KV_SCALE.format(i, kv) for i in range(config.num_hidden_layers) for kv in "kv"}
        for name, t in kv_cache_scales.items():
            if name not in valid or t.numel() != 1:
                raise UnsupportedError(f"KV-cache scale {name!r} {list(t.shape)}: compressed-tensors stores one "
                                       "per-tensor scale per model.layers.{i}.self_attn.{k,v}_scale")
        self.kv = kv_cache_scales

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        module = module_of(name)
        if isinstance(qt, Fp8):
            scheme, stored = self._fp8(name, qt)
        else:
            scheme, stored = self._int(name, affine_of(name, qt, "compressed-tensors pack-quantized"))
        self.schemes.setdefault(json.dumps(scheme, sort_keys=True), []).append(module)
        return {module + "." + k: v for k, v in stored.items()}

    def _int(self, name: str, a) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        n, k = a.shape
        if a.g_idx is not None:
            raise UnsupportedError(f"{name}: {a.describe()} has an act-order g_idx; compressed-tensors removed "
                                   "actorder='group' (weight_g_idx) from its config schema, so current readers "
                                   "refuse it (write it as GPTQ)")
        mid = 1 << (a.bits - 1)
        symmetric = not isinstance(a.zeros, torch.Tensor) and int(a.zeros) == mid
        group = k if a.num_groups == 1 else a.group_size
        if a.num_groups != -(-k // group):
            raise UnsupportedError(f"{name}: {a.num_groups} groups with group_size {group} do not tile K={k}")
        stored = {"weight_packed": pack_bits(a.codes, a.bits, dim=1), "weight_scale": a.scales,
                  "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if not symmetric:
            stored["weight_zero_point"] = pack_bits(zeros_of(a), a.bits, dim=0)
        channel = a.num_groups == 1
        weights = args(a.bits, "int", "channel" if channel else "group", symmetric=symmetric,
                       group_size=None if channel else group)
        return {"format": "pack-quantized", "weights": weights, "input_activations": None}, stored

    def _fp8(self, name: str, f: Fp8) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if f.fmt != "e4m3":
            raise UnsupportedError(f"{name}: {f.describe()}: compressed-tensors float-quantized stores FP8 e4m3 only")
        n, _ = f.shape
        strategy = f.strategy
        scale = f.scale.reshape(1) if strategy == "tensor" else f.scale.reshape(n, 1) if strategy == "channel" \
            else f.scale
        stored = {"weight": f.data, "weight_scale": scale}
        if f.input_scale is not None:
            if f.input_scale.numel() != 1:
                raise UnsupportedError(f"{name}: input_scale {list(f.input_scale.shape)}: compressed-tensors "
                                       "stores one static per-tensor activation scale")
            stored["input_scale"] = f.input_scale.reshape(1)
            act = args(8, "float", "tensor", observer="minmax")
        else:
            act = args(8, "float", "token", dynamic=True, observer=None)
        weights = args(8, "float", strategy, block=list(f.block_size) if f.block_size else None)
        return {"format": "float-quantized", "weights": weights, "input_activations": act}, stored

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        return {name: t.reshape(1) for name, t in self.kv.items()}

    def quantization_config(self) -> dict[str, Any]:
        if not self.schemes:
            raise UnsupportedError("no quantized weight came: a compressed-tensors checkpoint needs at least one "
                                   "Affine or Fp8 layer")
        groups = {}
        for i, (scheme, modules) in enumerate(self.schemes.items()):
            s = json.loads(scheme)
            groups[f"group_{i}"] = {"format": s["format"], "input_activations": s["input_activations"],
                                    "output_activations": None,
                                    "targets": ["Linear"] if len(self.schemes) == 1 else modules,
                                    "weights": s["weights"]}
        formats = {g["format"] for g in groups.values()}
        kv = args(8, "float", "tensor", observer=None) if self.kv else None
        return {"config_groups": groups, "format": formats.pop() if len(formats) == 1 else "mixed-precision",
                "global_compression_ratio": None, "ignore": ["lm_head", *self.plain_linears], "kv_cache_scheme": kv,
                "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
                "transform_config": {}, "version": CT_VERSION}


def write_compressed_tensors(dst: str | Path, ckpt: Checkpoint,
                             tensors: Iterable[tuple[str, Tensor]] | None = None, *,
                             kv_cache_scales: dict[str, torch.Tensor] | None = None, overwrite: bool = False,
                             max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write a compressed-tensors checkpoint (pack-quantized ints, float-quantized FP8, or both).

    Quantized linear weights: Affine with integer zero points (plain groups, no g_idx) or Fp8 e4m3
    (tensor / channel / block scales, optional static input_scale). kv_cache_scales defaults to
    `ckpt.kv_cache_scales`. Unquantized decoder linears go to `ignore`. Peak memory: one shard plus one layer.
    """
    kv = ckpt.kv_cache_scales if kv_cache_scales is None else kv_cache_scales
    layout = CtLayout(ckpt.config, dict(kv))
    return write_checkpoint(dst, ckpt, tensors, layout, overwrite=overwrite, max_shard_size=max_shard_size)
