"""How the GEMVs at one or two rows (affine gemv.py, fp8_gemv.py, ggml gemv_cols.py / gemv_dp4a.py) launch and leave
a program: the launch's column blocks and K splits (gemv_launch), a program's output columns (SwiGLU's gate and up
halves side by side), the split-K sum through a workspace that the last split to arrive takes, and the epilogues:
store, SwiGLU, or rotary + the paged KV store."""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.activation import silu_mul
from quanta.kernels.device_caps import DeviceCaps
from quanta.kernels.rotary import RopeStore, rope_store_epilogue
from quanta.kernels.triton_support import cdiv, split_k, tl, triton, zeroed_scratch

MAX_ROWS = 2                  # the most activation rows a GEMV takes (plan.GEMV_MAX_M)


@triton.jit
def output_columns(pid_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """(columns, mask) of program column block pid_n: BLOCK_N columns, or with GLU (W = [gate; up], N = 2I)
    BLOCK_N / 2 gate columns c, then the up columns I + c."""
    if GLU:
        HB: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        col = pid_n * HB + j % HB
        return col + (j // HB) * (N // 2), col < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_n, offs_n < N


@triton.jit
def store_output(y, bias_ptr, HAS_BIAS: tl.constexpr, y_row, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n,
                 mask_n, N, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                 k_scale_ptr, v_scale_ptr, Q_SIZE, KV_SIZE, ROPE: tl.constexpr, HEAD_D: tl.constexpr,
                 FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_REBIAS: tl.constexpr,
                 FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr, FP8_MAGIC_BITS: tl.constexpr):
    """A program's float32 partial row out, the bias added once (by K split 0): finished at once without split-K;
    else added into the workspace row ws[m], the split counted in lock[m, column block], and the last split to
    arrive takes the sum (resetting ws and the count for the next call) and finishes it."""
    if HAS_BIAS:
        if pid_k == 0:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        _finish(y, y_row, pid_m, pid_n, offs_n, mask_n, N, BLOCK_N, GLU, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr,
               slot_ptr, k_scale_ptr, v_scale_ptr, Q_SIZE, KV_SIZE, ROPE, HEAD_D, FP8, FP8_MAX, FP8_SHIFT,
               FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    else:
        ws = ws_ptr + pid_m * N + offs_n
        lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
        tl.atomic_add(ws, y, mask=mask_n, sem="relaxed")
        tl.debug_barrier()                        # every thread's partial is in before the count is released
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.atomic_add(ws, tl.zeros_like(y), mask=mask_n, sem="relaxed")   # read at L2, not L1
            _finish(total, y_row, pid_m, pid_n, offs_n, mask_n, N, BLOCK_N, GLU, pos_ptr, freq_ptr, k_cache_ptr,
                   v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, Q_SIZE, KV_SIZE, ROPE, HEAD_D, FP8, FP8_MAX,
                   FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
            tl.store(ws, tl.zeros_like(y), mask=mask_n)
            tl.store(lock, 0)


@triton.jit
def store_plain(y, bias_ptr, HAS_BIAS: tl.constexpr, y_row, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n, mask_n, N,
                SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """store_output without the rotary + KV-store epilogue."""
    store_output(y, bias_ptr, HAS_BIAS, y_row, ws_ptr, lock_ptr, pid_m, pid_n, pid_k, offs_n, mask_n, N, SPLIT_K,
                 BLOCK_N, GLU, y_row, y_row, y_row, y_row, y_row, y_row, y_row, 0, 0, False, 128, 0, 0.0, 0, 0, 0.0,
                 0.0, 0)


@triton.jit
def _finish(y, y_row, pid_m, pid_n, offs_n, mask_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr, pos_ptr, freq_ptr,
            k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, Q_SIZE, KV_SIZE, ROPE: tl.constexpr,
            HEAD_D: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr,
            FP8_REBIAS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr,
            FP8_MAGIC_BITS: tl.constexpr):
    """A program's float32 results out: rotary and the KV store (ROPE), else stored (GLU: activated)."""
    if ROPE:
        rope_store_epilogue(y, y_row, pid_m, pid_n * BLOCK_N, N, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr,
                            slot_ptr, k_scale_ptr, v_scale_ptr, Q_SIZE, KV_SIZE, BLOCK_N, HEAD_D, FP8, FP8_MAX,
                            FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    else:
        _store_y(y, y_row, pid_n, offs_n, mask_n, N, BLOCK_N, GLU)


@triton.jit
def _store_y(y, y_row, pid_n, offs_n, mask_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """Store a program's float32 results in y's dtype; GLU: silu(gate half) * (up half), rounded as the
    unfused path rounds (both halves to the dtype, then activation.silu_mul)."""
    DT: tl.constexpr = y_row.dtype.element_ty
    if GLU:
        HB: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, HB)), (1, 0)))
        out = silu_mul(gate.to(DT).to(tl.float32), up.to(DT).to(tl.float32), DT)
        col = pid_n * HB + tl.arange(0, HB)
        tl.store(y_row + col, out, mask=col < N // 2)
    else:
        tl.store(y_row + offs_n, y.to(DT), mask=mask_n)


LOCK_COLUMNS = 16             # the smallest BLOCK_N the workspace's lock rows are sized for


def workspace(device: torch.device, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The zeroed float32 partial sums [rows, N] and int32 split counts of the split-K GEMV on `device`,
    one pair per (device, N) shared by every call (triton_support.zeroed_scratch)."""
    device, rows = torch.device(device), max(m, MAX_ROWS)
    return (zeroed_scratch(("gemv partials", device, n), (rows, n), torch.float32, device),
            zeroed_scratch(("gemv counts", device, n), (rows, cdiv(n, LOCK_COLUMNS)), torch.int32, device))


class GemvLaunch(NamedTuple):
    """A split-K GEMV launch: its column blocks and K splits (the grid's second and third axes), K steps a split,
    the output y and the workspace's partial sums and split counts."""
    column_blocks: int
    splits: int
    per: int
    y: torch.Tensor
    ws: torch.Tensor
    locks: torch.Tensor


def gemv_launch(x2: torch.Tensor, n: int, k_steps: int, block_n: int, waves: float, min_steps: int, glu: bool,
                dtype: torch.dtype, caps: DeviceCaps) -> GemvLaunch:
    """The launch of a GEMV over x2's rows and N output columns, block_n a program (with GLU block_n / 2 gate
    columns and their up columns: y has N / 2), its K of k_steps split for about `waves` programs an SM of at least
    `min_steps` steps each (split_k); y [M, N or N / 2] in `dtype`."""
    m = x2.shape[0]
    column_blocks = cdiv(n // 2, block_n // 2) if glu else cdiv(n, block_n)
    splits, per = split_k(m * column_blocks, k_steps, caps.sm_count, waves, min_steps)
    y = torch.empty(m, n // 2 if glu else n, device=x2.device, dtype=dtype)
    return GemvLaunch(column_blocks, splits, per, y, *workspace(x2.device, n, m))


def rope_fits(n: int, rope: RopeStore, block_n: int) -> bool:
    """Whether an epilogue over `block_n` output columns a program can finish W = [q; k; v] of N = n rows: whole
    power-of-two heads in every program's columns, the row exactly q's, k's and v's."""
    d = rope.head_dim
    return (d >= 2 and d & (d - 1) == 0 and block_n % d == 0 and n == rope.q_size + 2 * rope.kv_size
            and rope.q_size % d == 0 and rope.kv_size % d == 0)
