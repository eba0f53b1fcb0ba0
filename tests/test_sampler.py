"""Sampler filters against transformers' own logits processors, SamplingParams validation, and
the statistics of the draw."""
from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as lp

from quanta.engine.sampler import apply_penalties, filter_logits, sample_row, top_logprobs
from quanta.engine.sampling_params import SamplingParams
from quanta.quant.errors import ConfigError

V = 257


def finite_mask(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kw,oracle", [
    ({"top_k": 10}, lambda: lp.TopKLogitsWarper(10)),
    ({"top_p": 0.8}, lambda: lp.TopPLogitsWarper(0.8)),
    ({"top_p": 0.05}, lambda: lp.TopPLogitsWarper(0.05)),
    ({"min_p": 0.1}, lambda: lp.MinPLogitsWarper(0.1)),
])
def test_filters_keep_the_same_tokens_as_transformers(seed, kw, oracle):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3
    ours = filter_logits(logits.clone(), SamplingParams(temperature=1.0, **kw))
    theirs = oracle()(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
    assert torch.equal(finite_mask(ours), finite_mask(theirs))
    assert torch.allclose(ours[finite_mask(ours)], theirs[finite_mask(theirs)])


def test_temperature_matches_transformers():
    logits = torch.randn(V)
    ours = filter_logits(logits.clone(), SamplingParams(temperature=0.7))
    theirs = lp.TemperatureLogitsWarper(0.7)(None, logits[None].clone())[0]
    assert torch.allclose(ours, theirs)


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(V)
    prompt, output = [1, 5, 9], [9, 17, 200]
    ours = apply_penalties(logits.clone(), prompt, output, SamplingParams(repetition_penalty=1.3))
    theirs = lp.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[None].clone())[0]
    assert torch.allclose(ours, theirs)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.zeros(V)
    out = apply_penalties(logits, [4], [7, 7, 7, 8], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert out[7].item() == pytest.approx(-(0.5 + 3 * 0.25))
    assert out[8].item() == pytest.approx(-(0.5 + 0.25))
    assert out[4].item() == 0.0          # prompt tokens are not penalized by presence/frequency


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(V)
    assert sample_row(logits, SamplingParams(temperature=0), None) == int(logits.argmax())
    g = torch.Generator().manual_seed(0)
    assert all(sample_row(logits, SamplingParams(temperature=1.5, top_k=1), g) == int(logits.argmax())
               for _ in range(20))


def test_draw_follows_the_softmax_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample_row(logits, SamplingParams(), g) for _ in range(4000)]),
                            minlength=4).float() / 4000
    assert torch.allclose(counts, logits.softmax(-1), atol=0.03)


def test_seeded_draws_repeat():
    logits = torch.randn(V)
    draw = lambda: [sample_row(logits, SamplingParams(), g) for g in [torch.Generator().manual_seed(7)] for _ in range(10)]
    assert draw() == draw()


def test_logprobs_rank_and_top():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    chosen, top = top_logprobs(logits, 2, 2)
    assert chosen == pytest.approx(logits.log_softmax(-1)[2].item())
    assert top[2][1] == 2 and top[1][1] == 1 and set(top) == {1, 2}


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"n": 0},
                                {"max_tokens": 0}, {"min_p": 2}, {"repetition_penalty": 0}, {"stop": [""]},
                                {"presence_penalty": 3}])
def test_invalid_sampling_params_raise(kw):
    with pytest.raises(ConfigError, match="SamplingParams"):
        SamplingParams(**kw)


@pytest.mark.parametrize("vocab", [128256, 32000, 50257, 512])          # 50257 is prime: the plain argmax
def test_argmax_rows_is_torch_argmax_ties_included(vocab):
    from quanta.engine.sampler import argmax_rows
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=g)
    x[1, 7] = x[1, vocab - 3] = x[1].max() + 1                # a tie in different chunks: the first wins
    x[2] = 0.0                                                # every entry ties
    x[3, -1] = 100.0                                          # the last entry
    x[4] = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    if torch.cuda.is_available():                             # CUDA's reductions pick among ties too
        assert torch.equal(argmax_rows(x.cuda()).cpu(), x.argmax(-1))


def test_sample_batch_mixes_greedy_drawn_and_seeded_rows():
    """A batch of a greedy row, plain drawn rows and a row with its own generator: the greedy row is argmax, the
    seeded row repeats its generator's draw, and an all-drawn batch follows the softmax."""
    from quanta.engine.sampler import sample_batch
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0)]
    seeded = lambda: torch.Generator().manual_seed(3)
    tokens = sample_batch(logits.repeat(3, 1), params, [None, None, seeded()], [([], [])] * 3,
                          torch.Generator().manual_seed(0))
    assert tokens[0] == 2 and 0 <= tokens[1] < 4
    assert tokens[2] == sample_row(logits.clone(), params[2], seeded())
    rows = 4000
    drawn = sample_batch(logits.repeat(rows, 1), [SamplingParams(temperature=1.0)] * rows, [None] * rows,
                         [([], [])] * rows, torch.Generator().manual_seed(1))
    assert torch.allclose(torch.bincount(drawn, minlength=4).float() / rows, logits.softmax(-1), atol=0.03)
