"""What a conversion did to each tensor, as a summary for people and JSON stored beside the output."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from quanta.quant.qtensor import QTensor

# How a tensor reached the output. "lossless": the stored values equal the source's exactly. "merged": a LoRA
# adapter's product was added (convert/merge.py), then stored as the target holds it.
ACTIONS = ("copied", "lossless", "cast", "dequantized", "quantized", "requantized", "merged")


def scheme_of(t: torch.Tensor | QTensor) -> str:
    """'affine int4 g32 asym', 'gguf q4_1', 'dense float16', ..."""
    if isinstance(t, QTensor):
        return t.describe()
    return f"dense {str(t.dtype).removeprefix('torch.')}"


@dataclass(slots=True)
class TensorRecord:
    """One tensor: its scheme in the source and in the output, what was done, the relative error."""
    name: str
    source: str
    target: str
    action: str                       # one of ACTIONS
    lossless: bool
    error: float | None = None        # ||W_out - W_src|| / ||W_src|| (0.0 when lossless); merged: W_src merged
                                      # with the adapter, so the error is the target's on the merged weight
    method: str | None = None         # the quantizer for quantized / requantized ("rtn", "awq", "gguf q4_K", ...)


@dataclass
class ConvertReport:
    """The whole conversion: source, output, target, per-tensor records, and the validation figures."""
    source: str
    source_format: str
    output: str
    target: str
    tensors: list[TensorRecord] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    seconds: float | None = None
    merged_lora: dict[str, Any] | None = None     # the adapter merged into the weights (convert/merge.py)

    @property
    def lossless(self) -> bool:
        """True when every tensor's stored values equal the source's."""
        return all(r.lossless for r in self.tensors)

    def changed(self) -> list[TensorRecord]:
        """The tensors whose values changed (quantized, re-quantized, rounded)."""
        return [r for r in self.tensors if not r.lossless]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "source_format": self.source_format, "output": self.output,
                "target": self.target, "lossless": self.lossless,
                "counts": dict(Counter(r.action for r in self.tensors)),
                "tensors": [asdict(r) for r in self.tensors], "validation": self.validation,
                "merged_lora": self.merged_lora}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def summary(self) -> str:
        """A few lines: totals by action, the changed schemes and their worst error."""
        counts = Counter(r.action for r in self.tensors)
        head = (f"{self.source} ({self.source_format}) -> {self.output} ({self.target}): {len(self.tensors)} tensors, "
                + ", ".join(f"{n} {a}" for a, n in sorted(counts.items())))
        lines = [head + (" (lossless)" if self.lossless else "")]
        if self.merged_lora is not None:
            m = self.merged_lora
            lines.append(f"  merged LoRA {m['adapter']} (rank {m['rank']}) into {m['modules']} weights: "
                         "the output is the adapted model")
        groups: dict[tuple[str, str, str], list[TensorRecord]] = {}
        for r in self.changed():
            groups.setdefault((r.source, r.target, r.action), []).append(r)
        for (src, dst, action), rows in sorted(groups.items()):
            errors = [r.error for r in rows if r.error is not None]
            worst = f", max rel. error {max(errors):.3g}" if errors else ""
            lines.append(f"  {action} {len(rows)}: {src} -> {dst}{worst}")
        return "\n".join(lines)
