"""Batch-invariant attention over the paged KV cache on the CPU in torch, in row blocks: the engine's CPU path where
the native layer_ops cannot run (no C compiler, or activations other than float32).

A query row's output must not depend on what else runs in its step; `attend` says how each row is computed so
that it holds, while a long prompt costs a few matrix products per block of ROWS rows rather than one call per
row.

    q                [T, Hq, D]      the step's queries, sequences back to back (paged_attention's layout)
    k_cache, v_cache [num_blocks, block_size, Hk, D]   model dtype, or uint8 fp8 codes
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quanta.quant.fp8_codes import Fp8Format, dequantize

ROWS = 8                    # positions of a row block: [ROWS * i, ROWS * (i + 1)) of its sequence
KEYS = 256                  # a block's keys end at a multiple of KEYS (and start at one, under a sliding window)


@dataclass(frozen=True)
class RowBlock:
    """Queries [start, stop) of the step, at rows [offset, offset + stop - start) of the aligned block that
    begins at sequence position `first`; the block attends keys [key_start, key_stop)."""
    start: int
    stop: int
    offset: int
    first: int
    key_start: int
    key_stop: int


@dataclass(frozen=True)
class SeqPlan:
    """One sequence of the step: the flat cache slots of its blocks, its cached tokens, its row blocks, and the
    sliding window its rows see (None: every earlier token)."""
    slots: torch.Tensor
    length: int
    blocks: tuple[RowBlock, ...]
    window: int | None = None


def plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, block_size: int,
         sliding_window: int | None = None) -> list[SeqPlan]:
    """The step's row blocks and gather slots, made once and shared by every layer."""
    tables, lens, starts = block_tables.tolist(), seq_lens.tolist(), query_start_loc.tolist()
    device = block_tables.device
    out = []
    for b, length in enumerate(lens):
        start, stop = starts[b], starts[b + 1]
        if stop == start or length == 0:                   # no queries, or a padding row (attends nothing)
            continue
        span = -(-length // KEYS) * KEYS                   # whole tiles, so every block's key span fits
        blocks = -(-span // block_size)
        table = torch.tensor((tables[b] + [0] * blocks)[:blocks], dtype=torch.int64, device=device)
        slots = (table[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)[:span]
        position = length - (stop - start)                 # the first query's position
        rows = []
        while position < length:
            first = position // ROWS * ROWS
            n = min(first + ROWS, length) - position
            key_stop = -(-(first + ROWS) // KEYS) * KEYS
            key_start = 0 if sliding_window is None else max(0, first - sliding_window + 1) // KEYS * KEYS
            row = start + position - (length - (stop - start))
            rows.append(RowBlock(row, row + n, position - first, first, key_start, key_stop))
            position += n
        out.append(SeqPlan(slots, length, tuple(rows), sliding_window))
    return out


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seqs: list[SeqPlan], scale: float,
           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           fmt: Fp8Format | None = None) -> torch.Tensor:
    """Attention of the step's queries [T, Hq, D] over the cache (the step's K/V stored), in float32,
    returned in q's dtype (0 for padding rows).

    A query row's output must not depend on what else runs in its step: whether it is a decode, a row of a
    whole prefill or of a prefill chunk, a token recomputed after a preemption, or a prompt whose first blocks
    came from the prefix cache. torch's matrix products and reductions sum in an order that depends on their
    shapes, and greedy decoding flips at near ties downstream of a last-bit difference. So a row's operations
    are fixed by its position alone:
      - it belongs to the block of ROWS positions aligned at a multiple of ROWS; the block is computed with all
        ROWS rows (those not queried in this step are zeros and are dropped), over keys up to the multiple of
        KEYS at or after the block's end (from a multiple of KEYS, under a sliding window): the block's matrix
        products and softmax have the same shapes in every step;
      - keys the row cannot see get probability exactly 0, and keys not yet written (or past the sequence) are
        zeros, so what sits there cannot change a visible sum.
    A sequence of T tokens costs about T^2 / 2 multiply-adds a head and T / ROWS rounds of four operations."""
    out = torch.zeros_like(q)
    hq, d = q.shape[1], q.shape[2]
    q = q.float() * scale
    for seq in seqs:
        k = _gather(k_cache, seq, k_scale, fmt)            # [Hk, S, D]
        v = _gather(v_cache, seq, v_scale, fmt)
        hk = k.shape[0]
        g = hq // hk
        for block in seq.blocks:
            rows = q.new_zeros(ROWS, hq, d)
            rows[block.offset:block.offset + block.stop - block.start] = q[block.start:block.stop]
            rows = rows.view(ROWS, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * ROWS, d)
            keys = slice(block.key_start, block.key_stop)
            scores = torch.bmm(rows, k[:, keys].transpose(1, 2))         # [Hk, G * ROWS, keys]
            scores.masked_fill_(_hidden(block, seq.window, g), float("-inf"))
            o = torch.bmm(torch.softmax(scores, dim=-1), v[:, keys])
            o = o.view(hk, g, ROWS, d).permute(2, 0, 1, 3).reshape(ROWS, hq, d)
            out[block.start:block.stop] = o[block.offset:block.offset + block.stop - block.start].to(out.dtype)
    return out


def _hidden(block: RowBlock, window: int | None, g: int) -> torch.Tensor:
    """[G * ROWS, keys] True where a row of the block may not look: after its position, or at or before its
    position minus the window (each of the G query heads of a KV head repeats the ROWS rows). Every layer of a
    step asks for the same masks, and a decode's next steps mostly for the same again: they are built once."""
    return _mask(block.first, block.key_start, block.key_stop, window, g)


@functools.lru_cache(maxsize=256)
def _mask(first: int, key_start: int, key_stop: int, window: int | None, g: int) -> torch.Tensor:
    positions = torch.arange(first, first + ROWS).repeat(g)[:, None]
    keys = torch.arange(key_start, key_stop)[None, :]
    hidden = keys > positions
    if window is not None:
        hidden |= keys <= positions - window
    return hidden


def _gather(cache: torch.Tensor, seq: SeqPlan, scale, fmt: Fp8Format | None) -> torch.Tensor:
    """The sequence's slots as [Hk, S, D] float32 (S whole tiles of KEYS), zero past its cached tokens: zeroed
    after the gather, so a stale or never-written slot (the cache is allocated uninitialized) cannot bring a
    NaN into a product."""
    x = cache.reshape(-1, *cache.shape[2:]).index_select(0, seq.slots)
    x = dequantize(x, scale, fmt) if fmt is not None else x.float()
    x[seq.length:] = 0
    return x.transpose(0, 1).contiguous()
