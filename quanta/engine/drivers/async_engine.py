"""AsyncEngine: the server's driver of one EngineCore, an asyncio loop over step().

    engine = AsyncEngine(core)
    await engine.start()                                   # inside the running event loop
    async for out in engine.generate(prompt_ids, params, request_id):
        ...                                                # RequestOutputs as the request advances
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from quanta.engine.core import EngineCore
from quanta.engine.requests import RequestFailedError
from quanta.engine.outputs import RequestOutput
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.drivers.client import EngineDeadError, Intake
from quanta.engine.drivers.stats import EngineStats, RequestTimes

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    lora_request: object | None = None


class AsyncEngine(Intake):
    """Drives `core` from an asyncio task; `stats` holds the serving counters and histograms.

    One task owns the core. It sleeps while nothing is pending; otherwise it applies the requests added and
    aborted since the last step, runs one step in a worker thread (so the event loop keeps serving HTTP
    while the model computes), and puts each RequestOutput on its request's asyncio.Queue. New requests
    therefore join the running batch at the next step. add_request and abort touch the core only on this
    task, between steps, never during one. A consumer that stops listening (a client that disconnects or
    times out) closes its generator, which aborts the request: its blocks are freed before the next step."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.stats = EngineStats()
        self._queues: dict[str, asyncio.Queue] = {}
        self._times: dict[str, RequestTimes] = {}
        self._tokens_seen: dict[str, int] = {}
        self._adds: list[_Pending] = []
        self._aborts: list[str] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop task on the running event loop."""
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="quanta-engine-loop")

    async def stop(self) -> None:
        """Cancel the loop task and wait for it (a step in flight finishes in its thread)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):    # a failure of the loop is in self.error, logged
                pass

    @property
    def healthy(self) -> bool:
        """Whether the loop is running and has not died on an error."""
        return self._task is not None and not self._task.done() and self.error is None

    # --- what the server reads (ProcessEngine answers the same) ----------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer (None for a model without one)."""
        return self.core.tokenizer

    @property
    def vocab_size(self) -> int:
        """Token ids run over [0, vocab_size)."""
        return self.core.checkpoint.config.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + output) the engine runs."""
        return self.core.max_model_len

    @property
    def model(self) -> str:
        """The model as configured (a path or a synthetic spec)."""
        return str(self.core.config.model)

    def gauges(self) -> dict[str, int]:
        """Scheduler and pool figures (for /metrics)."""
        from quanta.engine.drivers.core_process import gauges
        return gauges(self.core)

    def _running(self, request_id: str) -> bool:
        return request_id in self._queues

    async def _submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      prompt: str | None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Queue the request for the loop to add between steps; yield what its queue receives."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._times[request_id] = RequestTimes(time.monotonic(), len(prompt_ids))
        self._adds.append(_Pending(request_id, prompt_ids, params, prompt, lora_request))
        self._wake.set()
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def abort(self, request_id: str) -> None:
        """Abort a request at the next break between steps (no-op once it has finished)."""
        if request_id in self._queues:
            self._aborts.append(request_id)
            self._wake.set()

    # --- the loop ---------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while True:
                self._apply_pending()
                if not self.core.has_unfinished():
                    self._wake.clear()
                    if not self._adds and not self._aborts:
                        await self._wake.wait()
                    continue
                outputs = await asyncio.to_thread(self.core.step, True)
                self._dispatch(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as e:                 # the core failed: fail every request, keep the reason
            log.exception("engine loop failed")
            self.error = e
            for queue in self._queues.values():
                queue.put_nowait(EngineDeadError(f"the engine failed: {e!r}"))
            raise

    def _apply_pending(self) -> None:
        """Add the queued requests, then carry out the aborts (between steps only)."""
        adds, self._adds = self._adds, []
        for p in adds:
            if p.request_id not in self._queues:      # aborted before it was added
                continue
            try:
                self.core.add_request(p.prompt_ids, p.params, p.request_id, prompt=p.prompt,
                                      lora_request=p.lora_request)
            except Exception as e:                  # that request's fault only: the loop goes on
                self._forget(p.request_id).put_nowait(e)
                continue
            self.stats.prompt_tokens += len(p.prompt_ids)
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            if rid in self._queues:
                out = self.core.abort(rid)
                times = self._times[rid]
                queue = self._forget(rid)
                self.stats.on_finish(times, "abort", time.monotonic())
                if out is not None:
                    queue.put_nowait(out)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Count each output's new tokens and hand it to its request's queue."""
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            if rid not in self._queues:
                continue
            times = self._times[rid]
            seen = sum(len(o.token_ids) for o in out.outputs)
            self.stats.on_tokens(times, seen - self._tokens_seen.get(rid, 0), now)
            self._tokens_seen[rid] = seen
            queue = self._queues[rid]
            if out.finished:
                reason = out.outputs[0].finish_reason if out.outputs else "abort"
                self.stats.on_finish(times, reason or "abort", now)
                self._forget(rid)
            queue.put_nowait(out if out.error is None else RequestFailedError(f"request {rid} failed: {out.error}"))

    def _forget(self, request_id: str) -> asyncio.Queue:
        self._times.pop(request_id, None)
        self._tokens_seen.pop(request_id, None)
        return self._queues.pop(request_id)
