"""Fault isolation in the engine (CPU, tiny random llama): a request whose own logits processor or text
decoding raises, or that is aborted while a step is in flight, fails (or stops) alone; every other
request's greedy tokens equal those of the same request run alone (the oracle), and every KV block
returns to the pool. A pool far smaller than the batch preempts instead of failing."""
from __future__ import annotations

import asyncio

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine.drivers.async_engine import AsyncEngine
from quanta.engine.requests import RequestFailedError
from quanta.quant.errors import ConfigError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_hf
    path = tmp_path_factory.mktemp("faults") / "llama"
    make_tiny_hf("llama", path)
    return str(path)


def engine(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "num_kv_blocks": 64,
          "enable_prefix_caching": False} | kw
    return LLM(model=path, **kw)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def alone(tiny):
    """Each prompt of prompts(16) run by itself: the oracle for every batch below."""
    llm = engine(tiny)
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts(16)]


def run(llm: LLM, params: list[SamplingParams], ids: list[list[int]], between=None) -> dict[str, object]:
    """Drive step() by hand; -> {request id: final RequestOutput}. `between(llm, step_number)` runs
    between steps."""
    rids = [llm.add_request((None, p), sp) for p, sp in zip(ids, params)]
    finals, n = {}, 0
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                finals[out.request_id] = out
        n += 1
        if between is not None:
            between(llm, n)
    return {rid: finals.get(rid) for rid in rids}


def assert_pool_empty(llm: LLM):
    assert llm.pool.num_free == llm.pool.num_blocks
    assert all(b.ref_count == 0 for b in llm.pool.blocks)
    assert not llm.has_unfinished() and not llm.requests


def failing_after(k: int, exc=ValueError("processor bug")):
    def processor(output_ids, logits):
        if len(output_ids) >= k:
            raise exc
        return logits
    return processor


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_raising_logits_processor_fails_its_request_alone(tiny, alone, async_scheduling):
    llm = engine(tiny, async_scheduling=async_scheduling)
    ids = prompts(16)[:6]
    bad = {1: SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logits_processors=[failing_after(3)]),
           4: SamplingParams(n=2, max_tokens=10, temperature=0.8, seed=5, ignore_eos=True,
                             logits_processors=[failing_after(0)])}
    outs = list(run(llm, [bad.get(i, GREEDY) for i in range(6)], ids).values())
    for i, out in enumerate(outs):
        if i in bad:
            assert [c.finish_reason for c in out.outputs] == ["error"] * bad[i].n
            assert "ValueError: processor bug" in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == alone[i]
    assert len(outs[1].outputs[0].token_ids) == 3          # the tokens before the failure stay
    assert_pool_empty(llm)
    # the engine goes on serving
    assert llm.generate([{"prompt_token_ids": ids[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[0]


def test_a_logits_processor_shapes_the_output(tiny):
    """Hand-computed oracle: a processor that leaves only token 7 makes every output token 7, and it sees
    the output so far at each call."""
    seen = []

    def only_seven(output_ids, logits):
        seen.append(list(output_ids))
        out = torch.full_like(logits, float("-inf"))
        out[7] = 0.0
        return out
    llm = engine(tiny)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logits_processors=[only_seven])
    out = llm.generate([{"prompt_token_ids": [5, 6, 9]}], sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7, 7, 7, 7]
    assert seen == [[], [7], [7, 7], [7, 7, 7]]


def test_a_processor_returning_a_wrong_shape_is_that_requests_error(tiny, alone):
    llm = engine(tiny)
    sp = SamplingParams(max_tokens=4, temperature=0.0, logits_processors=[lambda ids, logits: logits[:10]])
    outs = list(run(llm, [GREEDY, sp], prompts(16)[:2]).values())
    assert outs[0].outputs[0].token_ids == alone[0]
    assert outs[1].outputs[0].finish_reason == "error" and "not a logits row of shape" in outs[1].error
    assert_pool_empty(llm)


class PoisonedTokenizer:
    """The real tokenizer, except that decoding any id list holding `poison` raises."""

    def __init__(self, tokenizer, poison: int):
        self._tokenizer, self.poison = tokenizer, poison

    def decode(self, ids, **kw):
        if self.poison in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned token")
        return self._tokenizer.decode(ids, **kw)

    def __call__(self, *a, **kw):
        return self._tokenizer(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def forcing(token: int):
    def processor(output_ids, logits):
        logits[token] = 1e9
        return logits
    return processor


def poison_token(alone) -> int:
    """A token id that no oracle output holds."""
    used = {t for ids in alone for t in ids}
    return next(t for t in range(100, 40000) if t not in used)


@pytest.mark.parametrize("stop", [None, ["zzzz"]])
def test_a_detokenizer_failure_fails_its_request_alone(tiny, alone, stop):
    """stop strings decode incrementally at every token; without them the text is decoded at the end
    (and, streaming, caught up at every step): either failure ends that request only."""
    llm = engine(tiny)
    poison = poison_token(alone)
    llm.core.tokenizer = PoisonedTokenizer(llm.core.tokenizer, poison)
    ids = prompts(16)[:4]
    others = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=stop)
    bad = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=stop,
                         logits_processors=[forcing(poison)])
    outs = list(run(llm, [others, bad, others, others], ids).values())
    assert outs[1].outputs[0].finish_reason == "error" and "poisoned token" in outs[1].error
    for i in (0, 2, 3):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == alone[i]
        assert outs[i].outputs[0].text == llm.core.tokenizer.decode(alone[i], skip_special_tokens=True)
    assert_pool_empty(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_while_a_step_is_in_flight(tiny, alone, async_scheduling):
    """Aborted between steps (with async scheduling, while its next decode is already launched), during
    a chunked prefill, and from inside a running step (another request's logits processor): the aborted
    requests end "abort", the rest are unchanged."""
    llm = engine(tiny, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    ids = prompts(16)[:6]
    rids: list[str] = []

    def abort_inside(output_ids, logits):
        if len(output_ids) == 2:
            llm.abort(rids[5])
        return logits
    params = [GREEDY] * 4 + [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                            logits_processors=[abort_inside]), GREEDY]

    def between(llm, n):
        if n == 1:
            llm.abort(rids[3])                      # still prefilling: 16-token budget per step
        if n == 6:
            llm.abort(rids[1])
    rids += [str(i) for i in range(len(ids))]
    outs = list(run(llm, params, ids, between).values())
    for i in (1, 3, 5):
        assert outs[i] is None or outs[i].outputs[0].finish_reason == "abort"
    for i in (0, 2, 4):
        assert outs[i].outputs[0].token_ids == alone[i]
    assert_pool_empty(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_many_requests_on_a_pool_of_one_sequence(tiny, alone, async_scheduling):
    """16 requests (one with n=3) on 8 blocks of 16 tokens, just over what one max_model_len (128)
    sequence needs: preemption and recomputation, never a failure, and every output as run alone."""
    llm = engine(tiny, num_kv_blocks=8, async_scheduling=async_scheduling, schedule_conservativeness=0)
    ids = prompts(16)
    params = [GREEDY] * 16
    params[7] = SamplingParams(n=3, max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = list(run(llm, params, ids).values())
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all(c.token_ids == alone[7] for c in outs[7].outputs)
    assert llm.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_bad_prompt_ids_and_seed_are_refused_before_a_step(tiny):
    llm = engine(tiny)
    vocab = llm.core.checkpoint.config.vocab_size
    for bad in ([1, vocab], [-1], [1.5], ["a"]):
        with pytest.raises(ConfigError, match=r"token ids must be integers in \[0, "):
            llm.add_request((None, bad), GREEDY)
    with pytest.raises(ConfigError, match="seed"):
        SamplingParams(seed=2**64)
    assert not llm.has_unfinished()


def test_async_engine_raises_for_the_failed_request_only(tiny, alone):
    """The server's driver: the failing request's generator raises RequestFailedError (the server's 500
    body or stream error event); the others finish with the oracle's tokens and the loop stays healthy."""
    llm = engine(tiny)
    ids = prompts(16)[:3]
    bad = SamplingParams(max_tokens=10, temperature=0.0, logits_processors=[failing_after(2, KeyError("k"))])

    async def one(eng, i, sp):
        try:
            async for out in eng.generate(ids[i], sp, f"r{i}"):
                last = out
            return last.outputs[0].token_ids
        except RequestFailedError as e:
            return e

    async def main():
        eng = AsyncEngine(llm.core)
        await eng.start()
        try:
            results = await asyncio.gather(*(one(eng, i, bad if i == 1 else GREEDY) for i in range(3)))
            return results, eng.healthy
        finally:
            await eng.stop()
    results, healthy = asyncio.run(main())
    assert healthy
    assert isinstance(results[1], RequestFailedError) and "KeyError" in str(results[1])
    assert results[0] == alone[0] and results[2] == alone[2]
    assert_pool_empty(llm)
