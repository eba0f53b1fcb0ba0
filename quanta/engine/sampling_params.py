"""SamplingParams with the OpenAI / vLLM names, validated on construction.

`logits_processors` are vLLM's per-request hooks: each is called as `fn(output_ids, logits)` with the
sample's generated ids so far and its logits row [V] (before penalties, temperature and the filters,
as in vLLM) and returns the row to sample from. They run on the host path, one sequence at a time; one
that raises fails its own request only (finish_reason "error"), never the batch.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quanta.quant.errors import ConfigError

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # number of top logprobs per generated token (plus the chosen one)
    skip_special_tokens: bool = True
    logits_processors: list[Callable] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.logits_processors = list(self.logits_processors or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, "n must be >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0, or -1 to disable"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs must be >= 0"),
            (self.seed is None or -2**63 <= self.seed < 2**64, "seed must be in [-2**63, 2**64)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(callable(f) for f in self.logits_processors), "logits_processors must be callables"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (below a small epsilon): the argmax, no draw."""
        return self.temperature < _GREEDY_EPS
