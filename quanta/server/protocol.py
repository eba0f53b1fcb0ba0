"""The OpenAI request bodies the server accepts (with vLLM's sampling extras), and their SamplingParams.

Out-of-range values are refused here or by SamplingParams' own checks; either way the server answers
400 with an OpenAI-style error body naming the parameter.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from quanta.engine.sampling_params import SamplingParams
from quanta.quant.errors import ConfigError

MAX_TOP_LOGPROBS = 20


def _unicode(text: str) -> str:
    """`text` unchanged if it is valid Unicode; JSON's \\u escapes can carry a lone surrogate, which no
    tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode text: a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]       # a string the tokenizer can take


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields common to both routes."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams of the request (OpenAI defaults where unset); ConfigError when out of range."""
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
        given = {k: v for k, v in dict(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty).items() if v is not None}
        try:
            return SamplingParams(n=self.n, max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                                  stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, **given)
        except ConfigError as e:
            raise ConfigError(str(e).removeprefix("SamplingParams: ")) from None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False       # vLLM's extension: each choice also carries its new token ids

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of the request; ConfigError when a value is out of range or unsupported."""
        if self.echo or self.suffix:
            raise ConfigError("echo and suffix are not supported")
        return self._params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts: each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ConfigError("prompt must not be empty")
        return list(p)


class ContentPart(BaseModel):
    """One part of a message's content; this server's models read text parts only."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_part(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported: this model reads text")
        if self.text is None:
            raise ValueError("a text content part needs its `text`")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's content as text (the parts of a multi-part content joined)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        """SamplingParams of the request; ConfigError when a value is out of range."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]
