"""WeightFormat: how a model's linear weights are stored, in the terms the memory plan counts them (kind dense
| affine | codebook | fp8 | gguf, bits, groups, zero points, act-order, the GGUF types). Each checkpoint
family says what its files hold (formats.Format.weights); `quanta plan --quantization` names one."""
from __future__ import annotations

from dataclasses import dataclass

from quanta.loaders.gguf.mix import GgufTypes
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME


@dataclass(frozen=True)
class WeightFormat:
    """How the linear weights are stored: kind dense | affine | codebook | fp8 | gguf."""
    name: str                         # as asked or declared: "fp16", "awq", "gptq", "nf4", "fp8", "gguf:Q4_K_M"
    kind: str
    bits: int | None = None
    group_size: int | None = None     # None: one group per row (per channel)
    symmetric: bool = True            # False: a zero point per group (AWQ)
    gguf: GgufTypes | None = None
    act_order: bool = False           # GPTQ desc_act: groups scattered over K (g_idx)
    lm_head_quantized: bool = False   # the lm_head stored in this format too (else 16-bit; GGUF: its own type)

    def describe(self) -> str:
        if self.kind == "dense":
            return self.name
        if self.kind in ("affine", "codebook"):
            groups = f"groups of {self.group_size}" if self.group_size else "per channel"
            zeros = "" if self.symmetric else ", zero points"
            order = ", act-order" if self.act_order else ""
            return f"{self.name} ({self.bits}-bit, {groups}{zeros}{order})"
        if self.kind == "fp8":
            return "fp8 (per-channel scales)"
        return self.name

    def k_block(self, gguf_type: str | None = None) -> int | None:
        """Columns that must stay together when K is split across ranks (a group, block or ggml block)."""
        if self.kind == "gguf":
            return GGML_TYPES_BY_NAME[gguf_type].block_size
        return self.group_size if self.kind in ("affine", "codebook") else None


def dense_format(dtype_name: str) -> WeightFormat:
    """16- or 32-bit float weights named as `quanta plan` names them (fp16, bf16, fp32)."""
    return WeightFormat(dtype_name, "dense")


def affine_format(name: str, bits: int, group_size: int | None, symmetric: bool, act_order: bool = False
                  ) -> WeightFormat:
    """Integer codes with a scale per group (group_size None, 0 or -1: per channel)."""
    return WeightFormat(name, "affine", bits, None if group_size in (None, 0, -1) else group_size, symmetric,
                        act_order=act_order)
