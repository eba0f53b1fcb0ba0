"""The two generation routes' work: prompts to token ids, one engine request per prompt, and the
response, whole or as Server-Sent Events ending in `data: [DONE]`.

A request with several prompts runs them as separate engine requests in the same batch; choice
`i * n + j` is sample j of prompt i. A client that goes away (a dropped stream, or a disconnect noticed
while a whole response is being gathered) aborts every engine request of its HTTP request. Tokenizing and
chat templating run on a worker pool, behind the limits (limits.py), so that no prompt holds the event
loop; a stopped engine is a 503.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from fastapi import Request
from jinja2 import TemplateError
from fastapi.responses import StreamingResponse

from quanta.engine.drivers.client import EngineClient, EngineDeadError
from quanta.engine.chat_template import chat_token_ids
from quanta.engine.outputs import RequestOutput
from quanta.quant.errors import ConfigError
from quanta.server import responses as R
from quanta.server.errors import APIError, error_body
from quanta.server.guards import REQUEST_ID, internal_message
from quanta.server.limits import Limits
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
TOKENIZER_THREADS = 2       # prompts tokenized at once; the tokenizer releases the GIL while it works
TOKENIZER_NICE = 10         # below the engine: a huge prompt's tokenizing must not slow the others' steps


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several engine streams as they come. Leaving early cancels the
    pumps, which closes each stream and so aborts its engine request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:           # reported to the consumer, which raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Serving:
    """Route logic over one engine; `model_name` is the served model's name."""

    def __init__(self, engine: EngineClient, model_name: str, chat_template: str | None = None,
                 limits: Limits = Limits(), loras: dict | None = None):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.loras = dict(loras or {})
        self.tokenizer = engine.tokenizer
        self.limits = limits.for_model(self.tokenizer, engine.max_model_len)
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="quanta-tokenize",
                                       initializer=_lower_priority)

    # --- prompts ------------------------------------------------------------------------------------
    def check_model(self, model: str | None):
        """The LoRARequest that `model` names, None for the served base model (or when omitted); 404 for any
        other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_samples(self, n: int, prompts: int) -> None:
        """400 when the request asks for more samples (n times its prompts) than max_n."""
        if n * prompts > self.limits.max_n:
            raise APIError(400, f"the request asks for {n * prompts} samples (n={n} x {prompts} prompt(s)), more "
                                f"than this server's limit of {self.limits.max_n} (--max-n)", "n")

    def check_chars(self, chars: int, param: str) -> None:
        """400 for a text too long to fit in the context whatever it tokenizes to (limits.py)."""
        if chars > self.limits.max_prompt_chars:
            raise APIError(400, f"the prompt has {chars:,} characters, more than this server takes "
                                f"({self.limits.max_prompt_chars:,}: more than max_model_len="
                                f"{self.engine.max_model_len} tokens can hold; --max-prompt-chars)", param)

    async def _ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            return prompt, await self._off_loop(
                lambda: list(self.tokenizer(prompt, return_attention_mask=False)["input_ids"]))
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return None, list(prompt)

    async def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or template is None:
            raise APIError(400, "this model has no chat template: start the server with --chat-template", "messages")
        conversation = req.conversation()
        self.check_chars(sum(len(m["content"]) for m in conversation), "messages")

        def render() -> list[int]:
            try:
                return chat_token_ids(self.tokenizer, conversation, chat_template=template,
                                      add_generation_prompt=req.add_generation_prompt)
            except TemplateError as e:          # the template's own refusal (roles out of order, ...)
                raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
        return await self._off_loop(render)

    async def _off_loop(self, fn: Callable):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    # --- routes -------------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        """/v1/completions."""
        lora = self.check_model(req.model)
        params = _checked(req.sampling_params)
        texts = _checked(req.prompts)
        self.check_samples(params.n, len(texts))
        self.check_chars(max((len(p) for p in texts if isinstance(p, str)), default=0), "prompt")
        prompts = [await self._ids(p) for p in texts]
        return await self._respond(req, raw, prompts, params, "cmpl", "text_completion",
                                   partial(R.completion_choice, token_ids=req.return_token_ids),
                                   partial(R.completion_delta, token_ids=req.return_token_ids), req.logprobs, lora)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """/v1/chat/completions."""
        lora = self.check_model(req.model)
        params = _checked(req.sampling_params)
        self.check_samples(params.n, 1)
        prompts = [(None, await self._chat_ids(req))]
        k = (req.top_logprobs or 0) if req.logprobs else None
        return await self._respond(req, raw, prompts, params, "chatcmpl", "chat.completion",
                                   R.chat_choice, R.chat_delta, k, lora)

    async def _respond(self, req, raw: Request, prompts, params, prefix: str, obj: str,
                       choice: Callable, delta: Callable, k: int | None, lora=None):
        for _, ids in prompts:
            _checked(lambda: self.engine.check_prompt(ids, params.max_tokens),
                     "prompt" if prefix == "cmpl" else "messages")
        if not self.engine.healthy:
            raise APIError(503, f"the engine is not running: {self.engine.error}")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        streams = [self.engine.generate(ids, params, f"{rid}-{i}", text, lora) for i, (text, ids) in enumerate(prompts)]
        head = {"id": rid, "object": obj, "created": int(time.time()),
                "model": self.model_name if lora is None else lora.lora_name}
        if req.stream:
            events = self._events(streams, head | {"object": obj + ".chunk" if prefix == "chatcmpl" else obj},
                                  params, delta, k, req.include_usage, raw.scope.get(REQUEST_ID, rid))
            return StreamingResponse(events, media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge(streams):
                finals[i] = out
                if await raw.is_disconnected():
                    raise asyncio.CancelledError()
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        outs = [finals[i] for i in range(len(prompts))]
        choices = [choice(i * params.n + s.index, s, k) for i, o in enumerate(outs) for s in o.outputs]
        return head | {"choices": choices, "usage": R.usage(outs)}

    async def _events(self, streams, head: dict, params, delta: Callable, k: int | None,
                      include_usage: bool, request_id: str) -> AsyncIterator[str]:
        cursors = {}
        latest: dict[int, RequestOutput] = {}
        extra = {"usage": None} if include_usage else {}
        try:
            async for i, out in merge(streams):
                latest[i] = out
                choices = []
                for sample in out.outputs:
                    index = i * params.n + sample.index
                    cursor = cursors.setdefault(index, R.ChoiceCursor())
                    if not cursor.done:
                        c = delta(index, sample, cursor, params.stop, k)
                        if c is not None:
                            choices.append(c)
                if choices:
                    yield _sse(head | {"choices": choices} | extra)
            if include_usage:
                yield _sse(head | {"choices": [], "usage": R.usage([latest[i] for i in sorted(latest)])})
        except EngineDeadError as e:        # the status line is sent already: report in the stream
            yield _sse(error_body(503, str(e)))
        except Exception:
            log.exception("request %s failed while streaming", request_id)
            yield _sse(error_body(500, internal_message(request_id)))
        yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _checked(fn: Callable, param: str | None = None):
    """fn(), with ConfigError turned into a 400."""
    try:
        return fn()
    except ConfigError as e:
        raise APIError(400, str(e), param) from None


def _lower_priority() -> None:
    """Run this worker thread at a lower priority (Linux schedules threads by their own nice value), so that
    on a machine with few cores the engine's steps come before a huge prompt's tokenizing."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZER_NICE)
    except (AttributeError, OSError):      # not Linux, or not allowed: run at the normal priority
        pass
