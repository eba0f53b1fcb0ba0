"""Seeded sampling with n > 1: each sample draws from a generator of its own, seeded from (seed, sample index),
so a request's samples are the same whether it ran alone or beside others, with or without preemption, and
sample 0 equals the n = 1 output of the same seed. Before, the samples drew from sample 0's generator in
the order the schedule ran them, so preemption changed the text."""
from __future__ import annotations

import pytest
import torch

from quanta.engine import LLM, SamplingParams
from quanta.engine.requests import sample_seed

TINY = "synthetic:tiny"


def _samples(outs) -> list[list[list[int]]]:
    return [[s.token_ids for s in o.outputs] for o in outs]


def _prompts(count: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=g).tolist()}
            for n in torch.randint(20, 40, (count,), generator=g)]


def test_sample_seeds_are_distinct_and_the_first_is_the_seed():
    assert sample_seed(1234, 0) == 1234
    seeds = {sample_seed(s, i) for s in (0, 1, -5, 2**64 - 1) for i in range(1, 64)}
    assert len(seeds) == 4 * 63 and all(0 <= x < 2**64 for x in seeds)


def test_seeded_n2_equal_with_and_without_preemption():
    params = [SamplingParams(n=2, seed=100 + i, temperature=1.0, max_tokens=24, ignore_eos=True) for i in range(4)]
    prompts = _prompts(4)
    flags = dict(device="cpu", dtype="float32", max_model_len=96, quiet=True, enable_prefix_caching=False)
    with LLM(TINY, **flags) as llm:
        alone = [_samples(llm.generate(p, q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    with LLM(TINY, num_kv_blocks=8, schedule_conservativeness=0, **flags) as llm:
        together = _samples(llm.generate(prompts, params, use_tqdm=False))
        assert llm.scheduler.num_preemptions > 0
    assert together == alone
    assert all(a != b for a, b in alone)                  # the two samples differ


def test_sample_zero_of_n2_is_the_n1_output():
    prompt = _prompts(1)[0]
    with LLM(TINY, device="cpu", dtype="float32", max_model_len=96, quiet=True) as llm:
        one = llm.generate(prompt, SamplingParams(seed=7, temperature=1.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
        two = llm.generate(prompt, SamplingParams(n=2, seed=7, temperature=1.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0].outputs
    assert two[0].token_ids == one and two[1].token_ids != one


def test_default_model_seeded_n2_under_a_small_pool(default_model_path):
    """The issue's reproduction: max_model_len=256 with 16 KV blocks against the default pool."""
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(n=2, seed=11, temperature=0.9, max_tokens=48, ignore_eos=True)
    with LLM(str(default_model_path), device="cpu", max_model_len=256, quiet=True) as llm:
        want = _samples(llm.generate(prompts, params, use_tqdm=False))
    with LLM(str(default_model_path), device="cpu", max_model_len=256, num_kv_blocks=16, quiet=True,
             schedule_conservativeness=0) as llm:
        got = _samples(llm.generate(prompts, params, use_tqdm=False))
        assert llm.scheduler.num_preemptions > 0
    assert got == want
