"""`quanta convert --merge-lora`: a LoRA adapter folded into the weights it targets as they stream past.

    ckpt, merged = merge_lora(ckpt, "my-lora/")      # ckpt.tensors[name] is now W + scaling * B @ A
    ...convert ckpt as usual...
    mark_merged(report.tensors, merged)              # their records say "merged", never lossless

A targeted weight is read (a quantized one dequantized a block of rows at a time) into a float32 copy, the
product is added in place, and it goes on as a plain float32 tensor: the way any float weight goes to the
target (cast for hf, re-quantized for quantized targets, calibration included). Other tensors pass as they are.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from quanta.loaders.checkpoint import Checkpoint
from quanta.lora.adapter import Adapter, LoRAWeights, load_adapter
from quanta.quant.errors import ConfigError
from quanta.quant.qtensor import QTensor
from quanta.toolkit.convert.report import TensorRecord, scheme_of
from quanta.toolkit.convert.rows import dequantize


def merged_weight(t: torch.Tensor | QTensor, w: LoRAWeights) -> torch.Tensor:
    """`t`'s values in float32 plus w.scaling * w.b @ w.a (a new tensor; `t` is not written)."""
    out = dequantize(t) if isinstance(t, QTensor) else t.to(torch.float32, copy=True)
    return out.addmm_(w.b, w.a, alpha=w.scaling)


class MergedTensors(Mapping):
    """A checkpoint's tensors with the adapter's targets merged on access; `sources` records the source scheme
    of each merged weight as it is read."""

    def __init__(self, tensors: Mapping, adapter: Adapter):
        self.base, self.adapter = tensors, adapter
        self.sources: dict[str, str] = {}

    def __getitem__(self, name: str):
        t = self.base[name]
        w = self.adapter.weights.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if w is None:
            return t
        self.sources[name] = scheme_of(t)
        return merged_weight(t, w)

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def read_on(self, device: torch.device | str) -> None:
        """Checkpoint.read_on, passed to the source's mapping."""
        read_on = getattr(self.base, "read_on", None)
        if read_on is not None:
            read_on(device)


def merge_lora(ckpt: Checkpoint, adapter_path: str | Path) -> tuple[Checkpoint, MergedTensors]:
    """`ckpt` with LoRA adapter `adapter_path` merged into its tensors (read lazily, see MergedTensors), and
    that mapping. The adapter is read and checked against ckpt's config first: ConfigError / ShapeError /
    UnsupportedError (quanta.lora.adapter) before anything is converted."""
    adapter = load_adapter(adapter_path, ckpt.config)
    missing = [m for m in adapter.weights if f"{m}.weight" not in ckpt.tensors]
    if missing:
        raise ConfigError(f"{adapter_path}: the adapter targets weights the checkpoint {ckpt.path} lacks, "
                          f"e.g. {missing[:3]}")
    merged = MergedTensors(ckpt.tensors, adapter)
    return dataclasses.replace(ckpt, tensors=merged), merged


def mark_merged(records: list[TensorRecord], merged: MergedTensors) -> None:
    """Give the records of merged weights their source scheme and action "merged" (never lossless: the output
    is not the source's model); each keeps the error of storing the merged weight in the target."""
    for r in records:
        if r.name in merged.sources:
            r.source, r.action, r.lossless = merged.sources[r.name], "merged", False
            r.method = "lora merge" + (f", then {r.method}" if r.method else "")


def lora_summary(merged: MergedTensors) -> dict:
    """What the report keeps of the merge."""
    a = merged.adapter
    return {"adapter": str(a.path), "rank": a.rank, "modules": len(a.weights),
            "note": "weights are W + scaling * B @ A; the output is the adapted model, not the source's"}
