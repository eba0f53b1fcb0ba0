"""A conversation through a tokenizer's chat template, as token ids: the one place the LLM API, the
command line and the server turn messages into a prompt."""
from __future__ import annotations

from typing import Any

from quanta.quant.errors import QuantaError


def token_ids(encoded: Any) -> list[int]:
    """The ids of a tokenizer's output, whether a plain list or a BatchEncoding-like mapping."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def chat_token_ids(tokenizer, messages: list[dict], chat_template: str | None = None,
                   add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """`messages` rendered by `chat_template` (default: the tokenizer's own) and tokenized; QuantaError when
    there is no tokenizer or no template."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or template is None:
        raise QuantaError("the model has no chat template: use a plain prompt, or give one (--chat-template)")
    return token_ids(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                   add_generation_prompt=add_generation_prompt, **template_kwargs))
