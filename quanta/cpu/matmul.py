"""Batch-invariant F.linear on the CPU: a row's result does not depend on how many rows come with it.

`linear` holds every call to a row count from one fixed range per dtype (ROWS), and `refine_top` recomputes in
float32 the few logits of a 16-bit lm_head that can be a row's largest; each docstring says why. The engine's
other CPU GEMMs, torch's packed int4 / int8 kernels, are row-invariant as they stand
(tests/test_batch_invariance.py checks all of them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = {torch.float32: (16, 16), torch.bfloat16: (2, 32), torch.float16: (2, 32)}
REFINE_PIECE = 4096         # candidates recomputed per pass (a flat row makes every token one)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] on the CPU, each call over a row count from ROWS.

    torch's CPU matmul picks its kernel by the row count M, and the kernels sum over K in different orders:
    MKL's float32 GEMM has a GEMV for one row and other kernels for small and large M; oneDNN's 16-bit GEMM
    keeps one order from 2 to 32 rows, changes kernel above 32 rows, and at one row for some shapes. Within one
    kernel a row's result depends on that row alone. So every call here holds a row count from one fixed range
    per dtype, ROWS[dtype] = (lo, hi): longer inputs are cut into pieces of hi rows, a piece shorter than lo is
    padded with zero rows. float32 runs in tiles of exactly 16 rows; bfloat16 and float16 in pieces of 2 to 32
    rows, which leaves a decode step's few rows (and its memory-bound weight read) as they were."""
    lo, hi = ROWS.get(x.dtype, (1, 1 << 62))
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m == 0 or lo <= m <= hi:
        return F.linear(x, weight, bias)
    pieces = []
    for start in range(0, m, hi):
        piece = rows[start:start + hi]
        n = piece.shape[0]
        if n < lo:
            piece = torch.cat([piece, piece.new_zeros(lo - n, piece.shape[1])])
        pieces.append(F.linear(piece, weight, bias)[:n])
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def column_max(weight: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """max |weight| over each column [K] in float32, read a slice of rows at a time (no copy of the whole
    weight's absolute values)."""
    out = torch.zeros(weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        out = torch.maximum(out, weight[start:start + rows].abs().amax(0).float())
    return out


def refine_top(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, colmax: torch.Tensor) -> torch.Tensor:
    """logits [M, V] (float32 holding F.linear(x.to(weight.dtype), weight) for a 16-bit weight [V, K]) with
    every entry that could be its row's largest, computed from float32 x [M, K], recomputed so, in place.
    `colmax` [K]: column_max(weight). The 16-bit result differs from the float32 one by at most
    u * (sum_k |x_k| colmax_k + |y|) (u the unit roundoff: x rounded on input, y on output, accumulation
    in float32); entries within twice that (with u doubled) of the row's maximum are recomputed. Each
    row's work depends on that row alone (elementwise products, sums over K).

    It serves a 16-bit lm_head under float32 activations (the CPU default): its logits are rounded to 16 bits,
    where near the top exact ties are common (bfloat16 steps of 0.0625-0.25 at logits of 8-64), and greedy
    decoding would then pick by token id. The few tokens that can be a row's largest are recomputed in float32,
    so greedy picks and top-k see float32 logits."""
    eps = torch.finfo(weight.dtype).eps                  # twice the unit roundoff
    bound = eps * ((x.abs() * colmax).sum(-1) + logits.abs().amax(-1))
    return _recompute(logits, x, logits >= (logits.amax(-1) - 2 * bound)[:, None],
                      lambda rows, xs: (weight[rows].float() * xs).sum(-1))


def refine_top_rows(logits: torch.Tensor, x: torch.Tensor, products, row_norms: torch.Tensor, eps: float,
                    roundings: int) -> torch.Tensor:
    """refine_top for an lm_head whose rows are not a plain 16-bit weight: `products(ids, xs)` gives
    sum_k W[ids[i], k] xs[i, k] in float32 from the weight's exact values; `eps` is twice the unit roundoff of the
    dtype its product ran in, whose terms carry `roundings` roundings of that unit. Each entry gets its own bound,
    eps * (roundings / 2 * ||x|| ||W_v|| + |y_v|), since sum_k |x_k| |W_vk| <= ||x|| ||W_v|| (Cauchy-Schwarz;
    `row_norms` [V] the rows' 2-norms): an entry is recomputed where its value plus its bound reaches the largest
    value less its bound."""
    bound = eps * (roundings / 2 * x.norm(dim=-1, keepdim=True) * row_norms + logits.abs())
    return _recompute(logits, x, logits + bound >= (logits - bound).amax(-1, keepdim=True), products)


def _recompute(logits: torch.Tensor, x: torch.Tensor, keep: torch.Tensor, products) -> torch.Tensor:
    """logits with the entries where `keep` holds set to products(their columns, their rows of x), in place."""
    rows, cols = torch.nonzero(keep, as_tuple=True)
    for i in range(0, rows.numel(), REFINE_PIECE):
        r, c = rows[i:i + REFINE_PIECE], cols[i:i + REFINE_PIECE]
        logits[r, c] = products(c, x[r])
    return logits
