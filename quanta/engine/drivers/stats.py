"""Serving statistics: request and token counters and latency histograms, kept by the async engine and
read by the server's /metrics (which renders them in Prometheus' text format).

Latencies follow vLLM's names: TTFT (arrival to first output token), TPOT (mean time per output token
after the first) and e2e (arrival to finish).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (seconds) of the latency histograms' buckets; +Inf is implied.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense: counts[i] observations <= bounds[i]."""
    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        """Add one observation."""
        for i in range(bisect.bisect_left(self.bounds, value), len(self.bounds)):
            self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class RequestTimes:
    """One request's clock readings (time.monotonic seconds) and token counts."""
    arrival: float
    prompt_tokens: int
    first_token: float | None = None
    output_tokens: int = 0


@dataclass
class EngineStats:
    """Counters since start-up and the latency histograms."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)      # finish reason -> requests
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)

    def on_tokens(self, times: RequestTimes, new_tokens: int, now: float) -> None:
        """A request produced `new_tokens` more output tokens (over all its samples)."""
        if new_tokens <= 0:
            return
        if times.first_token is None:
            times.first_token = now
            self.ttft.observe(now - times.arrival)
        times.output_tokens += new_tokens
        self.generation_tokens += new_tokens

    def on_finish(self, times: RequestTimes, reason: str, now: float) -> None:
        """A request ended (`reason`: its first sample's finish reason, "abort" for a cancelled one)."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(now - times.arrival)
        if times.first_token is not None and times.output_tokens > 1:
            self.tpot.observe((now - times.first_token) / (times.output_tokens - 1))
