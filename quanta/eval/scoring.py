"""Per-position figures of one window: the tested model's negative log-likelihood of each scored token and,
against a reference, KL(ref || test), both models' top-1 token and probability of the true token.

Every log-probability is a float64 log-softmax of the float32 logits, taken a few rows at a time so that
a [rows, vocab] float64 block never holds a whole window. The reference comes either as its full logits
(both models loaded) or as a stored top-k record (reference_store.py); with top-k, KL is taken over the
k stored tokens plus one bucket for the rest of the vocabulary, which is exact when k is the vocabulary
and otherwise a lower bound of the full KL (coarse-graining a distribution never raises KL).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 16            # float64 rows per block (16 x vocab x 8 bytes), a few such temporaries at once


@dataclass(slots=True)
class Positions:
    """Figures at each scored position of a window (CPU tensors; the ref_* and kl fields without a
    reference are None)."""
    nll: torch.Tensor                          # float64 [P]: -log p_test(true token)
    top1: torch.Tensor                         # int64 [P]: the tested model's most likely token
    p_true: torch.Tensor                       # float64 [P]: p_test(true token)
    ref_nll: torch.Tensor | None = None
    ref_top1: torch.Tensor | None = None
    ref_p_true: torch.Tensor | None = None
    kl: torch.Tensor | None = None             # float64 [P]: KL(ref || test)


@dataclass(slots=True)
class TopK:
    """A reference's next-token distribution at the P scored positions of a window, kept small: its k
    most likely tokens (descending), their log-probabilities, the log of the remaining probability mass
    (-inf when k is the vocabulary) and the log-probability of the true token."""
    ids: torch.Tensor                          # int32 [P, k]
    logprobs: torch.Tensor                     # float32 [P, k]
    tail: torch.Tensor                         # float64 [P]
    true_logprob: torch.Tensor                 # float64 [P]


def scored(logits: torch.Tensor, window: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logit rows, true tokens) of the scored positions: row j-1 predicts window[j] for j >= first."""
    assert logits.shape[0] == len(window), (logits.shape, len(window))
    targets = torch.tensor(window[first:], dtype=torch.long, device=logits.device)
    return logits[first - 1: len(window) - 1], targets


def _blocks(rows: torch.Tensor, *others: torch.Tensor):
    for start in range(0, rows.shape[0], ROWS):
        yield (slice(start, start + ROWS), rows[start:start + ROWS].double().log_softmax(-1),
               *(o[start:start + ROWS] for o in others))


def _own(lp: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    true = lp.gather(1, targets[:, None])[:, 0]
    return -true, lp.argmax(-1), true.exp()


def _kl_terms(ref_lp: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """p_ref * (log p_ref - log p_test), taken as 0 where p_ref is 0."""
    p = ref_lp.exp()
    return torch.where(p > 0, p * (ref_lp - lp), torch.zeros_like(p))


def score_alone(logits: torch.Tensor, window: list[int], first: int) -> Positions:
    """The tested model's figures on one window, no reference."""
    rows, targets = scored(logits, window, first)
    parts = [_own(lp, t) for _, lp, t in _blocks(rows, targets)]
    return Positions(*(torch.cat([p[i] for p in parts]).cpu() for i in range(3)))


def score_against_logits(logits: torch.Tensor, ref_logits: torch.Tensor, window: list[int],
                         first: int) -> Positions:
    """Figures on one window against the reference's full logits (same window, same shape)."""
    assert ref_logits.shape == logits.shape, (ref_logits.shape, logits.shape)   # vocabularies checked up front
    return score_against_rows(logits, scored(ref_logits, window, first)[0], window, first)


def score_against_rows(logits: torch.Tensor, ref_rows: torch.Tensor, window: list[int], first: int) -> Positions:
    """Figures on one window against the reference's logits at its scored positions only (`scored`'s rows)."""
    rows, targets = scored(logits, window, first)
    assert ref_rows.shape == rows.shape, (ref_rows.shape, rows.shape)
    ref_rows = ref_rows.to(logits.device)
    out: list[tuple] = []
    for _, lp, t, ref in _blocks(rows, targets, ref_rows):
        ref_lp = ref.double().log_softmax(-1)
        kl = _kl_terms(ref_lp, lp).sum(-1)
        out.append(_own(lp, t) + _own(ref_lp, t) + (kl,))
    return Positions(*(torch.cat([o[i] for o in out]).cpu() for i in range(7)))


def score_against_topk(logits: torch.Tensor, ref: TopK, window: list[int], first: int) -> Positions:
    """Figures on one window against a stored top-k reference (see the module docstring for KL)."""
    rows, targets = scored(logits, window, first)
    ids, ref_lp = ref.ids.to(logits.device).long(), ref.logprobs.to(logits.device).double()
    ref_tail = ref.tail.to(logits.device)
    parts: list[tuple] = []
    for block, lp, t in _blocks(rows, targets):
        top_lp, top_ids, tail = ref_lp[block], ids[block], ref_tail[block]
        test_top = lp.gather(1, top_ids).float().double()      # at the precision the reference was stored
        test_tail = lp.scatter(1, top_ids, float("-inf")).logsumexp(-1)
        kl = _kl_terms(top_lp, test_top).sum(-1) + _kl_terms(tail, test_tail)
        parts.append(_own(lp, t) + (kl,))
    nll, top1, p_true, kl = (torch.cat([p[i] for p in parts]).cpu() for i in range(4))
    true_lp = ref.true_logprob.double().cpu()
    return Positions(nll, top1, p_true, -true_lp, ref.ids[:, 0].long().cpu(), true_lp.exp(), kl.clamp_min(0))


def top_k_record(logits: torch.Tensor, window: list[int], first: int, k: int) -> TopK:
    """The reference's top-k record of one window (k is capped at the vocabulary)."""
    rows, targets = scored(logits, window, first)
    k = min(k, rows.shape[-1])
    parts = []
    for _, lp, t in _blocks(rows, targets):
        top_lp, top_ids = lp.topk(k, dim=-1)
        tail = lp.scatter(1, top_ids, float("-inf")).logsumexp(-1)
        parts.append((top_ids.int(), top_lp.float(), tail, lp.gather(1, t[:, None])[:, 0]))
    return TopK(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)))
