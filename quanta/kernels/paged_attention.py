"""Attention over the paged KV cache: decode (flash-decoding split over KV) and (chunked) prefill.

    q                [T, Hq, D]      the step's queries, sequences back to back
    k_cache, v_cache [num_blocks, block_size, Hk, D]   model dtype, or uint8 fp8 codes (paged_kv.py)
    block_tables     [B, max_blocks] int32   the blocks of each sequence, in order
    seq_lens         [B] int32       tokens cached for each sequence, this step's included (0: padding)
    query_start_loc  [B + 1] int32   prefill only: sequence b owns queries qsl[b]:qsl[b+1]
    k_scale, v_scale [Hk] float32    fp8 only (per-tensor scales are repeated over the heads)
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from quanta.kernels.paged_kv import (
    Fp8Format,
    fp8_bits_to_f16_pattern,
    fp8_read_constexprs,
    head_scale,
)
from quanta.kernels.device_caps import device_caps
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait, zeroed_scratch
from quanta.quant.fp8_codes import dequantize


def _gather(cache, table, length, scale, fmt: Fp8Format | None) -> torch.Tensor:
    blocks = table[: -(-length // cache.shape[1])].long()
    x = cache[blocks].reshape(-1, *cache.shape[2:])[:length]
    return dequantize(x, scale, fmt) if fmt is not None else x.float()


def reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
              sliding_window: int | None = None, k_scale=None, v_scale=None,
              fmt: Fp8Format | None = None) -> torch.Tensor:
    """The oracle and CPU path: per sequence, gather its K/V, float32 masked softmax attention.

    Queries of sequence b sit at the last positions seq_lens[b] - qlen ... seq_lens[b] - 1: they see
    every earlier cached token and are causal among themselves, within an optional sliding window.
    GQA/MQA: query head h reads kv head h // (Hq / Hk). The step's K/V must be stored first."""
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, length in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        if end == start:
            continue
        k = _gather(k_cache, block_tables[b], length, k_scale, fmt).transpose(0, 1)
        v = _gather(v_cache, block_tables[b], length, v_scale, fmt).transpose(0, 1)
        mask = None
        if end - start > 1 or sliding_window is not None:     # one last-position query sees every key
            pos = torch.arange(length - (end - start), length, device=q.device)
            keys = torch.arange(length, device=q.device)
            mask = keys[None, :] <= pos[:, None]
            if sliding_window is not None:
                mask &= keys[None, :] > pos[:, None] - sliding_window
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1).float(), k, v, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


@triton.jit
def _load_tile(cache_ptr, block_table_ptr, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
               BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr, FP8_UP_SHIFT: tl.constexpr,
               OUT_DTYPE: tl.constexpr):
    """K or V rows at positions offs_n [N] of one sequence -> [N, BLOCK_D] in OUT_DTYPE. fp8 codes come
    out as value / scale (FP8_HW: the sm89+ conversion instruction) or as value / (scale * 2^(15 - bias))
    (the code's bits moved into an fp16), exactly either way: the caller multiplies the scores or the
    output by the rest of the factor once (_fp8_factor) instead of every element."""
    block = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = block * stride_block + (offs_n % BLOCK_SIZE) * stride_slot
    ptrs = cache_ptr + rows[:, None] + d[None, :]
    x = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0)
    if FP8_HW:
        x = x.to(tl.float8e4nv if FP8 == 1 else tl.float8e5, bitcast=True)
        if OUT_DTYPE == tl.bfloat16:          # through fp16 (exact for both formats): fp8 -> bf16 is not
            x = x.to(tl.float16)              # a conversion every Triton version lowers
    elif FP8 != 0:
        x = fp8_bits_to_f16_pattern(x, FP8_UP_SHIFT)
    return x.to(OUT_DTYPE)


@triton.jit
def _fp8_factor(scale_ptr, kv_head, FP8: tl.constexpr, FP8_UP_MUL: tl.constexpr):
    """What _load_tile's values are multiplied by to be the cached K or V: scale * FP8_UP_MUL; 1 unquantized."""
    return head_scale(scale_ptr, kv_head, True, FP8) * FP8_UP_MUL


@triton.jit
def _fold(s, m_new, m_safe, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One step of the online softmax: scores s [ROWS, N] (their new row max m_new, m_safe its finite stand-in)
    and values v [N, BLOCK_D] folded into (max, sum, unnormalized output)."""
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _online_softmax(q, q_pos, lo, hi, k_cache_ptr, v_cache_ptr, table, kv_head, score_scale, d, d_mask,
                    stride_block, stride_slot, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
                    FP8: tl.constexpr, FP8_HW: tl.constexpr, FP8_UP_SHIFT: tl.constexpr, PRECISION: tl.constexpr):
    """The causal online softmax of the query rows q [ROWS, BLOCK_D] (a prefill tile) over the cached keys [lo, hi)
    of one sequence (its block table `table`) and kv head: row r sees the keys up to q_pos[r] (and within WINDOW),
    so a row may see none of a block. Returns (max, sum, unnormalized output) per row, the max -inf and the sum 0
    for a row that saw no key. V is loaded after the scores, so that K's and V's tiles are not live at once."""
    k_base = k_cache_ptr + kv_head * HEAD_DIM
    v_base = v_cache_ptr + kv_head * HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k = _load_tile(k_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                       BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)     # rows with nothing allowed yet
        v = _load_tile(v_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                       BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, q.dtype)
        m_i, l_i, acc = _fold(s, m_new, m_safe, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _load_kv(k_base, v_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr,
             FP8: tl.constexpr, FP8_HW: tl.constexpr, FP8_UP_SHIFT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """K's and V's rows at positions offs_n (_load_tile's), V's loads issued with K's."""
    k = _load_tile(k_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                   BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, OUT_DTYPE)
    v = _load_tile(v_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                   BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, OUT_DTYPE)
    return k, v


@triton.jit
def _split_softmax(q, lo, hi, k_cache_ptr, v_cache_ptr, table, kv_head, score_scale, d, d_mask, stride_block,
                   stride_slot, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr,
                   FP8_UP_SHIFT: tl.constexpr, PRECISION: tl.constexpr, PREFETCH: tl.constexpr):
    """The online softmax of a decode split: q [ROWS, BLOCK_D] over every key of [lo, hi), as _online_softmax returns
    it; V's loads in flight while the scores are computed. PREFETCH: step i + 1's K and V are loaded (block table,
    then rows) before step i's arithmetic, so that a split of several steps waits on one chain of dependent loads,
    not one a step, for a second pair of tiles in registers."""
    k_base = k_cache_ptr + kv_head * HEAD_DIM
    v_base = v_cache_ptr + kv_head * HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offs_n = lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    if PREFETCH:
        k, v = _load_kv(k_base, v_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                        BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, q.dtype)
    for _ in range(lo, hi, BLOCK_N):
        next_n = offs_n + BLOCK_N
        next_mask = next_n < hi            # past the split's end: masked, no memory read
        if PREFETCH:
            k_next, v_next = _load_kv(k_base, v_base, table, next_n, next_mask, d, d_mask, stride_block,
                                      stride_slot, BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, q.dtype)
        else:
            k, v = _load_kv(k_base, v_base, table, offs_n, n_mask, d, d_mask, stride_block, stride_slot,
                            BLOCK_SIZE, FP8, FP8_HW, FP8_UP_SHIFT, q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_i, l_i, acc = _fold(s, m_new, m_new, v, m_i, l_i, acc, PRECISION)
        if PREFETCH:
            k, v = k_next, v_next
        offs_n, n_mask = next_n, next_mask
    return m_i, l_i, acc


@triton.jit
def _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, b, kv_head, n_active, num_q_heads, d, d_mask, stride_ot,
                  stride_oh, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """out[b, the kv head's GROUP query heads] from the n_active splits' normalized partials and log-sum-exps
    (out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max)).

    MERGE_CHUNK splits a step, unrolled: their loads are independent (one L2 round trip a step, not one a split),
    each split's log-sum-exp and output folded in by an online softmax over the splits, elementwise over [group, d]
    (no reduction across threads); .cg reads the other programs' partials from L2, not from this SM's L1."""
    gm = tl.arange(0, GROUP_P2)
    g_ok = gm < GROUP
    first = (b * num_q_heads + kv_head * GROUP + gm) * NUM_SPLITS
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    res = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for s0 in range(0, n_active, MERGE_CHUNK):
        for i in tl.static_range(MERGE_CHUNK):
            ok = g_ok & (s0 + i < n_active)
            lse_s = tl.load(part_lse_ptr + first + s0 + i, mask=ok, other=float("-inf"),
                            cache_modifier=".cg")
            o = tl.load(part_o_ptr + (first + s0 + i)[:, None] * BLOCK_D + d[None, :],
                        mask=ok[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)   # rows whose splits so far saw no key
            alpha = tl.exp(m - m_safe)
            w = tl.where(ok, tl.exp(lse_s - m_safe), 0.0)
            res = res * alpha[:, None] + o * w[:, None]
            total = total * alpha + w
            m = m_new
    res = res / tl.where(total > 0, total, 1.0)[:, None]
    heads_m = kv_head * GROUP + gm
    tl.store(out_ptr + b * stride_ot + heads_m[:, None] * stride_oh + d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_mask[None, :])


# Arguments that change from one eager step to the next are not specialized on, or Triton compiles a variant
# mid-run per divisibility (found by benchmarks/throughput.py's compile check): stride_bt, the block tables'
# row length, follows the step's longest sequence; the prefill's tables and lengths are slices that start
# after the step's decodes, so their 16-byte alignment follows the number of decodes.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, part_o_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, out_ptr, lock_ptr,
    # sizes / scalars
    sm_scale, num_q_heads,
    # strides (elements)
    stride_qt, stride_qh, stride_bt, stride_block, stride_slot, stride_ot, stride_oh,
    # constexpr meta
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr, FP8: tl.constexpr, FP8_HW: tl.constexpr, FP8_UP_SHIFT: tl.constexpr,
    FP8_UP_MUL: tl.constexpr, PRECISION: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr, PREFETCH: tl.constexpr,
    MERGE_CHUNK: tl.constexpr = 8, PDL: tl.constexpr = False,
):
    """grid (B, Hk, NUM_SPLITS): the GROUP query heads of one kv head over one split of the context.

    Each split that sees keys writes its normalized output and log-sum-exp and counts itself in lock[b, kv
    head]; the last to arrive merges them into out (out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s -
    max)) and resets the count: no second launch per layer. A split takes at least MIN_SPLIT_KEYS keys (a multiple
    of BLOCK_N); a sequence that one split covers writes out directly, with no partial, count or merge.
    GROUP_PAD pads the group for tl.dot (16 rows); the merge works on GROUP_P2 rows."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # --- this split's range of key positions
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_SPLIT_KEYS)
    start = lo + split * per_split
    end = tl.minimum(seq_len, start + per_split)
    # --- the splits that see keys run, and count to their number; split 0 alone for a sequence of none (a
    # CUDA-graph padding row), whose merge writes its zeros. The rest have nothing to read or write.
    n_active = tl.maximum(tl.cdiv(seq_len - lo, tl.maximum(per_split, 1)), 1)
    if split < n_active:
        # --- the group's queries [GROUP_PAD, BLOCK_D]
        g = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        q_mask = (g < GROUP)[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        score_scale = sm_scale * _fp8_factor(k_scale_ptr, kv_head, FP8, FP8_UP_MUL)
        v_factor = _fp8_factor(v_scale_ptr, kv_head, FP8, FP8_UP_MUL)
        # --- online softmax over the split
        m_i, l_i, acc = _split_softmax(q, start, end, k_cache_ptr, v_cache_ptr,
                                       block_tables_ptr + b.to(tl.int64) * stride_bt, kv_head, score_scale, d,
                                       d_mask, stride_block, stride_slot, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_D,
                                       BLOCK_N, FP8, FP8_HW, FP8_UP_SHIFT, PRECISION, PREFETCH)
        safe_l = tl.where(l_i > 0, l_i, 1.0) / v_factor
        if n_active == 1:       # the split saw every key (or none: zeros): its output is the sequence's
            tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # --- normalized partial output and its log-sum-exp (-inf for an empty sequence's split)
            lse = tl.where(l_i > 0, m_i + tl.log(safe_l), float("-inf"))
            row = (b * num_q_heads + heads) * NUM_SPLITS + split
            tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], acc / safe_l[:, None], mask=q_mask)
            tl.store(part_lse_ptr + row, lse, mask=g < GROUP)
            # --- the last split of this (sequence, kv head) merges the splits that saw keys
            lock = lock_ptr + b * tl.num_programs(1) + kv_head
            tl.debug_barrier()                     # every thread's partial is written before the count is released
            if tl.atomic_add(lock, 1, sem="acq_rel") == n_active - 1:
                _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, b, kv_head, n_active, num_q_heads, d, d_mask,
                              stride_ot, stride_oh, GROUP, GROUP_P2, BLOCK_D, NUM_SPLITS, MERGE_CHUNK)
                tl.store(lock, 0)


@triton.jit(do_not_specialize=["stride_bt", "block_tables_ptr", "seq_lens_ptr"])     # see _decode_kernel
def _prefill_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    k_scale_ptr, v_scale_ptr,
    # sizes / scalars
    sm_scale,
    # strides (elements)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_slot,
    # constexpr meta
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    FP8: tl.constexpr, FP8_HW: tl.constexpr, FP8_UP_SHIFT: tl.constexpr, FP8_UP_MUL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """grid (B, cdiv(max_query_len, BLOCK_M), Hq): BLOCK_M queries of one sequence and head."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kv_head = h // GROUP
    # --- the tile's queries and their positions
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = seq_len - q_len + offs_m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    score_scale = sm_scale * _fp8_factor(k_scale_ptr, kv_head, FP8, FP8_UP_MUL)
    v_factor = _fp8_factor(v_scale_ptr, kv_head, FP8, FP8_UP_MUL)
    # --- key range: causal up to the tile's last query, from the window's start; empty tiles skip
    hi = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - q_len + tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.where(tile * BLOCK_M < q_len, hi, lo)
    m_i, l_i, acc = _online_softmax(q, q_pos, lo, hi, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + b.to(tl.int64) * stride_bt, kv_head, score_scale, d, d_mask,
                                    stride_block, stride_slot, BLOCK_M, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N,
                                    WINDOW, FP8, FP8_HW, FP8_UP_SHIFT, PRECISION)
    out = acc / (tl.where(l_i > 0, l_i, 1.0) / v_factor)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _check(q, k_cache, v_cache, fmt):
    assert q.dim() == 3 and q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
    assert (fmt is None) == (k_cache.dtype != torch.uint8)


# A decode program: keys a step (a split takes whole steps) and warps. Split over a sequence's keys (small batches),
# its time is one program's chain of dependent loads, barriers and the merge, not the bytes it reads: 8 warps split
# a step's work into shorter chains a thread; 16 lose more to the barriers than they save, and 32 keys a step double
# the steps. Unsplit (a batch that fills the GPU by itself) the programs are many and 4 warps keep more of them
# resident.
DECODE_BLOCK_N = 64
DECODE_WARPS = 8
DECODE_WARPS_UNSPLIT = 4
# The fewest keys a split takes (a multiple of DECODE_BLOCK_N). Fewer splits a sequence trade the merge (partials
# written, counted and read back through L2) for more steps in one program, each a block-table load and the K / V
# loads that wait on it; a sequence that one split covers writes its output with no merge.
DECODE_MIN_SPLIT_KEYS = 64
# Whether a split loads its next step's K and V before this step's arithmetic (_split_softmax): the loads of a
# split's first step are then issued ahead of its loop, which the batch-1 decode's chain of kernels gains from
# even where each split is one step. The unsplit launch of large batches (DECODE_PREFETCH_UNSPLIT) runs in
# DECODE_WARPS_UNSPLIT warps, whose registers would hold the second pair of K / V tiles at half the threads: off
# until its offline throughput is timed with it.
DECODE_PREFETCH = True
DECODE_PREFETCH_UNSPLIT = False


def default_num_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int | None = None) -> int:
    """Enough (batch, kv head, split) programs to fill the GPU twice over, at most one per `block_n` keys (default
    DECODE_BLOCK_N, read at the call as decode() reads it, so that a patched setting moves both)."""
    return _num_splits(batch, num_kv_heads, max_len, block_n or DECODE_BLOCK_N)


@functools.lru_cache(maxsize=None)
def _num_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int) -> int:
    sms = device_caps("cuda").sm_count if torch.cuda.is_available() else 64
    want = -(-2 * sms // max(1, batch * num_kv_heads))
    return max(1, min(want, 32, -(-max_len // block_n)))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: float32 models get true fp32 products ("ieee"), not TF32's 10-bit
    mantissa (a 1e-3 relative error); 16-bit inputs are exact on the tensor cores either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float, *, sliding_window: int | None = None,
           k_scale=None, v_scale=None, fmt: Fp8Format | None = None, num_splits: int = 8,
           out: torch.Tensor | None = None, block_n: int | None = None,
           min_split_keys: int | None = None) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] -> [B, Hq, D]. `num_splits` is fixed per launch (and
    so per CUDA graph); each sequence divides its own context over the splits, each split at least
    `min_split_keys` keys (default DECODE_MIN_SPLIT_KEYS). `block_n`: keys a step of a split (default
    DECODE_BLOCK_N)."""
    block_n = block_n or DECODE_BLOCK_N
    min_split_keys = min_split_keys or DECODE_MIN_SPLIT_KEYS
    min_split_keys = -(-min_split_keys // block_n) * block_n
    _check(q, k_cache, v_cache, fmt)
    bsz, hq, d = q.shape
    hk, block_size = k_cache.shape[2], k_cache.shape[1]
    group = hq // hk
    block_d = triton.next_power_of_2(d)
    out = torch.empty_like(q) if out is None else out
    part_o = torch.empty(bsz, hq, num_splits, block_d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(bsz, hq, num_splits, device=q.device, dtype=torch.float32)
    dummy = k_scale if k_scale is not None else seq_lens
    split = num_splits > 1                  # the split launch's settings, else the unsplit launch's (large batches)
    _decode_kernel[(bsz, hk, num_splits)](
        q, k_cache, v_cache, part_o, part_lse, block_tables, seq_lens, dummy,
        v_scale if v_scale is not None else dummy, out, split_counts(q.device, bsz * hk), scale, hq,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), GROUP_P2=triton.next_power_of_2(group),
        BLOCK_SIZE=block_size, HEAD_DIM=d,
        BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=num_splits, WINDOW=sliding_window or 0,
        **fp8_read_constexprs(fmt, q.device),
        PRECISION=dot_precision(q.dtype), MIN_SPLIT_KEYS=min_split_keys,
        PREFETCH=DECODE_PREFETCH if split else DECODE_PREFETCH_UNSPLIT,
        num_warps=DECODE_WARPS if split else DECODE_WARPS_UNSPLIT,
        **pdl_launch(device_caps(q.device)))
    return out


def split_counts(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, kv head), that the decode kernel's splits count
    themselves in; one buffer per device shared by every launch (triton_support.zeroed_scratch)."""
    device = torch.device(device)
    return zeroed_scratch(("decode split counts", device), (max(n, 1024),), torch.int32, device)


def prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int, scale: float, *,
            sliding_window: int | None = None, k_scale=None, v_scale=None, fmt: Fp8Format | None = None,
            out: torch.Tensor | None = None, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Queries of a chunk against all cached tokens: q [T, Hq, D] -> [T, Hq, D]."""
    _check(q, k_cache, v_cache, fmt)
    t, hq, d = q.shape
    hk, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    bsz = seq_lens.shape[0]
    if t == 0 or bsz == 0:
        return out
    dummy = k_scale if k_scale is not None else seq_lens
    grid = (bsz, triton.cdiv(max_query_len, block_m), hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, dummy,
        v_scale if v_scale is not None else dummy, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=hq // hk, BLOCK_SIZE=block_size, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=sliding_window or 0,
        **fp8_read_constexprs(fmt, q.device),
        PRECISION=dot_precision(q.dtype))
    return out
