"""Window-by-window figures folded into the reported statistics, in float64.

Standard errors follow llama.cpp's perplexity tool: the sample standard deviation over scored positions
divided by sqrt(N - 1), and for perplexity propagated through the exponential (PPL * stderr of the
mean negative log-likelihood).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from quanta.eval.result import KLStats
from quanta.eval.scoring import Positions


def _stderr(x: np.ndarray) -> float:
    """Standard error of the mean of x."""
    return float(np.sqrt(max(np.mean(x * x) - np.mean(x) ** 2, 0.0) / (len(x) - 1))) if len(x) > 1 else math.nan


class Accumulator:
    """Every scored position's figures, window after window (a few float64 numbers a position)."""

    def __init__(self):
        self.parts: list[Positions] = []

    def add(self, positions: Positions) -> None:
        self.parts.append(positions)

    def column(self, name: str) -> np.ndarray:
        """One figure over every position so far, as float64."""
        return torch.cat([getattr(p, name) for p in self.parts]).double().numpy()

    @property
    def count(self) -> int:
        return sum(len(p.nll) for p in self.parts)

    def perplexity(self, reference: bool = False) -> tuple[float, float]:
        """(perplexity, its standard error) of the tested model, or of the reference."""
        nll = self.column("ref_nll" if reference else "nll")
        ppl = math.exp(float(np.mean(nll)))
        return ppl, ppl * _stderr(nll)

    def kl_stats(self, top_k: int | None) -> KLStats:
        """The KL, top-1 and delta-p figures against the reference (which every position must have)."""
        kl = self.column("kl")
        same = (self.column("top1") == self.column("ref_top1")).astype(np.float64)
        dp = self.column("p_true") - self.column("ref_p_true")
        ln_ratio = self.column("nll") - self.column("ref_nll")
        q = np.quantile(kl, [0.999, 0.99, 0.9, 0.5])
        return KLStats(mean=float(kl.mean()), stderr=_stderr(kl), max=float(kl.max()), p99_9=float(q[0]),
                       p99=float(q[1]), p90=float(q[2]), median=float(q[3]), min=float(kl.min()),
                       top1_agreement=float(same.mean()), top1_stderr=_stderr(same),
                       mean_delta_p=float(dp.mean()), rms_delta_p=float(np.sqrt(np.mean(dp * dp))),
                       ln_ppl_ratio=float(ln_ratio.mean()), ln_ppl_ratio_stderr=_stderr(ln_ratio), top_k=top_k)
