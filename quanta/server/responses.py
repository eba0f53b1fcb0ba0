"""OpenAI response bodies from the engine's outputs: choices, streaming deltas, logprobs and usage.

A stream sends each sample's text as it grows, except what may still change: a trailing replacement
character (an incomplete UTF-8 character, which the next token completes) and a tail that could be the
start of a stop string (which the engine cuts from the text once the stop string is complete).
"""
from __future__ import annotations

from dataclasses import dataclass

from quanta.engine.outputs import CompletionOutput, Logprob, RequestOutput


def stable_text(sample: CompletionOutput, stops: list[str]) -> str:
    """The part of the sample's text that can no longer change."""
    text = sample.text
    if sample.finish_reason is not None:
        return text
    text = text.rstrip("\ufffd")
    hold = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[: len(text) - hold]


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has sent."""
    chars: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False


def _top(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, lp) for t, lp in entries.items() if lp.rank <= k), key=lambda x: x[1].rank)


def completion_logprobs(sample: CompletionOutput, start: int, k: int, offset: int) -> dict | None:
    """The legacy completions logprobs object for tokens [start:] (text offsets from `offset`)."""
    if sample.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for token, entries in zip(sample.token_ids[start:], sample.logprobs[start:]):
        chosen = entries[token]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for _, lp in _top(entries, k)} | {text: chosen.logprob})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _entry(text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(sample: CompletionOutput, start: int, k: int) -> dict | None:
    """The chat logprobs object ({"content": [...]}) for tokens [start:]."""
    if sample.logprobs is None:
        return None
    content = []
    for token, entries in zip(sample.token_ids[start:], sample.logprobs[start:]):
        chosen = entries[token]
        content.append(_entry(chosen.decoded_token, chosen.logprob)
                       | {"top_logprobs": [_entry(lp.decoded_token, lp.logprob) for _, lp in _top(entries, k)]})
    return {"content": content}


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts over a request's prompts and every sample."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_choice(index: int, sample: CompletionOutput, k: int | None, token_ids: bool = False) -> dict:
    """One choice of a (non-streamed) completion; with `token_ids`, its generated token ids too."""
    choice = {"index": index, "text": sample.text, "finish_reason": sample.finish_reason,
              "stop_reason": sample.stop_reason,
              "logprobs": completion_logprobs(sample, 0, k or 0, 0) if k is not None else None}
    return choice | ({"token_ids": list(sample.token_ids)} if token_ids else {})


def chat_choice(index: int, sample: CompletionOutput, k: int | None) -> dict:
    """One choice of a (non-streamed) chat completion."""
    return {"index": index, "message": {"role": "assistant", "content": sample.text},
            "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason,
            "logprobs": chat_logprobs(sample, 0, k or 0) if k is not None else None}


def completion_delta(index: int, sample: CompletionOutput, cursor: ChoiceCursor, stops: list[str],
                     k: int | None, token_ids: bool = False) -> dict | None:
    """The next streamed completion choice for a sample, or None when it has nothing new. With `token_ids`
    every new token is news (and its ids are sent), even where it adds no text yet."""
    text = stable_text(sample, stops)
    new_text = text[cursor.chars:]
    new_ids = list(sample.token_ids[cursor.tokens:])
    reason = sample.finish_reason
    if not new_text and reason is None and not (token_ids and new_ids):
        return None
    logprobs = completion_logprobs(sample, cursor.tokens, k or 0, cursor.chars) if k is not None else None
    cursor.chars, cursor.tokens, cursor.done = len(text), len(sample.token_ids), reason is not None
    choice = {"index": index, "text": new_text, "logprobs": logprobs, "finish_reason": reason,
              "stop_reason": sample.stop_reason}
    return choice | ({"token_ids": new_ids} if token_ids else {})


def chat_delta(index: int, sample: CompletionOutput, cursor: ChoiceCursor, stops: list[str],
               k: int | None) -> dict | None:
    """The next streamed chat choice for a sample (the first carries the role), or None."""
    text = stable_text(sample, stops)
    new_text = text[cursor.chars:]
    reason = sample.finish_reason
    if not new_text and reason is None and cursor.started:
        return None
    delta = {"content": new_text}
    if not cursor.started:
        delta["role"] = "assistant"
    logprobs = chat_logprobs(sample, cursor.tokens, k or 0) if k is not None else None
    cursor.chars, cursor.tokens, cursor.started = len(text), len(sample.token_ids), True
    cursor.done = reason is not None
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
