"""What one request may ask of the server, checked before any work it would cost: the body's bytes (before
it is read), the prompt's characters (before it is tokenized) and the samples (before they are queued).

The prompt limit follows from the model: no token stands for more characters than the tokenizer's longest
vocabulary entry, so a text longer than max_model_len times that many characters cannot fit in the context
and is refused without tokenizing it. The body limit leaves room for that text with every character
escaped, or for max_n prompts of max_model_len token ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from quanta.quant.errors import ConfigError

DEFAULT_MAX_N = 128                 # samples one request may start (n times its prompts): OpenAI's own cap on n
ESCAPED_CHAR_BYTES = 12             # the most JSON spends on a character: a surrogate pair as two \uXXXX escapes
TOKEN_ID_BYTES = 7                  # a token id under ten million and its comma
BODY_HEADROOM = 1 << 20             # the request's other fields


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one server; None fields are derived from the model (for_model)."""
    max_prompt_chars: int | None = None
    max_request_bytes: int | None = None
    max_n: int = DEFAULT_MAX_N

    def __post_init__(self):
        for name in ("max_prompt_chars", "max_request_bytes", "max_n"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    def for_model(self, tokenizer, max_model_len: int) -> Limits:
        """These limits with the unset ones derived from the tokenizer and max_model_len."""
        chars = self.max_prompt_chars
        if chars is None:
            chars = max_model_len * longest_token_chars(tokenizer)
        body = self.max_request_bytes
        if body is None:
            body = max(chars * ESCAPED_CHAR_BYTES, self.max_n * max_model_len * TOKEN_ID_BYTES) + BODY_HEADROOM
        return Limits(chars, body, self.max_n)


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the length of the longest vocabulary entry
    (a byte-level entry spells each byte as one character, and a character takes at least one byte)."""
    if tokenizer is None:
        return 1
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
