"""The temperature draw of a batch of logits rows in one read of them: token = argmax_j (x_j / T - log E_j) with
E_j ~ Exp(1) independent, which is j with probability softmax(x / T)_j (the exponential race argmax_j p_j / E_j,
taken in logs, so no softmax, noise or quotient tensor is ever formed). The noise is Philox (tl.rand), keyed by a
seed the caller draws on the device from its generator, plus the row: nothing passes through the host, and the
same seed and logits give the same tokens. A program takes CHUNK entries of one row and writes their best (score,
index); an argmax over a row's chunks picks the token (the first best), so a large vocabulary spreads over many
programs at any batch size.
"""
from __future__ import annotations

import torch

from quanta.kernels.triton_support import cdiv, tl, triton

NAME = "triton_temperature_draw"
CHUNK = 4096            # entries of a row a program scores
BLOCK = 1024            # of them, at once


def reference_probabilities(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """What each row's token is drawn from: softmax(logits / T) [B, V] (the oracle of the draw's statistics)."""
    return (logits.double() / temperatures.double()[:, None]).softmax(-1)


@triton.jit
def _draw_kernel(
    # pointers
    x_ptr, temp_ptr, seed_ptr, score_ptr, index_ptr,
    # sizes
    V, n_chunks,
    # strides (rows)
    stride_x,
    # meta
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (row, chunk): the best x / T + Gumbel noise of CHUNK entries, and where it is."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    key = tl.load(seed_ptr) + row
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK,), tl.int32)
    for i in tl.static_range(CHUNK // BLOCK):
        offs = chunk * CHUNK + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(key, offs)                              # [0, 1): u = 0 scores -inf, never drawn
        score = x / temperature - tl.log(-tl.log(u))        # - log E with E = -log u ~ Exp(1)
        better = score > best                               # strict: a lane keeps its first best
        best = tl.where(better, score, best)
        where = tl.where(better, offs, where)
    top = tl.max(best, axis=0)
    tl.store(score_ptr + row * n_chunks + chunk, top)
    tl.store(index_ptr + row * n_chunks + chunk, tl.min(tl.where(best == top, where, V), axis=0))


def temperature_draw(logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device) drawn from softmax(logits / T) for float logits [B, V],
    temperatures [B] (> 0) and seed: a one-element integer tensor on the device, below 2**31 - B."""
    b, v = logits.shape
    assert logits.stride(1) == 1 and temperatures.shape == (b,) and seed.numel() == 1
    n_chunks = cdiv(v, CHUNK)
    scores = torch.empty(b, n_chunks, device=logits.device, dtype=torch.float32)
    index = torch.empty(b, n_chunks, device=logits.device, dtype=torch.int32)
    _draw_kernel[(b, n_chunks)](logits, temperatures.float(), seed.int(), scores, index, v, n_chunks,
                                logits.stride(0), CHUNK=CHUNK, BLOCK=BLOCK, num_warps=4)
    return index.gather(1, scores.argmax(-1, keepdim=True)).squeeze(1).long()
