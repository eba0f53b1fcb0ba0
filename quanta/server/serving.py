"""The two generation routes' work: prompts to token ids, one engine request per prompt, and the
response, whole or as Server-Sent Events ending in `data: [DONE]`.

A request with several prompts runs them as separate engine requests in the same batch; choice
`i * n + j` is sample j of prompt i. A client that goes away (a dropped stream, or a disconnect noticed
while a whole response is being gathered) aborts every engine request of its HTTP request.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import Request
from fastapi.responses import StreamingResponse

from quanta.engine.drivers.client import EngineClient
from quanta.engine.chat_template import chat_token_ids
from quanta.engine.outputs import RequestOutput
from quanta.quant.errors import ConfigError
from quanta.server import responses as R
from quanta.server.errors import APIError, error_body
from quanta.server.protocol import ChatCompletionRequest, CompletionRequest


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

    def __init__(self, engine: EngineClient, model_name: str, chat_template: str | None = None):
        self.engine, self.model_name, self.chat_template = engine, model_name, chat_template
        self.tokenizer = engine.tokenizer

    # --- prompts ------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served model (or omitted)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def _ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        vocab = self.engine.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return None, list(prompt)

    def _chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or template is None:
            raise APIError(400, "this model has no chat template: start the server with --chat-template", "messages")
        return chat_token_ids(self.tokenizer, req.conversation(), chat_template=template,
                              add_generation_prompt=req.add_generation_prompt)

    # --- routes -------------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request):
        """/v1/completions."""
        self.check_model(req.model)
        params = _checked(req.sampling_params)
        prompts = [self._ids(p) for p in _checked(req.prompts)]
        return await self._respond(req, raw, prompts, params, "cmpl", "text_completion",
                                   partial(R.completion_choice, token_ids=req.return_token_ids),
                                   partial(R.completion_delta, token_ids=req.return_token_ids), req.logprobs)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """/v1/chat/completions."""
        self.check_model(req.model)
        params = _checked(req.sampling_params)
        prompts = [(None, self._chat_ids(req))]
        k = (req.top_logprobs or 0) if req.logprobs else None
        return await self._respond(req, raw, prompts, params, "chatcmpl", "chat.completion",
                                   R.chat_choice, R.chat_delta, k)

    async def _respond(self, req, raw: Request, prompts, params, prefix: str, obj: str,
                       choice: Callable, delta: Callable, k: int | None):
        for _, ids in prompts:
            _checked(lambda: self.engine.check_prompt(ids, params.max_tokens),
                     "prompt" if prefix == "cmpl" else "messages")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        streams = [self.engine.generate(ids, params, f"{rid}-{i}", text) for i, (text, ids) in enumerate(prompts)]
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            events = self._events(streams, head | {"object": obj + ".chunk" if prefix == "chatcmpl" else obj},
                                  params, delta, k, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge(streams):
            finals[i] = out
            if await raw.is_disconnected():
                raise asyncio.CancelledError()
        outs = [finals[i] for i in range(len(prompts))]
        choices = [choice(i * params.n + s.index, s, k) for i, o in enumerate(outs) for s in o.outputs]
        return head | {"choices": choices, "usage": R.usage(outs)}

    async def _events(self, streams, head: dict, params, delta: Callable, k: int | None,
                      include_usage: bool) -> AsyncIterator[str]:
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
        except Exception as e:              # the status line is sent already: report in the stream
            yield _sse(error_body(500, f"generation failed: {e}"))
        yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _checked(fn: Callable, param: str | None = None):
    """fn(), with ConfigError turned into a 400."""
    try:
        return fn()
    except ConfigError as e:
        raise APIError(400, str(e), param) from None
