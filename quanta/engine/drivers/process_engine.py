"""ProcessEngine: the server's engine, an EngineCore stepping in its own process (core_process.py), behind
the EngineClient interface on the server's side.

    engine = ProcessEngine(EngineConfig(model=...))        # starts the process; raises its load error
    await engine.start()                                   # inside the running event loop
    async for out in engine.generate(prompt_ids, params, request_id):
        ...
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from quanta.engine.drivers import core_process
from quanta.engine.drivers.client import EngineDeadError, Intake
from quanta.engine.config import EngineConfig
from quanta.engine.requests import RequestFailedError
from quanta.engine.outputs import CompletionOutput, RequestOutput
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.drivers.stats import EngineStats, RequestTimes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """One request's state on the server's side, as the engine's updates built it."""
    prompt: str | None
    prompt_ids: list[int]
    times: RequestTimes
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    finished: bool = False
    failure: BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def fold(self, samples: list[tuple]) -> int:
        """Apply one update's samples (core_process.delta_of); returns the new tokens over all samples."""
        new_tokens = 0
        for index, ids, keep, tail, lps, cumulative, reason, stop in samples:
            s = self.samples.get(index)
            if s is None:
                s = self.samples[index] = CompletionOutput(index, "", [], logprobs=None if lps is None else [])
            s.token_ids += ids
            if keep < len(s.text) or tail:
                s.text = s.text[:keep] + tail
            if lps is not None:
                s.logprobs += lps
            s.cumulative_logprob, s.finish_reason, s.stop_reason = cumulative, reason, stop
            new_tokens += len(ids)
        return new_tokens

    def snapshot(self, request_id: str) -> RequestOutput:
        """A RequestOutput of the state now, sharing nothing mutable with it."""
        outs = [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                 None if s.logprobs is None else list(s.logprobs), s.finish_reason, s.stop_reason)
                for _, s in sorted(self.samples.items())]
        return RequestOutput(request_id, self.prompt, self.prompt_ids, outs, finished=self.finished)


class ProcessEngine(Intake):
    """Drives an EngineCore built from `config` in a child process; `stats` holds the serving counters.

    A consumer gets its request's latest state when it asks: one that falls behind the engine (a slow client,
    a busy loop) gets several steps' tokens in one RequestOutput instead of a backlog of one per step, so the
    serving work per token shrinks exactly when it would otherwise hold the engine back (vLLM's output
    collector does the same). Requests and aborts issued in one pass of the event loop reach the engine as
    one message. The process is spawned, unless the caller asks for "fork": that spares the child the imports
    but is safe only before the parent has run any torch op (a forked child hangs in OpenMP once the parent's
    thread pool exists) or touched CUDA; `quanta serve` forks on the CPU, first thing."""

    def __init__(self, config: EngineConfig, timeout: float | None = None, start_method: str = "spawn"):
        ctx = multiprocessing.get_context(start_method)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=core_process.run, args=(config, child, self._conn), name="quanta-engine")
        self._proc.start()
        child.close()
        from quanta.engine.model_loader import open_checkpoint
        try:
            checkpoint = open_checkpoint(config)           # the tokenizer and vocabulary, while the core loads
            self.tokenizer, self.vocab_size = checkpoint.tokenizer, checkpoint.config.vocab_size
            self.model = str(config.model)
            self._ready(timeout)
        except BaseException:
            self._end_child()                              # a child left loading would outlive the error
            raise
        self.stats = EngineStats()
        self._streams: dict[str, _Stream] = {}
        self._outbox: list[tuple] = []
        self._unacked: set[str] = set()                    # added here, not yet taken by the engine
        self._gauges = {"running": 0, "waiting": 0, "free_blocks": self.num_kv_blocks,
                        "total_blocks": self.num_kv_blocks, "preemptions": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.error: BaseException | None = None

    def _ready(self, timeout: float | None) -> None:
        try:
            if not self._conn.poll(timeout):
                raise EngineDeadError("the engine process did not start in time")
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "failed", EngineDeadError(f"the engine process exited ({self._proc.exitcode})")
        if kind != "ready":
            self._proc.join(10)
            raise payload
        self.max_model_len, self.num_kv_blocks = payload["max_model_len"], payload["num_kv_blocks"]

    def _end_child(self) -> None:
        self._proc.terminate()
        self._proc.join(10)

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start reading the engine's messages on the running event loop."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="quanta-engine-reader", daemon=True).start()

    async def stop(self) -> None:
        """Ask the engine process to end, wait for it (then end it), and fail what is still running."""
        self._stopping = True
        try:
            self._conn.send(None)
        except OSError:
            pass
        await asyncio.to_thread(self._proc.join, 10)
        if self._proc.is_alive():
            self._proc.terminate()
            await asyncio.to_thread(self._proc.join, 5)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def healthy(self) -> bool:
        """Whether the engine process runs and has not failed."""
        return self._loop is not None and self.error is None and self._proc.is_alive()

    def gauges(self) -> dict[str, int]:
        """The engine's latest scheduler and pool figures (for /metrics); requests on their way to the
        engine count as waiting, so that a request is never missing from both."""
        return self._gauges | {"waiting": self._gauges["waiting"] + len(self._unacked)}

    # --- requests ---------------------------------------------------------------------------------
    def _running(self, request_id: str) -> bool:
        return request_id in self._streams

    async def _submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                      prompt: str | None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Send the request to the engine process; yield the latest state each time it has news."""
        times = RequestTimes(time.monotonic(), len(prompt_ids))
        stream = self._streams[request_id] = _Stream(prompt, prompt_ids, times)
        self._unacked.add(request_id)
        self._send(("add", request_id, prompt_ids, params, prompt, lora_request))
        while True:
            await stream.ready.wait()
            stream.ready.clear()
            if stream.failure is not None:
                raise stream.failure
            out = stream.snapshot(request_id)      # the state now: it may finish while the consumer holds it
            yield out
            if out.finished:
                return

    def abort(self, request_id: str) -> None:
        """Abort a request (the engine frees its blocks before its next step); no-op once it has finished."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.stats.on_finish(stream.times, "abort", time.monotonic())
            self._send(("abort", request_id))

    def _send(self, command: tuple) -> None:
        """Queue a command; one message carries every command of this pass of the event loop."""
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)

    def _flush(self) -> None:
        batch, self._outbox = self._outbox, []
        if batch and self.error is None:
            try:
                self._conn.send(batch)
            except OSError as e:
                self._died(f"the engine process is gone: {e!r}")

    # --- the engine's messages --------------------------------------------------------------------
    def _read(self) -> None:
        """The reader thread: each message to the event loop, in order, until the pipe ends. Its reads block:
        an event loop such as uvloop puts a watched descriptor in non-blocking mode, where a message larger
        than the pipe's buffer would be read in part."""
        try:
            while True:
                self._call(self._on_message, self._conn.recv())
        except (EOFError, OSError) as e:
            if not self._stopping:
                self._call(self._died, f"the engine process exited ({self._proc.exitcode}): {e!r}")

    def _call(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:                               # the loop is closed: nobody is left to tell
            pass

    def _on_message(self, msg: tuple) -> None:
        if self.error is not None:
            return
        if msg[0] == "step":
            self._apply(*msg[1:])
        else:
            self._died(f"the engine failed: {msg[1]}")

    def _apply(self, updates: list[tuple], rejects: list[tuple], added: list[str], gauges: dict) -> None:
        now = time.monotonic()
        self._gauges = gauges
        self._unacked.difference_update(added)
        refused = {rid for rid, _ in rejects}
        self.stats.prompt_tokens += sum(len(self._streams[rid].prompt_ids) for rid in added
                                        if rid not in refused and rid in self._streams)
        for rid, error in rejects:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.failure = error
                stream.ready.set()
        for rid, finished, error, samples in updates:
            stream = self._streams.get(rid)
            if stream is None:                             # aborted here since
                continue
            self.stats.on_tokens(stream.times, stream.fold(samples), now)
            if finished:
                del self._streams[rid]
                stream.finished = True
                first = stream.samples.get(0)
                self.stats.on_finish(stream.times, (first.finish_reason if first else None) or "abort", now)
                if error is not None:
                    stream.failure = RequestFailedError(f"request {rid} failed: {error}")
            stream.ready.set()

    def _died(self, message: str) -> None:
        log.error("%s", message)
        if self.error is None:
            self.error = EngineDeadError(message)
        self._fail_all(self.error)

    def _fail_all(self, error: BaseException) -> None:
        self._gauges = self._gauges | {"running": 0, "waiting": 0}
        for stream in self._streams.values():
            stream.failure = error
            stream.ready.set()
        self._streams.clear()
        self._unacked.clear()
