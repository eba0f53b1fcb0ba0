"""ProcessEngine (the server's engine, an EngineCore in a process of its own) and core_process' wire:
greedy outputs of concurrent, staggered and aborted requests equal each request run alone offline (prefix
caching on, chunked prefill, a pool small enough to preempt), a lagging consumer gets several steps'
tokens at once, aborts free every block, a refused request fails alone, and a dead engine process fails
the requests in flight and the health check."""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from quanta.engine import LLM, SamplingParams
from quanta.engine.config import EngineConfig
from quanta.engine.drivers.core_process import delta_of
from quanta.engine.outputs import CompletionOutput, Logprob, RequestOutput
from quanta.engine.drivers.process_engine import ProcessEngine, _Stream
from quanta.engine.drivers.stats import RequestTimes

MODEL = "synthetic:tiny"
FLAGS = dict(device="cpu", dtype="float32", max_model_len=256, block_size=16, quiet=True)


def _requests(seed: int = 0, count: int = 12):
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 70)]
    out = []
    for i in range(count):
        base = rng.choice(bases)
        prompt = base[:rng.randrange(len(base) // 2, len(base) + 1)] + [rng.randrange(3, 500) for _ in range(rng.randrange(0, 20))]
        out.append((f"r{i}", prompt, rng.randrange(4, 16)))
    return out


@pytest.fixture(scope="module")
def alone():
    """Greedy token ids of each request run by itself offline, without prefix caching (the oracle)."""
    llm = LLM(model=MODEL, enable_prefix_caching=False, **FLAGS)
    result = {}
    for rid, prompt, m in _requests():
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                           use_tqdm=False)
        result[rid] = list(out[0].outputs[0].token_ids)
    llm.close()
    return result


def _engine(**kw) -> ProcessEngine:
    return ProcessEngine(EngineConfig.from_kwargs(MODEL, **(FLAGS | kw)), timeout=300)


async def _collect(engine, rid, prompt, m, lag: float = 0.0, stop_after: int | None = None):
    outs = []
    async for out in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), rid):
        outs.append(out)
        if stop_after is not None and len(outs) >= stop_after:
            break                                  # leaving the generator aborts the request
        await asyncio.sleep(lag)
    return outs


def test_staggered_requests_with_prefix_caching_equal_each_alone(alone):
    """The server's engine with prefix caching on, requests joining a running batch at staggered times
    (some while another's shared prompt blocks are still being prefilled in chunks), some aborted midway,
    a pool small enough to preempt: every request that ran to its end equals its run alone."""
    engine = _engine(enable_prefix_caching=True, num_kv_blocks=24, max_num_batched_tokens=32,
                     schedule_conservativeness=0)
    work = _requests()

    async def main():
        await engine.start()
        try:
            tasks = {}
            for i, (rid, prompt, m) in enumerate(work):
                tasks[rid] = asyncio.create_task(_collect(engine, rid, prompt, m, stop_after=2 if i % 5 == 3 else None))
                await asyncio.sleep(0.01 * (i % 3))
            results = {rid: await t for rid, t in tasks.items()}
            for _ in range(200):                    # the aborts' blocks come back with the next message
                if engine.gauges()["free_blocks"] == engine.gauges()["total_blocks"]:
                    break
                await asyncio.sleep(0.05)
            return results, engine.gauges()
        finally:
            await engine.stop()

    results, gauges = asyncio.run(main())
    finished = {rid: outs[-1] for rid, outs in results.items() if outs[-1].finished}
    assert len(finished) >= len(work) - 3
    for rid, out in finished.items():
        assert list(out.outputs[0].token_ids) == alone[rid], rid
    assert gauges["free_blocks"] == gauges["total_blocks"] and gauges["running"] == gauges["waiting"] == 0
    assert engine.stats.finished.get("abort", 0) == len(work) - len(finished)


def test_lagging_consumer_gets_several_tokens_at_once_and_a_refused_request_fails_alone(alone):
    engine = _engine()
    rid, prompt, m = _requests()[0]

    async def main():
        await engine.start()
        try:
            slow = asyncio.create_task(_collect(engine, rid, prompt, m, lag=0.3))
            with pytest.raises(Exception, match="max_model_len|room"):
                await _collect(engine, "long", [5] * 300, 4)
            return await slow
        finally:
            await engine.stop()

    outs = asyncio.run(main())
    assert outs[-1].finished and list(outs[-1].outputs[0].token_ids) == alone[rid]
    assert len(outs) < m                                    # fewer outputs than tokens: they were coalesced
    counts = [len(o.outputs[0].token_ids) for o in outs]
    assert counts == sorted(counts) and engine.stats.generation_tokens == m
    assert engine.stats.prompt_tokens == len(prompt)                 # the refused one not counted


def test_engine_process_death_fails_requests_and_health():
    """The engine process killed mid-request: the request fails naming the engine, and health goes false. The
    request is long (2,000 tokens) so that it is still running when the kill comes, however fast the CPU path."""
    engine = _engine(max_model_len=2048)

    async def main():
        await engine.start()
        assert engine.healthy
        task = asyncio.create_task(_collect(engine, "x", [7] * 20, 2000))
        await asyncio.sleep(0.2)
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine"):
            await asyncio.wait_for(task, 60)
        assert not engine.healthy
        await engine.stop()

    asyncio.run(main())


def test_delta_rebuilds_text_tokens_and_logprobs():
    """What the engine process sends per step folds back into the same outputs on the server's side,
    including a text that is cut back at the end (a stop string removed) rather than extended."""
    sent: dict = {}
    stream = _Stream(None, [1, 2], RequestTimes(0.0, 2))
    states = [("Hel", [5], None, False), ("Hello wo", [5, 6, 7], None, False), ("Hello", [5, 6, 7, 8], "stop", True)]
    for text, ids, reason, finished in states:
        lps = [{t: Logprob(-0.5, 1, None)} for t in ids]
        out = RequestOutput("q", None, [1, 2], [CompletionOutput(0, text, list(ids), -1.0, lps, reason)], finished)
        before = len(stream.samples[0].token_ids) if stream.samples else 0
        rid, fin, error, samples = delta_of(out, sent)
        assert stream.fold(samples) == len(ids) - before
        snap = stream.snapshot("q").outputs[0]
        assert (snap.text, snap.token_ids, len(snap.logprobs), snap.finish_reason) == (text, ids, len(ids), reason)
    assert sent == {}                                       # a finished request is forgotten


def test_writer_sends_the_steps_queued_behind_a_slow_send_as_one():
    import queue
    import threading

    from quanta.engine.drivers.core_process import _write
    sent, sending, release = [], threading.Event(), threading.Event()

    class SlowPipe:                                    # the parent busy serving: the first send waits
        def send(self, msg):
            sent.append(msg)
            sending.set()
            release.wait(5)

    outbox = queue.SimpleQueue()
    writer = threading.Thread(target=_write, args=(SlowPipe(), outbox))
    writer.start()
    outbox.put(("step", [("a", False, None, [1])], [], ["a"], {"running": 1}))
    assert sending.wait(5)
    outbox.put(("step", [("a", False, None, [2])], [("b", "refused")], ["b"], {"running": 1}))
    outbox.put(("step", [("a", True, None, [3])], [], [], {"running": 0}))
    outbox.put(("dead", "boom"))
    outbox.put(None)
    release.set()
    writer.join(5)
    assert sent == [("step", [("a", False, None, [1])], [], ["a"], {"running": 1}),
                    ("step", [("a", False, None, [2]), ("a", True, None, [3])], [("b", "refused")], ["b"],
                     {"running": 0}),
                    ("dead", "boom")]


def test_steps_larger_than_the_pipe_buffer_arrive_whole_under_uvloop():
    # uvicorn runs on uvloop where installed, and uvloop puts a descriptor it watches in non-blocking mode: a step
    # message over the pipe's 64 KiB, read there, came in part (BlockingIOError) and the server took the engine for
    # dead. A stalled event loop makes the engine's queued steps go as one large message.
    uvloop = pytest.importorskip("uvloop")
    engine = _engine(num_kv_blocks=128, max_num_seqs=32)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, logprobs=20)

    async def one(i: int):
        outs = [out async for out in engine.generate([3 + i, 7, 9, 11], params, f"big{i}")]
        return outs[-1]

    async def main():
        await engine.start()
        try:
            tasks = [asyncio.create_task(one(i)) for i in range(32)]
            await asyncio.sleep(0.05)
            import time
            time.sleep(3)                               # the loop stalls: the engine's steps queue up behind it
            return await asyncio.gather(*tasks)
        finally:
            await engine.stop()

    finals = uvloop.run(main())
    assert engine.error is None
    assert [len(f.outputs[0].token_ids) for f in finals] == [100] * 32
    assert all(len(f.outputs[0].logprobs) == 100 for f in finals)
