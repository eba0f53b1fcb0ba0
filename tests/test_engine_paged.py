"""The paged continuous-batching engine on the CPU: batching, chunked prefill, preemption, prefix
caching, n > 1 forks and abort leave outputs unchanged and every block back in the pool."""
from __future__ import annotations

import contextlib

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine.config import EngineConfig
from quanta.engine.core import EngineCore
from quanta.quant.errors import ConfigError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = (3, 16, 17, 40, 1, 33)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_hf
    path = tmp_path_factory.mktemp("paged") / "llama"
    make_tiny_hf("llama", path)
    return str(path)


def engine(path, triton_ops: bool | None = None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "num_kv_blocks": 128} | kw
    if triton_ops is None:
        return LLM(model=path, **kw)
    return LLM.from_core(EngineCore(EngineConfig.from_kwargs(path, **kw), triton_ops=triton_ops))


def prompts(lengths=LENGTHS, offset=0):
    g = torch.Generator().manual_seed(offset)
    return [{"prompt_token_ids": torch.randint(3, 40000, (n,), generator=g).tolist()} for n in lengths]


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_pool_empty(llm: LLM):
    assert llm.pool.num_free == llm.pool.num_blocks
    assert all(b.ref_count == 0 for b in llm.pool.blocks)
    assert not llm.has_unfinished() and not llm.requests


@pytest.fixture(scope="module")
def alone(tiny):
    llm = engine(tiny, enable_prefix_caching=False)
    return [tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts()]


def test_batch_equals_each_request_alone(tiny, alone):
    llm = engine(tiny)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == alone
    assert_pool_empty(llm)


def test_token_budget_and_chunked_prefill(tiny, alone):
    llm = engine(tiny, max_num_batched_tokens=16, max_num_seqs=3)
    seen = []
    schedule = llm.scheduler.schedule

    def recording():
        batch = schedule()
        seen.append((sum(it.num_tokens for it in batch), len(batch)))
        return batch
    llm.scheduler.schedule = recording
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == alone
    assert max(t for t, _ in seen) == 16 and all(t <= 16 and n <= 3 for t, n in seen)
    assert_pool_empty(llm)


def test_long_prefill_interleaves_with_a_new_request_and_its_decodes(tiny):
    """A 4-token request added while a 200-token prompt is prefilled in chunks of a 32-token budget is in
    the very next step, beside a chunk of half the budget; afterwards its decodes run in every step beside
    the long prompt's chunks, which take the rest of the budget."""
    llm = engine(tiny, max_num_batched_tokens=32)
    long, short = prompts([200, 4])
    steps = []
    schedule = llm.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append([it.num_tokens for it in batch])
        return batch
    llm.scheduler.schedule = recording
    llm.add_request(long, GREEDY)
    llm.step()
    llm.add_request(short, GREEDY)
    while llm.has_unfinished():
        llm.step()
    assert steps[:4] == [[32], [16, 4], [31, 1], [31, 1]]
    assert all(sum(s) <= 32 for s in steps)
    assert_pool_empty(llm)


def test_cpu_steps_default_to_a_small_token_budget(tiny):
    """On the CPU a step holds CPU_BATCHED_TOKENS tokens unless asked otherwise (the GPU's default is larger)."""
    from quanta.engine.config import CPU_BATCHED_TOKENS
    from quanta.planner.request import GPU_BATCHED_TOKENS
    assert EngineConfig(model=tiny, device="cpu").max_num_batched_tokens == CPU_BATCHED_TOKENS < GPU_BATCHED_TOKENS
    assert EngineConfig(model=tiny, device="cpu", max_num_batched_tokens=4096).max_num_batched_tokens == 4096


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_under_memory_pressure_keeps_outputs(tiny, alone, async_scheduling):
    # 8 blocks of 16 tokens for six sequences growing to 13..52 tokens (13 blocks): forces recompute; with
    # async scheduling no step is launched ahead that would need a preemption
    llm = engine(tiny, num_kv_blocks=8, max_model_len=64, enable_prefix_caching=False,
                 async_scheduling=async_scheduling, schedule_conservativeness=0)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == alone
    assert llm.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_admission_keeps_room_for_growth_so_nothing_is_preempted(tiny, alone):
    """The pool of the test above, with admission keeping room for what each running sequence will still write
    (they run to max_tokens: ignore_eos): fewer run at once, none is preempted, the outputs are as run alone."""
    llm = engine(tiny, num_kv_blocks=8, max_model_len=64, enable_prefix_caching=False)
    assert tokens(llm.generate(prompts(), GREEDY, use_tqdm=False)) == alone
    assert llm.scheduler.num_preemptions == 0
    assert_pool_empty(llm)


def test_growth_reserve_counts_certain_tokens_whole_and_others_by_a_decaying_ratio():
    """A sample only its length can end reserves all its remaining blocks; one EOS can end, GROWTH_INIT of them,
    falling to GROWTH_MIN as steps pass without a preemption; schedule_conservativeness scales both, 0 none."""
    from quanta.engine import scheduler as sched_mod
    from quanta.engine.block_pool import BlockPool
    from quanta.engine.sequence import Sequence

    def seq(**kw):       # 20 prompt tokens, up to 40 more (max_len 60): blocks of 16 for 20 tokens 2, for 60 4
        return Sequence("r", 0, list(range(3, 23)), SamplingParams(max_tokens=40, **kw), max_len=60)

    s = sched_mod.Scheduler(BlockPool(100, 16, False), 8, 64)
    assert s.growth_blocks(seq(ignore_eos=True)) == 2                      # 60 tokens: 4 blocks, 2 held
    assert s.growth_blocks(seq()) == 1                                     # 20 + ceil(0.7 x 40) = 48: 3 blocks
    assert s.growth_blocks(seq(ignore_eos=True, stop=["x"])) == 1          # a stop string can end it early
    for _ in range(round((sched_mod.GROWTH_INIT - sched_mod.GROWTH_MIN) / sched_mod.GROWTH_DECAY) + 1):
        s.schedule()
    assert s.growth_ratio == pytest.approx(sched_mod.GROWTH_MIN)
    assert s.growth_blocks(seq()) == 0                                     # 20 + 4 tokens: still 2 blocks
    assert sched_mod.Scheduler(BlockPool(100, 16, False), 8, 64, conservativeness=2).growth_blocks(
        seq(ignore_eos=True)) == 5                                          # 20 + 80 tokens: 7 blocks
    assert sched_mod.Scheduler(BlockPool(100, 16, False), 8, 64, conservativeness=0).growth_blocks(
        seq(ignore_eos=True)) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefix_cache_hits_reuse_blocks_and_keep_outputs(tiny, async_scheduling):
    shared = prompts([40])[0]["prompt_token_ids"]
    family = [{"prompt_token_ids": shared + tail} for tail in ([7], [8, 9], [10] * 20)]
    reference = tokens(engine(tiny, enable_prefix_caching=False).generate(family, GREEDY, use_tqdm=False))
    llm = engine(tiny, async_scheduling=async_scheduling)
    first = tokens(llm.generate(family[:1], GREEDY, use_tqdm=False))
    assert llm.pool.prefix_hits == 0
    rest = tokens(llm.generate(family[1:], GREEDY, use_tqdm=False))
    assert first + rest == reference
    assert llm.pool.prefix_hits == 2 * (40 // 16)     # each later prompt reuses the 2 full shared blocks
    assert_pool_empty(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_n_samples_fork_and_share_prompt_blocks(tiny, async_scheduling):
    llm = engine(tiny, async_scheduling=async_scheduling)
    prompt = prompts([37])[0]
    rid = llm.add_request(prompt, SamplingParams(n=3, max_tokens=6, temperature=0.0, ignore_eos=True))
    llm.step()                                      # prefill of sample 0, then the fork
    req = llm.requests[rid]
    assert len(req.seqs) == 3
    shared = set(req.seqs[0].block_table[:2])
    assert all(set(s.block_table[:2]) == shared for s in req.seqs)
    assert all(llm.pool.blocks[b].ref_count == 3 for b in shared)
    outs = []
    while llm.has_unfinished():
        outs += [o for o in llm.step() if o.finished]
    samples = [c.token_ids for c in outs[0].outputs]
    assert samples[0] == samples[1] == samples[2] == tokens(llm.generate(prompt, SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False))[0][0]
    seeded = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    assert tokens(llm.generate(prompt, seeded, use_tqdm=False)) == tokens(llm.generate(prompt, seeded, use_tqdm=False))
    assert_pool_empty(llm)


def test_abort_frees_blocks(tiny):
    llm = engine(tiny)
    keep = llm.add_request(prompts([20])[0], GREEDY)
    drop = llm.add_request(prompts([30])[0], SamplingParams(n=2, max_tokens=50, ignore_eos=True))
    llm.step()
    llm.step()
    assert llm.pool.num_free < llm.pool.num_blocks
    out = llm.abort(drop)
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    while llm.has_unfinished():
        llm.step()
    assert keep not in llm.requests
    assert_pool_empty(llm)


def test_fp8_kv_cache_engine_close_to_model_dtype(tiny):
    ids = prompts([45])[0]["prompt_token_ids"]
    ref = engine(tiny).prompt_logits(ids)
    # e4m3 with calibrated scales; e5m2 (2 mantissa bits, scale 1) is coarser on this random model.
    for kv, agree_min, err_max in (("fp8", 0.9, 0.05), ("fp8_e5m2", 0.75, 0.1)):
        llm = engine(tiny, kv_cache_dtype=kv)
        assert llm.kv_cache.kv.dtype == torch.uint8
        got = llm.prompt_logits(ids)
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert agree >= agree_min and err < err_max, (kv, agree, err)
        out = llm.generate(prompts([5, 40]), GREEDY, use_tqdm=False)
        assert all(len(c.token_ids) == 12 for o in out for c in o.outputs)
        assert_pool_empty(llm)


def test_pool_size_vs_max_model_len_is_checked(tiny):
    with pytest.raises(ConfigError, match="max_model_len"):
        engine(tiny, num_kv_blocks=4, max_model_len=128)


def test_synthetic_model_without_tokenizer():
    llm = LLM(model="synthetic:tiny:w4g32", device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128)
    out = llm.generate([[1, 2, 3], [4] * 20], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12] and out[0].outputs[0].text == ""
    with pytest.raises(Exception, match="tokenizer"):
        llm.generate("text needs a tokenizer", GREEDY, use_tqdm=False)
    assert_pool_empty(llm)


def test_engine_on_triton_kernels_under_interpreter(tiny, alone):
    """The GPU code path run by the interpreter on the CPU gives the reference path's greedy outputs: the
    Triton KV store, decode and prefill kernels (decodes-first ordering, chunked prefill) and the fused
    residual+RMSNorm, rotary(+store) and SiLU-and-mul kernels, fed by the merged q/k/v and gate/up GEMMs'
    strided outputs."""
    if torch.cuda.is_available():
        pytest.skip("covered by the GPU tests")
    llm = engine(tiny, triton_ops=True, max_num_batched_tokens=24)
    assert any(k["name"].endswith("q_proj+k_proj+v_proj") for k in llm.kernels())
    switched = [m for m in llm.model.modules() if hasattr(m, "triton")] + [llm.kv_cache]
    assert len(switched) > 4 and all(m.triton for m in switched)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = tokens(llm.generate(prompts()[:4], params, use_tqdm=False))
    assert got == [[a[0][:4]] for a in alone[:4]]
    assert_pool_empty(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_replay_inputs_on_cpu(tiny, alone, monkeypatch, async_scheduling):
    """The CUDA-graph decode path's static inputs (two packed buffers, padding rows, bucket views), run on
    the CPU: capture is stubbed and a 'replay' runs the model eagerly on the static buffers, so the tokens
    agree with eager decoding only if every step's inputs were laid out as the graph reads them (with
    async scheduling, input ids written on the device from the previous step's samples)."""
    class FakeGraph:
        def replay(self):
            raise AssertionError("replaced below")

        def pool(self):
            return None

    events = []

    class FakeEvent:                     # the step's input copies: recorded, then waited for by the next step
        def record(self):
            events.append("record")

        def synchronize(self):
            events.append("synchronize")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    llm = engine(tiny, max_num_seqs=5, async_scheduling=async_scheduling)  # buckets 1, 2, 4, 5: padding rows
    runner = llm.runner
    runner.capture_graphs()
    replays = []
    for b, (graph, fb) in runner.graphs.items():
        def replay(b=b, fb=fb):
            replays.append(b)
            assert torch.equal(fb.seq_lens == 0, fb.slot_mapping < 0)     # padding rows store and attend nothing
            runner.static_out[:b] = runner.model(runner.static_ids[:b], runner.static_pos[:b], fb)
        graph.replay = replay
    lengths = [12 - 2 * i for i in range(len(alone))]       # requests finish one by one: n < bucket happens
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    assert tokens(llm.generate(prompts(), params, use_tqdm=False)) == [[a[0][:m]] for a, m in zip(alone, lengths)]
    assert {1, 2, 4, 5} <= set(replays)
    assert events == ["synchronize", "record"] * len(replays)     # no step refills buffers still being copied
    assert_pool_empty(llm)


def launches_ahead(llm: LLM) -> list[int]:
    """Records the size of every step the runner launches ahead of the previous step's tokens."""
    sizes, launch = [], llm.runner.launch

    def spy(batch, after=None):
        if after is not None:
            sizes.append(len(batch))
        return launch(batch, after=after)
    llm.runner.launch = spy
    return sizes


def test_async_scheduling_gives_the_synchronous_outputs(tiny, alone):
    """Steps launched before the previous tokens are known: sequences ending by stop token (their extra
    token dropped), by max_tokens (never launched ahead), EOS-free ones, and a request arriving mid-way
    (no step ahead while it waits) give the synchronous loop's tokens; every block comes back."""
    stop_at = [a[0][4] for a in alone]
    params = [SamplingParams(max_tokens=12 - i, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop_at[i]] if i % 2 else []) for i in range(len(alone))]
    sync = engine(tiny, async_scheduling=False).generate(prompts(), params, use_tqdm=False)
    llm = engine(tiny, async_scheduling=True)
    ahead = launches_ahead(llm)
    out = llm.generate(prompts(), params, use_tqdm=False)
    assert tokens(out) == tokens(sync)
    assert [o.outputs[0].finish_reason for o in out] == [o.outputs[0].finish_reason for o in sync]
    assert len(ahead) >= 8 and max(ahead) == len(alone)
    assert_pool_empty(llm)
    # a late request: the steps while it waits are synchronous, then lookahead resumes
    first = llm.add_request(prompts([9])[0], GREEDY)
    for _ in range(3):
        llm.step()
    late = llm.add_request(prompts([5], offset=1)[0], GREEDY)
    done = {}
    while llm.has_unfinished():
        done |= {o.request_id: o for o in llm.step() if o.finished}
    solo = engine(tiny, async_scheduling=False)
    for rid, prompt in ((first, prompts([9])[0]), (late, prompts([5], offset=1)[0])):
        assert tokens([done[rid]]) == tokens(solo.generate(prompt, GREEDY, use_tqdm=False))
    assert_pool_empty(llm)


def test_async_scheduling_abort_while_a_step_is_in_flight(tiny, alone):
    llm = engine(tiny, async_scheduling=True)
    ahead = launches_ahead(llm)
    keep = llm.add_request(prompts()[0], GREEDY)
    drop = llm.add_request(prompts()[1], GREEDY)
    for _ in range(4):
        llm.step()
    assert ahead and llm.core._in_flight is not None     # a step holding `drop` is on its way
    assert llm.abort(drop).finished
    done = {}
    while llm.has_unfinished():
        done |= {o.request_id: o for o in llm.step() if o.finished}
    assert tokens([done[keep]]) == [alone[0]]
    assert_pool_empty(llm)


def test_an_offline_batch_larger_than_the_pool_runs_without_recompute_under_the_reserve():
    """The scheduler alone (no model), as an offline run meets it: 400 requests of 100 + 40 tokens (ignore_eos, 9
    blocks each at the end) on 2,000 blocks, 1,024 sequences allowed in a step. Without the reserve the batch
    outgrows the pool and recomputes preempted prompts; with it nothing is preempted, every token is computed once,
    and the pool still runs at least 200 sequences at once (of the 222 it holds at their full length)."""
    from quanta.engine.block_pool import BlockPool
    from quanta.engine.scheduler import Scheduler
    from quanta.engine.sequence import Sequence

    def run(conservativeness: float) -> tuple[int, int, int]:
        s = Scheduler(BlockPool(2000, 16, False), 1024, 16384, conservativeness=conservativeness)
        for i in range(400):
            s.add(Sequence(f"r{i}", 0, [3 + i % 7] * 100, SamplingParams(max_tokens=40, ignore_eos=True), max_len=140))
        computed, widest = 0, 0
        while s.has_unfinished():
            batch = s.schedule()
            s.update(batch)
            computed += sum(it.num_tokens for it in batch)
            widest = max(widest, len(s.running))
            for it in batch:
                if it.seq.num_computed_tokens == it.seq.num_tokens:        # sampled its next token
                    it.seq.output_ids.append(5)
                    if it.seq.ends_by_length():
                        s.finish(it.seq)
        assert s.pool.num_free == 2000
        return s.num_preemptions, computed, widest

    once = 400 * (100 + 40 - 1)                     # every prompt token and every sampled token but the last
    preempted, computed, _ = run(0)
    assert preempted > 0 and computed > once
    assert run(1) == (0, once, pytest.approx(222, abs=22))


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "1", True])
def test_schedule_conservativeness_is_checked(tiny, value):
    with pytest.raises(ConfigError, match="schedule_conservativeness"):
        EngineConfig(model=tiny, device="cpu", schedule_conservativeness=value)
