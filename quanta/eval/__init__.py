"""The evaluator behind `quanta validate`: perplexity on fixed token windows, KL divergence and top-1
agreement against a reference model, per-layer weight error."""
from quanta.eval.result import KLStats, LayerError, ValidationResult
from quanta.eval.validate import validate
from quanta.eval.windows import WindowSpec

__all__ = ["KLStats", "LayerError", "ValidationResult", "WindowSpec", "validate"]
