"""What `quanta convert --to` names: the output format, its writer, and how weights it cannot hold exactly
are re-quantized.

    hf                  plain float safetensors (every weight dequantized; --dtype float16/bfloat16/float32)
    awq                 AutoAWQ GEMM int4 (re-quantized: RTN int4 asymmetric, AWQ with --calibration)
    gptq                GPTQ int2/3/4/8 (re-quantized: RTN int4 symmetric, GPTQ with --calibration)
    compressed-tensors  pack-quantized int / float-quantized FP8 (re-quantized: RTN int4 symmetric)
    fp8                 compressed-tensors FP8 e4m3, one scale per output channel
    nf4                 bitsandbytes NF4, blocksize 64
    gguf[:TYPE]         one GGUF file; TYPE a GGML type or llama-quantize mix (Q8_0, Q4_K_M, ...); without
                        TYPE quantized weights GGUF holds exactly stay, everything else is written F16
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.errors import ConfigError

FORMATS = ("hf", "awq", "gptq", "compressed-tensors", "fp8", "nf4", "gguf")
# Target -> the writer (checkpoint_write.WRITERS key, or "gguf").
WRITER_OF = {"hf": "hf", "awq": "awq", "gptq": "gptq", "compressed-tensors": "compressed-tensors",
             "fp8": "compressed-tensors", "nf4": "bnb", "gguf": "gguf"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CALIBRATED = ("awq", "gptq")          # targets whose re-quantization can use calibration data


@dataclass(frozen=True)
class Target:
    """A parsed `--to` value."""
    fmt: str                          # one of FORMATS
    ggml_type: str | None = None      # gguf:TYPE
    dtype: torch.dtype | None = None  # float dtype of plain tensors (hf: of every tensor)

    @property
    def writer(self) -> str:
        return WRITER_OF[self.fmt]

    @property
    def is_file(self) -> bool:
        """The output is one file (GGUF), not a checkpoint directory."""
        return self.fmt == "gguf"

    def __str__(self) -> str:
        return self.fmt + (f":{self.ggml_type}" if self.ggml_type else "")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """float32 / float16 / bfloat16 (or fp32 / fp16 / bf16, or a torch dtype) -> torch dtype."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of float32, float16, bfloat16")
    return DTYPES[key]


def parse_target(to: str, dtype: str | torch.dtype | None = None) -> Target:
    """`to` ("awq", "gguf:Q4_K_M", ...) as a Target; ConfigError naming the known formats otherwise."""
    fmt, _, ggml_type = str(to).strip().partition(":")
    fmt = fmt.lower().replace("_", "-")
    if fmt == "compressed":
        fmt = "compressed-tensors"
    if fmt not in FORMATS:
        raise ConfigError(f"--to {to!r}: not a format quanta converts to (known: {', '.join(FORMATS)}, "
                          "gguf:TYPE such as gguf:Q4_K_M)")
    if ggml_type and fmt != "gguf":
        raise ConfigError(f"--to {to!r}: only gguf takes a :TYPE")
    if fmt == "gguf" and ggml_type:
        from quanta.loaders.gguf_mix import MIXES, WEIGHT_TYPES
        if ggml_type.lower() not in {t.lower() for t in (*WEIGHT_TYPES, *MIXES)}:
            raise ConfigError(f"--to {to!r}: {ggml_type} is not a GGUF weight type or mix (known: "
                              f"{', '.join(t.upper() for t in (*WEIGHT_TYPES, *MIXES))})")
    torch_dtype = parse_dtype(dtype)
    if fmt == "gguf" and torch_dtype is not None:
        raise ConfigError("--dtype applies to safetensors outputs; a GGUF file takes its float type from :TYPE "
                          "(gguf:F32, gguf:F16, gguf:BF16)")
    return Target(fmt, ggml_type.upper() if ggml_type else None, torch_dtype)
