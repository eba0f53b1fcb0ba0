"""What `quanta plan --quantization NAME` means as a WeightFormat: fp16 | bf16 | fp32 (and their long
names), awq | gptq (4-bit, groups of 128 unless bits / group_size say otherwise; group_size -1: per
channel), nf4, fp8, gguf:TYPE (a GGML type or llama-quantize mix), or auto: what the checkpoint's own
files hold (its format row's `weights`)."""
from __future__ import annotations

from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.formats import Source
from quanta.loaders.gguf.mix import assign
from quanta.loaders.weight_format import WeightFormat, affine_format, dense_format
from quanta.quant.errors import ConfigError

SCHEMES = {"fp16": "dense", "float16": "dense", "bf16": "dense", "bfloat16": "dense", "fp32": "dense",
           "float32": "dense", "awq": "affine", "gptq": "affine", "nf4": "codebook", "fp8": "fp8"}
GPTQ_BITS = (2, 3, 4, 8)


def parse_format(quantization: str, bits: int | None, group_size: int | None, config: ModelConfig,
                 source: Source) -> WeightFormat:
    """The WeightFormat a quantization name (and bits / group overrides) stands for; ConfigError for a name
    or an override that does not apply. "auto" asks `source` (UnsupportedError where it is not modelled)."""
    q = str(quantization).strip()
    if q.lower() == "auto":
        if bits is not None or group_size is not None:
            raise ConfigError("bits and group_size need a quantization name (awq, gptq, nf4), not auto")
        return source.weight_format(config)
    if q.lower().startswith("gguf:"):
        if bits is not None or group_size is not None:
            raise ConfigError(f"{q}: bits and group_size do not apply to GGUF types")
        return WeightFormat(q, "gguf", gguf=assign(q[5:], config))
    kind = SCHEMES.get(q.lower())
    if kind is None:
        raise ConfigError(f"quantization {q!r} is not one of auto, {', '.join(SCHEMES)}, gguf:TYPE")
    if kind in ("dense", "fp8") and (bits is not None or group_size is not None):
        raise ConfigError(f"quantization {q}: bits and group_size apply to awq, gptq and nf4 only")
    q = q.lower()
    if kind == "dense":
        return dense_format(q)
    if kind == "fp8":
        return WeightFormat("fp8", "fp8")
    if kind == "codebook":
        if bits not in (None, 4):
            raise ConfigError(f"nf4 codes are 4-bit, not {bits}")
        return WeightFormat("nf4", "codebook", 4, group_size or 64)
    bits = 4 if bits is None else bits
    allowed = (4,) if q == "awq" else GPTQ_BITS
    if bits not in allowed:
        raise ConfigError(f"{q}: bits={bits} is not one of {allowed}")
    group = 128 if group_size is None else group_size
    if group != -1 and group < 1:
        raise ConfigError(f"{q}: group_size must be positive or -1 (per channel), got {group}")
    return affine_format(q, bits, group, symmetric=q == "gptq")

