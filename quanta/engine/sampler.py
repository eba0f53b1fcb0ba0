"""Next-token choice: penalties, temperature, top-k, top-p, min-p, then a draw with the
exponential trick (argmax of p / Exp(1) noise: one kernel, no host sync), seeded per request."""
from __future__ import annotations

import torch

from quanta.engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                    p: SamplingParams) -> torch.Tensor:
    """vLLM's rules: repetition penalty over prompt and output tokens (divide positive logits,
    multiply negative ones), presence and frequency penalties over output tokens only."""
    if p.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts[: logits.shape[-1]].to(logits.dtype)
        logits -= p.presence_penalty * (counts[: logits.shape[-1]] > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p (nucleus) and min-p masking, on one row [V]."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > p.top_p     # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of (already penalized) logits [V]."""
    if p.greedy:
        return int(logits.argmax())
    probs = filter_logits(logits, p).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, dict[int, tuple[float, int]]]:
    """The chosen token's logprob and {token: (logprob, rank)} for it and the k most likely, from
    the raw model distribution (before penalties and filtering, as vLLM reports by default)."""
    logp = logits.float().log_softmax(-1)
    chosen = float(logp[token])
    rank = int((logp > logp[token]).sum()) + 1
    result = {token: (chosen, rank)}
    if k:
        values, ids = torch.topk(logp, k)
        for r, (v, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            result.setdefault(i, (v, r))
    return chosen, result
