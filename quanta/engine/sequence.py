"""One generated sample: its tokens, its sampling state, its KV blocks and the rules that end it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quanta.engine.detokenizer import IncrementalDetokenizer
from quanta.engine.outputs import CompletionOutput, Logprob
from quanta.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int                               # sample number within its request (n > 1)
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    max_len: int | None = None               # prompt + max_tokens, capped at max_model_len
    # Paged-engine state (block_pool.py / scheduler.py).
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0             # tokens whose K/V are in the cache
    num_cached_tokens: int = 0               # of those, how many came from the prefix cache
    num_hashed_blocks: int = 0               # leading full blocks registered in the prefix cache
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    lora_request: object | None = None       # its quanta.LoRARequest: the adapter, and its own prefix cache

    @property
    def lora_id(self) -> int | None:
        """The adapter's id, None without one."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        """Prompt and generated token ids, in order."""
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        """Whether a stop rule, a length limit or an abort has ended the sample."""
        return self.finish_reason is not None

    @property
    def runs_to_length(self) -> bool:
        """Whether only its length limit can end the sample (ignore_eos, no stop tokens or strings)."""
        p = self.params
        return p.ignore_eos and not p.stop_token_ids and not p.stop

    def tokens_to_come(self) -> int:
        """Tokens the sample may still add before max_tokens / max_len (0 without max_len)."""
        return 0 if self.max_len is None else max(0, self.max_len - self.num_tokens)

    def ends_by_length(self, pending: int = 0) -> bool:
        """Whether the sample is finished by max_tokens / max_len once `pending` more tokens are appended."""
        p = self.params
        return ((p.max_tokens is not None and len(self.output_ids) + pending >= p.max_tokens)
                or (self.max_len is not None and self.num_tokens + pending >= self.max_len))

    def append(self, token: int, tokenizer, eos_ids: list[int]) -> None:
        """Add a sampled token and decide whether the sample is finished. The text follows the tokens
        incrementally only when stop strings need it (else it is caught up by `sync_text` or decoded
        once at the end); a finished sample's text is one whole decode, so it never depends on how
        the text was followed."""
        p = self.params
        self.output_ids.append(token)
        previous_len = len(self.text)
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            self.finish_reason, self.stop_reason = "stop", token
            drop = token not in p.stop_token_ids or p.skip_special_tokens
            self.decode_text(tokenizer, self.output_ids[:-1] if drop else self.output_ids)
            return
        if p.stop:
            self.sync_text(tokenizer)
        for stop in p.stop:
            # Only text reaching into the newly decoded tail can hold a new match.
            start = max(0, previous_len - len(stop) + 1)
            if self.text.find(stop, start) >= 0:
                self.finish_reason, self.stop_reason = "stop", stop
                self.decode_text(tokenizer)
                at = self.text.find(stop, start)
                self.text = self.text[: at + len(stop)] if p.include_stop_str_in_output else self.text[:at]
                return
        if self.ends_by_length():
            self.finish_reason = "length"
            self.decode_text(tokenizer)

    def sync_text(self, tokenizer) -> None:
        """Bring `text` up to the output so far incrementally (detokenizer.py: a short decode per new
        token, and never half a UTF-8 character); no-op without a tokenizer."""
        if tokenizer is None:
            return
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)
        self.detokenizer.extend(self.output_ids[len(self.detokenizer.ids):])
        self.text = self.detokenizer.text

    def decode_text(self, tokenizer, ids: list[int] | None = None) -> None:
        """Set `text` to the detokenized output (or `ids`); no-op without a tokenizer."""
        if tokenizer is not None:
            ids = self.output_ids if ids is None else ids
            self.text = tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def to_output(self) -> CompletionOutput:
        """The sample as a vLLM CompletionOutput."""
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.output_ids),
                                cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
                                logprobs=self.logprobs, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason)
