"""One generated sample: its tokens, its sampling state and the rules that end it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, tokenizer, eos_ids: list[int], max_len: int) -> None:
        """Add a sampled token, re-decode the text and decide whether the sample is finished."""
        p = self.params
        self.output_ids.append(token)
        previous_len = len(self.text)
        self.text = tokenizer.decode(self.output_ids, skip_special_tokens=p.skip_special_tokens)
        if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
            self.finish_reason, self.stop_reason = "stop", token
            if token not in p.stop_token_ids or p.skip_special_tokens:
                self.text = tokenizer.decode(self.output_ids[:-1], skip_special_tokens=p.skip_special_tokens)
            return
        for stop in p.stop:
            # Only text reaching into the newly decoded tail can hold a new match.
            at = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if at >= 0:
                self.finish_reason, self.stop_reason = "stop", stop
                self.text = self.text[: at + len(stop)] if p.include_stop_str_in_output else self.text[:at]
                return
        if (p.max_tokens is not None and len(self.output_ids) >= p.max_tokens) or self.num_tokens >= max_len:
            self.finish_reason = "length"

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(index=self.index, text=self.text, token_ids=list(self.output_ids),
                                cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
                                logprobs=self.logprobs, finish_reason=self.finish_reason,
                                stop_reason=self.stop_reason)
