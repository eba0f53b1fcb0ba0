"""Batch-invariant attention over the paged KV cache on the CPU (the engine's CPU path).

A query row's output must not depend on what else runs in its step; `attend` says why torch's SDPA alone does
not promise that, and how each row is computed so that it holds.

    q                [T, Hq, D]      the step's queries, sequences back to back (paged_attention's layout)
    k_cache, v_cache [num_blocks, block_size, Hk, D]   model dtype, or uint8 fp8 codes
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quanta.kernels.paged_kv import Fp8Format, dequantize

# Rows x keys of one call: a prefill's rows repeat their sequence's keys once each (expand), so a long
# prefill over a long context is split into calls of fewer rows.
MAX_ROW_KEYS = 1 << 16


@dataclass(frozen=True)
class RowGroup:
    """Rows [start, stop) of the step's queries, over their sequence's slots; `mask` [rows, 1, 1, slots]
    says which each row sees."""
    start: int
    stop: int
    mask: torch.Tensor


@dataclass(frozen=True)
class SeqPlan:
    """One sequence of the step: the flat cache slots of its blocks, its cached tokens, its row groups."""
    slots: torch.Tensor
    length: int
    groups: tuple[RowGroup, ...]


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
         sliding_window: int | None = None) -> list[SeqPlan]:
    """The step's row groups and gather slots, made once and shared by every layer."""
    tables, lens, starts = block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist()
    device = block_tables.device
    out = []
    for b, length in enumerate(lens):
        start, stop = starts[b], starts[b + 1]
        if stop == start or length == 0:                   # no queries, or a padding row (attends nothing)
            continue
        blocks = -(-length // block_size)
        table = torch.tensor(tables[b][:blocks], dtype=torch.int64, device=device)
        slots = (table[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)
        keys, first = blocks * block_size, length - (stop - start)      # first: the first row's position
        pos = torch.arange(first, length, device=device)[:, None]
        key = torch.arange(keys, device=device)[None, :]
        mask = key <= pos
        if sliding_window is not None:
            mask &= key > pos - sliding_window
        rows = max(1, MAX_ROW_KEYS // keys)
        groups = [RowGroup(start + r, min(stop, start + r + rows), mask[r:r + rows, None, None, :])
                  for r in range(0, stop - start, rows)]
        out.append(SeqPlan(slots, length, tuple(groups)))
    return out


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqPlan], scale: float,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           fmt: Fp8Format | None = None) -> torch.Tensor:
    """Attention of the step's queries [T, Hq, D] over the cache (the step's K/V stored), in float32,
    returned in q's dtype (0 for padding rows).

    A query row's output must not depend on what else runs in its step: whether it is a decode, a row
    of a whole prefill or of a prefill chunk, a token recomputed after a preemption, or a prompt whose
    first blocks came from the prefix cache. torch's SDPA on the CPU gives no such promise: it sums a
    row's scores and values in an order that depends on how many query rows the call holds and how many
    keys it sees, so a decoded token and the same token inside a prefill differ in their last bits, and
    greedy decoding flips at near ties downstream.

    So every query row, at position t of its sequence, is one q_len-1 entry of an SDPA over its
    sequence's whole blocks, the keys past t (or outside a sliding window) masked. An entry's result then
    depends on its own query and the keys [0, t] alone: not on how many entries share the call, nor on how
    many masked keys follow t (how far the sequence has got in this step) -- the masked keys add exact
    zeros, in the kernel's fixed order (tests/test_batch_invariance.py checks both). A sequence's rows run
    as one call, an entry each, split only when rows x keys would grow large."""
    out = torch.zeros_like(q)
    for seq in seqs:
        k = _gather(k_cache, seq, k_scale, fmt)
        v = _gather(v_cache, seq, v_scale, fmt)
        for g in seq.groups:
            rows = g.stop - g.start
            o = F.scaled_dot_product_attention(
                q[g.start:g.stop].float().unsqueeze(2), k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1),
                attn_mask=g.mask, scale=scale, enable_gqa=True)
            out[g.start:g.stop] = o[:, :, 0].to(q.dtype)
    return out


def _gather(cache: torch.Tensor, seq: SeqPlan, scale, fmt: Fp8Format | None) -> torch.Tensor:
    """The sequence's whole blocks as [1, Hk, slots, D] float32, zero past its cached tokens: zeroed after the
    gather, so a stale or never-written slot (the cache is allocated uninitialized) cannot bring a NaN into a
    masked product."""
    x = cache.reshape(-1, *cache.shape[2:]).index_select(0, seq.slots)
    x = dequantize(x, scale, fmt) if fmt is not None else x.float()
    x[seq.length:] = 0
    return x.transpose(0, 1).unsqueeze(0)
