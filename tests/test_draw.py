"""The one-read temperature draw (kernels/draw.py) under the interpreter: its tokens follow softmax(logits / T) by a
chi-square test against torch's softmax, at two temperatures in one launch; -inf entries are never drawn; a small
temperature gives torch's argmax across chunk edges; the same seed repeats its tokens and another seed does not.
With -m gpu: a full vocabulary in the real chunks, and the engine's sampler drawing through it."""
from __future__ import annotations

import pytest
import torch

from kernel_util import DEVICE  # noqa: I001
from quanta.kernels import draw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def use_chunks(monkeypatch, chunk: int, block: int) -> None:
    """Programs of `chunk` entries in blocks of `block` (the interpreter runs a program at a time)."""
    monkeypatch.setattr(draw, "CHUNK", chunk)
    monkeypatch.setattr(draw, "BLOCK", block)


def seed_tensor(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=DEVICE)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the token counts against n x probs, over the entries with probability."""
    keep = probs > 0
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_draws_follow_the_tempered_softmax(monkeypatch):
    use_chunks(monkeypatch, 8, 8)                            # a row a program, in one step
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5, -2.0, 1.5])
    rows = 600
    temps = torch.tensor([1.0] * rows + [0.5] * rows)
    tokens = draw.temperature_draw(logits.repeat(2 * rows, 1).to(DEVICE), temps.to(DEVICE), seed_tensor(123)).cpu()
    for half, t in ((tokens[:rows], 1.0), (tokens[rows:], 0.5)):
        probs = torch.softmax(logits.double() / t, -1)
        assert not (half == 4).any()                        # the -inf entry
        # 7 categories (6 degrees of freedom): the 0.999 quantile of chi-square(6) is 22.46
        assert chi_square(half, probs) < 22.46
    # the two temperatures differ where it shows: T = 0.5 draws entry 2 far more often
    assert (tokens[rows:] == 2).float().mean() - (tokens[:rows] == 2).float().mean() > 0.15


def test_small_temperature_is_argmax_across_chunks(monkeypatch):
    use_chunks(monkeypatch, 8, 4)
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    x[1, 7], x[2, 49], x[3, 16] = 9.0, 9.0, 9.0            # a chunk's first, the row's last, a chunk edge
    tokens = draw.temperature_draw(x.to(DEVICE), torch.full((6,), 1e-4, device=DEVICE), seed_tensor(5))
    assert torch.equal(tokens.cpu(), x.argmax(-1))


def test_same_seed_same_tokens_other_seed_others(monkeypatch):
    use_chunks(monkeypatch, 16, 16)
    x = torch.zeros(32, 16, device=DEVICE)                   # uniform rows: every token as likely
    seed = seed_tensor(77)
    ones = torch.ones(32, device=DEVICE)
    first = draw.temperature_draw(x, ones, seed).cpu()
    assert torch.equal(first, draw.temperature_draw(x, ones, seed).cpu())
    other = draw.temperature_draw(x, ones, seed + 1).cpu()
    assert (first != other).float().mean() > 0.5
    assert len(set(first.tolist())) > 8                      # rows of one launch draw apart


@pytest.mark.gpu
def test_full_vocabulary_draw_on_gpu():
    """4,096 rows of a 128,256-entry vocabulary whose mass sits on 8 entries spread over the chunks (one the last)."""
    spots = torch.tensor([0, 4095, 4096, 40_000, 77_777, 100_000, 128_000, 128_255])
    logits = torch.full((128_256,), -40.0)
    logits[spots] = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, -2.0, 1.5, 0.25])
    rows = 4096
    tokens = draw.temperature_draw(logits.repeat(rows, 1).cuda(), torch.full((rows,), 0.8, device="cuda"),
                                   seed_tensor(9)).cpu()
    assert torch.isin(tokens, spots).all()
    probs = torch.softmax(logits.double() / 0.8, -1)[spots]
    assert chi_square(torch.searchsorted(spots, tokens), probs / probs.sum()) < 24.32   # chi-square(7), 0.999


@pytest.mark.gpu
def test_engine_sampler_draws_through_the_kernel_on_gpu(monkeypatch):
    """sample_batch on the GPU draws its plain rows through the kernel: a greedy row stays argmax beside them, the
    sampled rows follow softmax(x / T) by chi-square."""
    from quanta.engine import sampler
    from quanta.engine.sampling_params import SamplingParams
    monkeypatch.setattr(sampler, "GPU_DRAW_KERNEL", True)
    drawn = []
    real = draw.temperature_draw
    monkeypatch.setattr(draw, "temperature_draw", lambda *args: drawn.append(1) or real(*args))
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf"), 0.5, -2.0, 1.5]).repeat(2000, 1)
    params = [SamplingParams(temperature=0.0)] + [SamplingParams(temperature=0.9)] * 1999
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = sampler.sample_batch(logits.cuda(), params, [None] * 2000, [([], [])] * 2000, g).cpu()
    assert drawn and tokens[0] == 2
    probs = torch.softmax(logits[0].double() / 0.9, -1)
    assert chi_square(tokens[1:], probs) < 22.46
