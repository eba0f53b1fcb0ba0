"""What `quanta validate` reports: the figures, a table for people and JSON for tools."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class KLStats:
    """The next-token distribution of the tested model against the reference's, over every scored
    position (llama.cpp --kl-divergence's figures). Probabilities are fractions, not percent."""
    mean: float                       # mean KL(ref || test), nats
    stderr: float
    max: float
    p99_9: float
    p99: float
    p90: float
    median: float
    min: float
    top1_agreement: float             # share of positions where both models' most likely token is the same
    top1_stderr: float
    mean_delta_p: float               # mean of p_test(true token) - p_ref(true token)
    rms_delta_p: float
    ln_ppl_ratio: float               # mean of ln p_ref(true) - ln p_test(true) = ln(PPL(test) / PPL(ref))
    ln_ppl_ratio_stderr: float
    top_k: int | None = None          # the stored reference's k, None when the full vocabulary was compared


@dataclass(slots=True)
class LayerError:
    """One weight matrix, dequantized to float32 on both sides."""
    name: str
    shape: list[int]
    scheme: str                       # the tested checkpoint's (e.g. "gguf q4_1", "dense float16")
    reference_scheme: str
    rel_frobenius: float              # ||W - W_ref||_F / ||W_ref||_F
    max_abs: float                    # max |W - W_ref|


@dataclass(slots=True)
class ValidationResult:
    """Perplexity of `model` on `windows` token windows of `text`, and against `reference` (when given)
    its KL divergence and top-1 agreement, and the per-layer weight error where both checkpoints load."""
    model: str
    text: str
    ctx: int
    stride: int
    score: str                        # "second-half" or "all"
    windows: int
    scored_tokens: int
    bos_token_id: int | None
    perplexity: float
    perplexity_stderr: float
    reference: str | None = None
    reference_perplexity: float | None = None
    reference_perplexity_stderr: float | None = None
    kl: KLStats | None = None
    layers: list[LayerError] | None = None
    unmatched_tensors: list[str] = field(default_factory=list)   # in one checkpoint only, not compared
    engine: dict = field(default_factory=dict)   # how the model ran: device, dtype, kernel
    seconds: float = 0.0

    @property
    def delta_perplexity(self) -> float | None:
        """PPL(test) - PPL(ref)."""
        return None if self.reference_perplexity is None else self.perplexity - self.reference_perplexity

    def to_dict(self) -> dict:
        """Every field, plus delta_perplexity and the layers' summary."""
        out = asdict(self)
        out["delta_perplexity"] = self.delta_perplexity
        out["layers_summary"] = layer_summary(self.layers)
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The result as JSON (NaN and infinities as null, so strict parsers read it)."""
        return json.dumps(_finite(self.to_dict()), indent=indent)

    def table(self, layers: bool = False) -> str:
        """The human-readable report; `layers`: one line per weight matrix as well as the summary."""
        how = ", ".join(f"{k} {v}" for k, v in self.engine.items())
        lines = [f"{self.model}" + (f" ({how})" if how else ""),
                 f"  text {self.text}: {self.windows} windows of {self.ctx} tokens (stride {self.stride}), "
                 f"{self.score} scored, {self.scored_tokens} tokens"
                 + ("" if self.bos_token_id is None else f", each window starting with BOS {self.bos_token_id}"),
                 f"  PPL                    {self.perplexity:10.4f} +/- {self.perplexity_stderr:.4f}"]
        if self.reference is not None:
            lines.append(f"  reference {self.reference}")
        if self.reference_perplexity is not None:
            lines += [f"  PPL(ref)               {self.reference_perplexity:10.4f} +/- "
                      f"{self.reference_perplexity_stderr:.4f}",
                      f"  PPL - PPL(ref)         {self.delta_perplexity:10.4f}"]
        if self.kl is not None:
            k = self.kl
            source = "full vocabulary" if k.top_k is None else f"reference top-{k.top_k} + rest"
            lines += [f"  ln(PPL/PPL(ref))       {k.ln_ppl_ratio:10.6f} +/- {k.ln_ppl_ratio_stderr:.6f}",
                      f"  KL divergence ({source})",
                      f"    mean                 {k.mean:10.6f} +/- {k.stderr:.6f}",
                      f"    max / 99.9% / 99%    {k.max:.6f} / {k.p99_9:.6f} / {k.p99:.6f}",
                      f"    90% / median / min   {k.p90:.6f} / {k.median:.6f} / {k.min:.6f}",
                      f"  same top-1 token       {100 * k.top1_agreement:9.3f}% +/- {100 * k.top1_stderr:.3f}%",
                      f"  mean / RMS delta-p     {100 * k.mean_delta_p:9.3f}% / {100 * k.rms_delta_p:.3f}%"]
        summary = layer_summary(self.layers)
        if summary is not None:
            lines.append(f"  weights: {summary['tensors']} matrices, relative Frobenius error mean "
                         f"{summary['mean_rel_frobenius']:.6f}, worst {summary['max_rel_frobenius']:.6f} "
                         f"({summary['worst']}), max abs {summary['max_abs']:.6g}")
            if self.unmatched_tensors:
                lines.append(f"  not compared (in one checkpoint only): {', '.join(self.unmatched_tensors)}")
            if layers:
                lines += [f"    {e.name:48s} {e.scheme:>16s} {e.rel_frobenius:10.6f} {e.max_abs:10.6g}"
                          for e in self.layers]
        return "\n".join(lines)


def layer_summary(layers: list[LayerError] | None) -> dict | None:
    """Mean and worst relative error over the compared matrices, or None when none were."""
    if not layers:
        return None
    worst = max(layers, key=lambda e: e.rel_frobenius)
    return {"tensors": len(layers), "mean_rel_frobenius": sum(e.rel_frobenius for e in layers) / len(layers),
            "max_rel_frobenius": worst.rel_frobenius, "worst": worst.name,
            "max_abs": max(e.max_abs for e in layers)}


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
