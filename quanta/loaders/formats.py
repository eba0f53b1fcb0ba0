"""The checkpoint formats, one row per family (FORMATS): the one place that says what a format is called,
how it is recognized, how it is read and written, what the memory plan counts for it and which `quanta
convert --to` targets and `quanta quantize` methods it serves. detect, load, write, the plan, convert and
quantize all read this table, so a new format is one row plus its reader and writer modules.

A row names its functions as "module:attribute" (imported on first use, so the table costs no import) or
holds them directly.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quanta.quant.errors import UnsupportedError

Ref = str | Callable[..., Any] | type


@dataclass(frozen=True)
class ConvertTarget:
    """A `quanta convert --to` name and how weights its format cannot hold exactly are re-quantized:
    "float" (dequantized), "int-asym" / "int-sym" (RTN integers, zero points or none), "fp8" (e4m3 per
    channel), "nf4" (bitsandbytes NF4) or "gguf" (a GGML type or mix)."""
    name: str
    requantize: str
    calibrated: str | None = None     # the `quanta quantize` method that `--calibration` re-quantizes with
    half_scales: bool = False         # re-quantized scales are rounded to float16, as the format stores them


@dataclass(frozen=True)
class Format:
    """One checkpoint family (see the module docstring)."""
    name: str                                   # detect()'s answer and Checkpoint.format
    reader: Ref                                 # (path, **options) -> Checkpoint
    weights: Ref | None = None                  # (ModelConfig, quant_config, path) -> WeightFormat; UnsupportedError
    writer: Ref | None = None                   # (dst, ckpt, tensors=None, **options) -> Path
    layout: Ref | None = None                   # the writer's checkpoint_write.Layout class: (ModelConfig, **options)
    writer_options: Ref | None = None           # (source Checkpoint) -> options the writer needs to hold it exactly
    quant_methods: tuple[str, ...] = ()         # quantization_config.quant_method spellings that name it
    recognizes: Callable[[dict[str, Any]], bool] | None = None   # a quantization config without quant_method
    check: Ref | None = None                    # (quant_config, source file): UnsupportedError for what it cannot read
    targets: tuple[ConvertTarget, ...] = ()
    quantize_methods: tuple[str, ...] = ()      # `quanta quantize --method` values whose output it can hold
    single_file: bool = False                   # one file (GGUF), not a checkpoint directory


def resolve(ref: Ref) -> Any:
    """The function or class a row names."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("hf", reader="quanta.loaders.hf:load_hf", weights="quanta.loaders.hf:weight_format",
           writer="quanta.loaders.hf_write:write_hf", layout="quanta.loaders.hf_write:HfLayout",
           targets=(ConvertTarget("hf", "float"),)),
    Format("gguf", reader="quanta.loaders.gguf.reader:load_gguf", weights="quanta.loaders.gguf.reader:weight_format",
           writer="quanta.loaders.gguf.writer:write_gguf", targets=(ConvertTarget("gguf", "gguf"),),
           quantize_methods=("gguf",), single_file=True),
    Format("awq", reader="quanta.loaders.awq:load_awq", weights="quanta.loaders.awq:weight_format",
           writer="quanta.loaders.awq_write:write_awq", layout="quanta.loaders.awq_write:AwqLayout",
           quant_methods=("awq",), recognizes=lambda qc: "w_bit" in qc or "q_group_size" in qc,
           targets=(ConvertTarget("awq", "int-asym", "awq", half_scales=True),),
           quantize_methods=("rtn", "awq", "gptq")),
    Format("gptq", reader="quanta.loaders.gptq:load_gptq", weights="quanta.loaders.gptq:weight_format",
           writer="quanta.loaders.gptq_write:write_gptq", layout="quanta.loaders.gptq_write:GptqLayout",
           writer_options="quanta.loaders.gptq_write:options_for",
           quant_methods=("gptq",), recognizes=lambda qc: "bits" in qc and "group_size" in qc,
           targets=(ConvertTarget("gptq", "int-sym", "gptq", half_scales=True),),
           quantize_methods=("gptq", "rtn", "awq")),
    Format("bnb", reader="quanta.loaders.bnb:load_bnb", weights="quanta.loaders.bnb:weight_format",
           writer="quanta.loaders.bnb_write:write_bnb", layout="quanta.loaders.bnb_write:BnbLayout",
           quant_methods=("bitsandbytes", "bnb"), targets=(ConvertTarget("nf4", "nf4"),), quantize_methods=("nf4",)),
    Format("fp8", reader="quanta.loaders.fp8:load_fp8", weights="quanta.loaders.fp8:weight_format",
           quant_methods=("fp8", "fbgemm_fp8", "modelopt"), check="quanta.loaders.fp8:check_method"),
    Format("compressed-tensors", reader="quanta.loaders.compressed_tensors:load_compressed_tensors",
           weights="quanta.loaders.compressed_tensors:weight_format",
           writer="quanta.loaders.compressed_tensors_write:write_compressed_tensors",
           layout="quanta.loaders.compressed_tensors_write:CtLayout",
           quant_methods=("compressed-tensors", "compressed_tensors"),
           targets=(ConvertTarget("compressed-tensors", "int-sym"), ConvertTarget("fp8", "fp8")),
           quantize_methods=("rtn", "awq", "gptq", "fp8")),
    Format("synthetic", reader="quanta.loaders.synthetic:load_synthetic",
           weights="quanta.loaders.synthetic:weight_format"),
)}


def get(name: str) -> Format:
    """The row of family `name`; UnsupportedError naming the known families."""
    if name not in FORMATS:
        raise UnsupportedError(f"no checkpoint format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def of_quant_config(qc: dict[str, Any], source: Path) -> Format:
    """The family a quantization config (`quantization_config` or a sidecar file) names: its quant_method,
    else the first row that recognizes its keys; the row's own check runs on it."""
    method = qc.get("quant_method")
    if method is None:
        found = next((f for f in FORMATS.values() if f.recognizes is not None and f.recognizes(qc)), None)
        if found is None:
            raise UnsupportedError(f"{source}: quantization config has no quant_method and no known keys "
                                   f"({sorted(qc)})")
        return found
    methods = {m: f for f in FORMATS.values() for m in f.quant_methods}
    row = methods.get(str(method).lower())
    if row is None:
        raise UnsupportedError(f"{source}: quant_method {str(method).lower()!r} is not supported "
                               f"(supported: {', '.join(sorted(methods))})")
    if row.check is not None:
        resolve(row.check)(qc, source)
    return row


def writable() -> list[str]:
    """The families quanta can write."""
    return [f.name for f in FORMATS.values() if f.writer is not None]


def convert_targets() -> dict[str, tuple[Format, ConvertTarget]]:
    """Every `quanta convert --to` name with its format row."""
    return {t.name: (f, t) for f in FORMATS.values() for t in f.targets}


def quantize_formats(method: str) -> tuple[str, ...]:
    """The formats whose writers can hold what `quanta quantize --method` produces, in table order."""
    return tuple(f.name for f in FORMATS.values() if method in f.quantize_methods)


def layout(name: str, config, **options):
    """A fresh Layout of format `name`'s writer, to ask whether it holds a weight (convert, quantize)."""
    row = get(name)
    if row.layout is None:
        raise UnsupportedError(f"the {name} format has no safetensors layout")
    return resolve(row.layout)(config, **options)


@dataclass(frozen=True)
class Source:
    """What a model's files say about its weights, as the memory plan reads them: the family (a FORMATS row),
    its quantization config and its path (a GGUF header is read there)."""
    family: str = "hf"
    quant_config: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @classmethod
    def of(cls, ckpt) -> Source:
        """The source of an opened Checkpoint."""
        return cls(ckpt.format, dict(ckpt.quant_config), ckpt.path)

    def weight_format(self, config):
        """The WeightFormat the family's files hold for `config` (the lm_head quantized where the safetensors
        store it so); UnsupportedError for one the plan cannot count."""
        row = get(self.family)
        if row.weights is None:
            raise UnsupportedError(f"{self.family} checkpoints are not modelled by the memory plan; pass the format "
                                   "(e.g. quantization='gptq', bits=4, group_size=128)")
        fmt = resolve(row.weights)(config, self.quant_config, self.path)
        if fmt.kind not in ("dense", "gguf") and self.path is not None and _lm_head_stored_quantized(self.path):
            fmt = replace(fmt, lm_head_quantized=True)
        return fmt


def _lm_head_stored_quantized(path: Path) -> bool:
    """Whether the safetensors of checkpoint directory `path` hold its lm_head quantized: parts beside or instead
    of a float `lm_head.weight` (GPTQ / AWQ qweight, compressed-tensors weight_packed or weight_scale,
    bitsandbytes' weight.absmax or SCB), or an 8-bit float weight. False without weight files (config.json alone)."""
    from quanta.loaders.safetensors_io import SAFETENSORS_FILE, SAFETENSORS_INDEX, open_weights
    if not any((path / f).is_file() for f in (SAFETENSORS_FILE, SAFETENSORS_INDEX)):
        return False
    store = open_weights(path)
    if any(n.startswith("lm_head.") and n not in ("lm_head.weight", "lm_head.bias") for n in store):
        return True
    return "lm_head.weight" in store and store.info("lm_head.weight").dtype in ("F8_E4M3", "F8_E5M2")
