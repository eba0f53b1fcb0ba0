"""IQ4_NL and IQ4_XS quantizers: float32 blocks -> ggml blocks, as ggml-quants.c's quantize_row_iq4_nl_impl.

Both round each group of 32 onto the 16 non-uniform IQ4_NL levels (kvalues_iq4nl) times a scale, searched over
15 trial scales by weighted least squares (weights x^2, or the imatrix's qw * sqrt(sigma2 + x^2)). IQ4_NL keeps
the group's scale as fp16; IQ4_XS stores 6-bit scales of 8 groups under one fp16 super-block scale and rounds the
groups again on them. Every float operation follows the C expression's order; sums run in index order (seq_sum).
"""
from __future__ import annotations

import functools

import torch

from quanta.quant.ggml.kquantize import f16_bytes, pack
from quanta.quant.ggml.qsearch import (GROUP_MAX_EPS, first_absmax, inverse, nearest_int, rdiv, seq_sum,
                                      sqrtf)

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
NTRY = 7


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """By floor(v) + 128 for floor(v) in [-128, 127]: the level below or at v, the level above, the latter's index.
    The levels are integers, so the two levels around v depend on floor(v) alone."""
    values = torch.tensor(KVALUES, dtype=torch.float32)
    floor = torch.arange(-128, 128, dtype=torch.float32)
    above = (values.view(1, -1) <= floor.view(-1, 1)).sum(1).clamp(1, len(KVALUES) - 1)
    return values[above - 1].to(device), values[above].to(device), above.to(device)


def nearest_level(v: torch.Tensor, index: bool = False) -> torch.Tensor:
    """ggml best_index_int8 over the IQ4_NL levels: the nearest level to v (the lower one only when strictly
    nearer; below the lowest or above the highest, that level; for NaN the highest), or with `index` its index."""
    lo_of, hi_of, above_of = _tables(v.device)
    v = torch.where(v.isnan(), float(KVALUES[-1]), v)     # a group whose weights are all 0 has a NaN scale: as ggml
    k = v.floor().clamp_(-128, 127).add_(128).long()
    lo, hi = lo_of.take(k), hi_of.take(k)
    lower = (v - lo) < (hi - v)
    return above_of.take(k) - lower.long() if index else torch.where(lower, lo, hi)


def _group_scales(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The per-group scale search of quantize_row_iq4_nl_impl: x, w [G, 32] -> d [G] (0 for empty groups)."""
    mx = first_absmax(x, 1)
    empty = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(empty, 1.0, mx)

    def sums(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = nearest_level(iscale.unsqueeze(-1) * x)
        wq = w * q
        return seq_sum((wq * x).reshape(-1, x.shape[1])).view(iscale.shape), \
            seq_sum((wq * q).reshape(-1, x.shape[1])).view(iscale.shape)

    d = -mx / float(KVALUES[0])
    sumqx, sumq2 = sums(1 / d)
    d = sumqx / sumq2
    best = d * sumqx
    trials = torch.stack([rdiv(float(i + KVALUES[0]), mx) for i in range(-NTRY, NTRY + 1)])      # [T, G]
    tsx, tsq2 = sums(trials)
    for t in range(len(trials)):
        better = (tsq2[t] > 0) & (tsx[t] * tsx[t] > best * tsq2[t])
        d = torch.where(better, tsx[t] / torch.where(better, tsq2[t], 1.0), d)
        best = torch.where(better, d * tsx[t], best)
    return torch.where(empty, 0.0, d)


def _weights(x: torch.Tensor, qw: torch.Tensor | None, super_block: int) -> torch.Tensor:
    if qw is None:
        return x * x
    sigma2 = seq_sum(x * x) * (2.0 / super_block)
    return qw * sqrtf(sigma2.unsqueeze(1) + x * x)


def iq4_nl(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """IQ4_NL: blocks of 32, an fp16 scale and 16 bytes of 4-bit level indices."""
    d = _group_scales(x, _weights(x, qw, 32))
    L = nearest_level(inverse(d).unsqueeze(1) * x, index=True)
    return torch.cat([f16_bytes(d), pack(L, 4, 16)], dim=1)       # of each 32: j low, j + 16 high


def iq4_xs(x: torch.Tensor, qw: torch.Tensor | None = None) -> torch.Tensor:
    """IQ4_XS: super-blocks of 256, an fp16 scale, eight 6-bit group scales (scales_h, scales_l) and 128 bytes."""
    nb = x.shape[0]
    w = _weights(x, qw, 256)
    scales = _group_scales(x.reshape(-1, 32), w.reshape(-1, 32)).view(nb, 8)
    # a group whose weights are all 0 has a NaN scale: the C's `if (fabsf(d) > amax)` passes over it, and its 6-bit
    # scale comes out 0, as for a scale of 0
    scales = torch.where(scales.isnan(), 0.0, scales)
    d = -first_absmax(scales, 1) / 32
    ls = nearest_int(inverse(d).unsqueeze(1) * scales).clamp(-32, 31)
    dl = d.unsqueeze(1) * ls.float()
    L = nearest_level(inverse(dl).unsqueeze(2) * x.view(nb, 8, 32), index=True).view(nb, 256)
    ls = ls + 32
    # scales_h: a little-endian u16 of the eight high 2-bit parts; scales_l: the low nibbles, two a byte
    return torch.cat([f16_bytes(d), pack(ls >> 4, 2, 1), pack(ls & 0xF, 4, 1), pack(L, 4, 16)], dim=1)
