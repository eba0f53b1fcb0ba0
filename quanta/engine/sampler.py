"""Next-token choice: penalties, temperature, top-k, top-p, min-p, then a draw with the
exponential trick (argmax of p / Exp(1) noise, no host sync), seeded per request; a batch's plain rows on a GPU
in one read of their logits (kernels/draw.py)."""
from __future__ import annotations

import functools

import torch

from quanta.engine.sampling_params import SamplingParams
from quanta.kernels import draw

SEED_BOUND = 1 << 31        # the draw kernel's Philox key is the seed plus the row, an int32
# Plain rows on a GPU drawn by kernels/draw.py (one read of the logits); off, as on the CPU (torch's exponential
# trick, seven passes). Off until the engine has run it on a GPU: it runs in every GPU engine's start-up.
GPU_DRAW_KERNEL = False


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


def apply_processors(logits: torch.Tensor, output_ids: list[int], p: SamplingParams) -> torch.Tensor:
    """Each of the request's logits processors in turn (vLLM's `fn(output_ids, logits) -> logits`); one
    that returns something other than a row of the same shape is an error of that request."""
    for fn in p.logits_processors:
        out = fn(list(output_ids), logits)
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"logits processor {getattr(fn, '__name__', fn)!r} returned {got}, "
                            f"not a logits row of shape {tuple(logits.shape)}")
        logits = out
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
    return int(sample_row_tensor(logits, p, generator))


def sample_row_tensor(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """sample_row without the host sync: a 0-d long tensor on the logits' device."""
    if p.greedy:
        return logits.argmax()
    probs = filter_logits(logits, p).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()


@functools.lru_cache(maxsize=None)
def _chunks(vocab: int) -> int | None:
    """The largest divisor of `vocab` in [64, 1024], if any."""
    return next((c for c in range(1024, 63, -1) if vocab % c == 0), None)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [B, V] (the first maximum), as a max over V/C-wide chunks then an argmax over
    the C chunk maxima: CUDA reduces a single long row with one thread block, which leaves most of the
    GPU idle on a large vocabulary; the two short reductions spread over many blocks."""
    b, v = x.shape
    c = _chunks(v)
    if c is None:
        return x.argmax(-1)
    values, within = x.view(b, c, v // c).max(-1)
    chunk = values.argmax(-1, keepdim=True)
    return (chunk * (v // c) + within.gather(1, chunk)).squeeze(1)


def is_plain(p: SamplingParams) -> bool:
    """Greedy or temperature-only sampling without penalties or logits processors: the batched path applies."""
    return (not p.logits_processors and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty
            and not p.top_k and p.top_p >= 1.0 and p.min_p <= 0.0)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 histories: list[tuple[list[int], list[int]]], default_generator: torch.Generator | None = None,
                 errors: dict[int, Exception] | None = None) -> torch.Tensor:
    """Token ids [B] (on the logits' device, no host sync) for logits [B, V]. Plain rows without their
    own generator are drawn together (_draw_rows); the others row by row with
    apply_processors, apply_penalties and sample_row's rules and their own generator. `logits` is
    modified. With `errors`, a row whose own sampling raises (a logits processor) is recorded there as
    {row: exception}, its token left meaningless, and the other rows are sampled as usual."""
    plain = [is_plain(p) and g is None for p, g in zip(params, generators)]
    drawn = [pl and not p.greedy for p, pl in zip(params, plain)]
    tokens = None if all(drawn) else argmax_rows(logits)         # greedy rows (the others' are overwritten)
    if any(drawn):
        temps = torch.tensor([p.temperature if d else 1.0 for p, d in zip(params, drawn)],
                             dtype=logits.dtype, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
        tokens_drawn = _draw_rows(logits, temps, default_generator)
        if tokens is None:
            tokens = tokens_drawn
        else:
            mask = torch.tensor(drawn, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
            tokens = torch.where(mask, tokens_drawn, tokens)
    for i, (p, g) in enumerate(zip(params, generators)):
        if plain[i]:
            continue
        try:
            row = apply_processors(logits[i], histories[i][1], p)
            row = apply_penalties(row, histories[i][0], histories[i][1], p)
            tokens[i] = sample_row_tensor(row, p, g if g is not None else default_generator)
        except Exception as e:          # the request's own code or values: fail that request alone
            if errors is None:
                raise
            errors[i] = e
    return tokens


def _draw_rows(logits: torch.Tensor, temps: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A token a row from softmax(logits / temps) [B, V]: on a GPU one read of the logits (draw.py, its noise seeded
    from `generator` on the device; GPU_DRAW_KERNEL); elsewhere the exponential trick in torch."""
    if logits.is_cuda and GPU_DRAW_KERNEL:
        seed = torch.randint(0, SEED_BOUND - logits.shape[0], (1,), device=logits.device, generator=generator,
                             dtype=torch.int32)
        return draw.temperature_draw(logits, temps, seed)
    probs = (logits / temps[:, None]).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return argmax_rows(probs / noise)


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
