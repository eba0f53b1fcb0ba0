"""What `quanta convert --to` names: a target of the format table (formats.FORMATS rows' `targets`: hf, awq,
gptq, compressed-tensors, fp8, nf4, gguf[:TYPE]), the format it writes and how it re-quantizes weights that
format cannot hold exactly. Without :TYPE a GGUF output keeps the quantized weights GGUF holds exactly and
writes everything else F16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.loaders.formats import Format, convert_targets
from quanta.quant.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """A parsed `--to` value: the target's name, the format row it writes, how it re-quantizes (formats.
    ConvertTarget), a GGML type or mix (gguf:TYPE) and the float dtype of plain tensors (hf: of every tensor)."""
    name: str
    format: Format
    requantize: str
    calibrated: str | None = None     # the method --calibration re-quantizes with
    half_scales: bool = False         # re-quantized scales are rounded to float16, as the format stores them
    ggml_type: str | None = None
    dtype: torch.dtype | None = None

    @property
    def is_file(self) -> bool:
        """The output is one file (GGUF), not a checkpoint directory."""
        return self.format.single_file

    def __str__(self) -> str:
        return self.name + (f":{self.ggml_type}" if self.ggml_type else "")


def names() -> list[str]:
    """Every `--to` name, in the format table's order."""
    return list(convert_targets())


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """float32 / float16 / bfloat16 (or fp32 / fp16 / bf16, or a torch dtype) -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
    return DTYPES[key]


def parse_target(to: str, dtype: str | torch.dtype | None = None) -> Target:
    """`to` ("awq", "gguf:Q4_K_M", ...) as a Target; ConfigError naming the known targets otherwise."""
    name, _, ggml_type = str(to).strip().partition(":")
    name = name.lower().replace("_", "-")
    if name == "compressed":
        name = "compressed-tensors"
    targets = convert_targets()
    if name not in targets:
        raise ConfigError(f"--to {to!r}: not a format quanta converts to (known: {', '.join(targets)}, "
                          "gguf:TYPE such as gguf:Q4_K_M)")
    row, target = targets[name]
    gguf = target.requantize == "gguf"
    if ggml_type and not gguf:
        raise ConfigError(f"--to {to!r}: only gguf takes a :TYPE")
    if gguf and ggml_type:
        from quanta.loaders.gguf.mix import MIXES, WEIGHT_TYPES
        if ggml_type.lower() not in {t.lower() for t in (*WEIGHT_TYPES, *MIXES)}:
            raise ConfigError(f"--to {to!r}: {ggml_type} is not a GGUF weight type or mix (known: "
                              f"{', '.join(t.upper() for t in (*WEIGHT_TYPES, *MIXES))})")
    torch_dtype = parse_dtype(dtype)
    if gguf and torch_dtype is not None:
        raise ConfigError("--dtype applies to safetensors outputs; a GGUF file takes its float type from :TYPE "
                          "(gguf:F32, gguf:F16, gguf:BF16)")
    return Target(name, row, target.requantize, target.calibrated, target.half_scales,
                  ggml_type.upper() if ggml_type else None, torch_dtype)
