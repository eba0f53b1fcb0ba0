"""EngineClient: what the server needs of an engine driver (AsyncEngine in-process, ProcessEngine in a
process of its own), and the request intake both drivers share."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from quanta.engine.drivers.stats import EngineStats
from quanta.engine.outputs import RequestOutput
from quanta.engine.sampling_params import SamplingParams
from quanta.quant.errors import ConfigError


class EngineDeadError(RuntimeError):
    """The engine stopped (its loop failed, its process died or the server is shutting down): every request
    in flight and every new one fails with this, and the server answers 503."""


class EngineClient(Protocol):
    """An engine the server drives: started and stopped with the app, asked for one request's outputs."""
    stats: EngineStats                  # serving counters and latency histograms (/metrics)
    error: BaseException | None         # why the engine stopped, once it has
    tokenizer: Any                      # the model's tokenizer (None for a model without one)
    vocab_size: int                     # token ids run over [0, vocab_size)
    max_model_len: int                  # the longest sequence (prompt + output) the engine runs
    model: str                          # the model as configured (a path or a synthetic spec)

    async def start(self) -> None: ...
    async def stop(self) -> None: ...

    @property
    def healthy(self) -> bool: ...

    def gauges(self) -> dict[str, int]: ...
    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None = None) -> None: ...
    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 prompt: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...


def check_prompt_fits(max_model_len: int, prompt_ids: list[int], max_tokens: int | None = None) -> None:
    """Raise ConfigError for a prompt the core would refuse (empty, or no room under max_model_len), or
    one whose explicit max_tokens would run past max_model_len (as vLLM's server refuses it, rather
    than cut the output short unasked)."""
    limit, length = max_model_len, len(prompt_ids)
    if not prompt_ids:
        raise ConfigError("the prompt is empty: it must have at least one token")
    if length >= limit:
        raise ConfigError(f"the prompt has {length} tokens, which leaves no room for output "
                          f"under this model's maximum context length of {limit} tokens")
    if max_tokens is not None and length + max_tokens > limit:
        raise ConfigError(f"this model's maximum context length is {limit} tokens, but {length + max_tokens} "
                          f"were requested ({length} in the prompt, {max_tokens} in max_tokens); reduce "
                          f"max_tokens to at most {limit - length}")


class Intake:
    """The request intake of a driver: `generate` checks the request, hands it to the driver's `_submit`
    (which registers it and yields its outputs) and aborts it when its consumer stops listening (a client
    that disconnects or times out closes the generator). Drivers provide healthy, error, max_model_len,
    abort, `_running(request_id)` and `_submit`."""

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None = None) -> None:
        """check_prompt_fits under this engine's max_model_len."""
        check_prompt_fits(self.max_model_len, prompt_ids, max_tokens)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Queue one request (with `lora_request`'s adapter, or none) and yield its RequestOutputs until the
        finished one. Closing the generator early (the consumer went away) aborts the request."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        self.check_prompt(prompt_ids)
        if self._running(request_id):
            raise ConfigError(f"request id {request_id!r} is already running")
        finished = False
        try:
            async for out in self._submit(list(prompt_ids), params, request_id, prompt, lora_request):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)
