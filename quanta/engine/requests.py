"""The engine's requests: intake (checks, ids, one Sequence per sample), folding each step's sampled tokens
into them (logprobs, stop rules, n > 1 forks, a request that fails alone) and the RequestOutputs they give."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
import logging
import operator
from dataclasses import dataclass, field

import torch

from quanta.engine.outputs import Logprob, RequestOutput
from quanta.engine.sampler import top_logprobs
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.scheduler import Scheduler
from quanta.engine.sequence import Sequence
from quanta.lora.request import LoRARequest
from quanta.quant.errors import ConfigError, QuantaError

log = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1


class RequestFailedError(QuantaError, RuntimeError):
    """One request failed alone (its logits processor or its text decoding raised; RequestOutput.error
    says how); the engine and the other requests go on."""


@dataclass(eq=False)
class Request:
    """One prompt and its `params.n` samples (sample 0 first; the rest fork from it after its prefill)."""
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    error: str | None = None            # set when the request failed alone (Requests.fail)
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        """Whether every sample of the request exists and has finished."""
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)


class Requests(Mapping[str, Request]):
    """The requests one core runs, by id, over its scheduler (a read-only mapping of the unfinished ones)."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_ids: list[int], vocab_size: int, max_model_len: int,
                 device: torch.device):
        self.scheduler, self.tokenizer, self.eos_ids = scheduler, tokenizer, eos_ids
        self.vocab_size, self.max_model_len, self.device = vocab_size, max_model_len, device
        self.running: dict[str, Request] = {}
        self._counter = itertools.count()

    def __getitem__(self, request_id: str) -> Request:
        return self.running[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.running)

    def __len__(self) -> int:
        return len(self.running)

    def add(self, prompt_ids: list[int], params: SamplingParams | None, request_id: str | None,
            prompt: str | None, lora_request=None) -> str:
        """Check and queue one tokenized prompt (with `lora_request`'s adapter, or none); returns its id."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ConfigError("prompt is empty: it must have at least one token")
        try:
            prompt_ids = [operator.index(t) for t in prompt_ids]
        except TypeError:
            prompt_ids = None
        if prompt_ids is None or not all(0 <= t < self.vocab_size for t in prompt_ids):
            # An id off the embedding table would fail the whole batch's step (on a GPU, the context).
            raise ConfigError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(prompt_ids)} tokens leaves no room under "
                              f"max_model_len={self.max_model_len}")
        rid = str(next(self._counter)) if request_id is None else str(request_id)
        if rid in self.running:
            raise ConfigError(f"request id {rid!r} is already running")
        req = self.running[rid] = Request(rid, prompt, list(prompt_ids), params, lora_request=lora_request)
        self.scheduler.add(self._new_seq(req))
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its output so far, finish_reason "abort" (None if unknown)."""
        req = self.running.get(str(request_id))
        if req is None:
            return None
        self.scheduler.abort(req.request_id)
        for seq in req.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        while len(req.seqs) < req.params.n:
            self._new_seq(req).finish_reason = "abort"
        return self.output(req)

    def fold(self, seqs: list[Sequence], tokens: list[int], raw: torch.Tensor | None,
             errors: dict[int, Exception]) -> list[Request]:
        """Fold sampled tokens into their sequences: logprobs, stop rules, n > 1 forks, finishing. A row
        whose sampling failed (`errors`: its logits processor) or whose folding raises (its tokenizer
        decode) fails its request alone (fail); the other rows fold as usual. Returns the requests touched."""
        touched: dict[str, Request] = {}
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:                 # ended (stop, EOS, abort, error) while this step was in flight
                continue
            req = touched[seq.request_id] = self.running[seq.request_id]
            error = errors.get(row)
            if error is None:
                try:
                    self._fold_one(req, seq, token, None if raw is None else raw[row])
                except Exception as e:
                    error = e
            if error is not None:
                self.fail(req, seq, error)
        return list(touched.values())

    def fail(self, req: Request, seq: Sequence | None, error: Exception) -> None:
        """End `req` with finish_reason "error" on its unfinished samples (and on `seq`, the one that
        failed) and free its blocks: a failure of the request's own code or text, which the rest of the
        batch never sees. The reason is kept as `error` for its last RequestOutput."""
        log.warning("request %s failed alone: %s: %s", req.request_id, type(error).__name__, error)
        req.error = f"{type(error).__name__}: {error}"
        for dropped in self.scheduler.abort(req.request_id):
            dropped.finish_reason = "error"
        if seq is not None:
            seq.finish_reason = "error"
        while len(req.seqs) < req.params.n:
            self._new_seq(req).finish_reason = "error"

    def output(self, req: Request) -> RequestOutput:
        """The request's RequestOutput now (its text synced); a finished request is forgotten here."""
        for seq in req.seqs:
            if not seq.finished:
                try:
                    seq.sync_text(self.tokenizer)     # incremental: O(1) per new token
                except Exception as e:
                    self.fail(req, None, e)
                    break
        done = req.finished or any(s.finish_reason in ("abort", "error") for s in req.seqs)
        if done:
            self.running.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [s.to_output() for s in req.seqs],
                             finished=done, error=req.error, lora_request=req.lora_request)

    def _fold_one(self, req: Request, seq: Sequence, token: int, raw: torch.Tensor | None) -> None:
        if seq.logprobs is not None:
            chosen, top = top_logprobs(raw, token, seq.params.logprobs)
            seq.cumulative_logprob += chosen
            seq.logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t]) if self.tokenizer else None)
                                 for t, (lp, rank) in top.items()})
        seq.append(token, self.tokenizer, self.eos_ids)
        while not req.forked and len(req.seqs) < req.params.n:
            self.scheduler.fork(seq, self._new_seq(req))
        req.forked = True
        if seq.finished:
            self.scheduler.finish(seq)

    def _new_seq(self, req: Request) -> Sequence:
        """The request's next sample; a seeded one draws from a generator of its own (sample_seed), so its
        tokens do not depend on the other samples, the batch or preemption."""
        p = req.params
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sample_seed(p.seed, len(req.seqs)))
        seq = Sequence(req.request_id, len(req.seqs), req.prompt_ids, p, generator, lora_request=req.lora_request,
                       logprobs=[] if p.logprobs is not None else None,
                       max_len=self.max_model_len if p.max_tokens is None
                       else min(self.max_model_len, len(req.prompt_ids) + p.max_tokens))
        req.seqs.append(seq)
        return seq


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed`: the seed itself for sample 0 (so n = 1
    and sample 0 of n > 1 agree), else a splitmix64 mix of both, so samples draw unrelated streams."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)
