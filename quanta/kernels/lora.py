"""Batched LoRA products for a step whose tokens use different adapters (punica's SGMV / S-LoRA): the token
rows come grouped by slot and cut into tiles of one slot's rows (plan_tiles, on the host), and each program
multiplies one tile by its slot's A or B with tl.dot, so a tile reads its adapter's matrices once.

    s = x @ A[slot].T                   shrink: [T, K] -> [T, P*R], the P parts' ranks side by side
    y[:, part p] += scale[slot, p] * s[:, p*R:(p+1)*R] @ B[slot, part p rows].T     expand, in place

A merged q/k/v or gate/up layer has P parts: its output columns [bounds[p], bounds[p+1]) read rank columns
[p*R, (p+1)*R). Slots hold every adapter at R, the padded largest rank; the zero padding adds nothing. Few rows
(decode) split the shrink's K over programs and the expand sums the pieces, since one program walking all of K
would wait on memory. The grids depend on T only (CUDA graphs replay them with new tiles); spare tiles exit.
"""
from __future__ import annotations

import numpy as np
import torch

from quanta.kernels.triton_support import cdiv, tl, triton

NAME = "triton_lora"
SPLIT_K = 512


def reference(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              scale: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The products in float32, added to y in place: x [T, K], y [T, N], slots [T], a [S, P*R, K],
    b [S, N, R], scale [S, P] float32, bounds [P + 1] (column boundaries of the parts)."""
    rank = b.shape[-1]
    for t in range(x.shape[0]):
        slot = int(slots[t])
        if slot < 0:
            continue
        s = a[slot].float() @ x[t].float()
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            delta = b[slot, lo:hi].float() @ s[p * rank:(p + 1) * rank]
            y[t, lo:hi] = (y[t, lo:hi].float() + scale[slot, p] * delta).to(y.dtype)
    return y


def block_m(rows: int) -> int:
    """Rows a tile holds for a step of `rows` token rows."""
    return 16 if rows <= 16 else (32 if rows <= 64 else 64)


def max_tiles(rows: int, n_slots: int) -> int:
    """The most tiles `rows` token rows over `n_slots` slots can need (each slot's last tile may be partial)."""
    return rows // block_m(rows) + min(n_slots, rows)


def plan_tiles(slots: np.ndarray, n_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, starts, tiles) for a step's slots (int [T], negative: none): the rows grouped by slot, those
    without one last (int32 [T]); where slot s's rows start in order (int32 [n_slots + 1]); and the tiles,
    (slot, first place in order) pairs (int32 [max_tiles(T), 2]), the spare ones (-1, 0)."""
    t = slots.size
    key = np.where(slots < 0, n_slots, slots)
    order = np.argsort(key, kind="stable").astype(np.int32)
    starts = np.zeros(n_slots + 1, dtype=np.int32)
    starts[1:] = np.cumsum(np.bincount(key, minlength=n_slots + 1))[:-1]
    tiles = np.zeros((max_tiles(t, n_slots), 2), dtype=np.int32)
    tiles[:, 0] = -1
    bm, i = block_m(t), 0
    for slot in range(n_slots):
        for first in range(int(starts[slot]), int(starts[slot + 1]), bm):
            tiles[i] = slot, first
            i += 1
    return order, starts, tiles


def k_splits(rows: int, k: int) -> int:
    """Pieces of K the shrink splits into: one for many rows (the tiles fill the GPU), else pieces of SPLIT_K."""
    return 1 if rows > 64 else cdiv(k, SPLIT_K)


@triton.jit
def _tile(order_ptr, starts_ptr, tiles_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its slot (negative: a spare tile), its token rows and which of them exist."""
    i = tl.program_id(0)
    slot = tl.load(tiles_ptr + 2 * i)
    first = tl.load(tiles_ptr + 2 * i + 1)
    end = tl.load(starts_ptr + tl.maximum(slot, 0) + 1)
    offs = first + tl.arange(0, BLOCK_M)
    mask = (offs < end) & (slot >= 0)
    return slot, tl.load(order_ptr + offs, mask=mask, other=0).to(tl.int64), mask


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, part_ptr, order_ptr, starts_ptr, tiles_ptr, T, K, J, K_PIECE, stride_x,
                   stride_as, stride_aj, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, block of rank columns and piece of K): the piece's share of
    s[row, j] = sum_k x[row, k] A[slot, j, k], float32, into part[piece, row, j]."""
    slot, rows, mask_m = _tile(order_ptr, starts_ptr, tiles_ptr, BLOCK_M)
    if slot >= 0:
        piece = tl.program_id(1) % SPLITS
        offs_j = (tl.program_id(1) // SPLITS) * BLOCK_J + tl.arange(0, BLOCK_J)
        mask_j = offs_j < J
        acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
        k_end = tl.minimum(K, (piece + 1) * K_PIECE)
        for k0 in range(piece * K_PIECE, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_k[:, None] + offs_j[None, :] * stride_aj,
                        mask=mask_k[:, None] & mask_j[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(x, a, input_precision="ieee")
            else:
                acc += tl.dot(x, a)
        tl.store(part_ptr + (piece * T + rows[:, None]) * J + offs_j[None, :], acc,
                 mask=mask_m[:, None] & mask_j[None, :])


@triton.jit
def _expand_kernel(part_ptr, b_ptr, scale_ptr, y_ptr, order_ptr, starts_ptr, tiles_ptr, T, N, J, B1, B2,
                   stride_y, stride_bs, SPLITS: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
                   R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile, block of output columns): y[row, n] += scale[slot, p(n)] sum_r s[row, p(n) R + r]
    B[slot, n, r], s summed over the shrink's pieces, p(n) the part of column n (B1, B2: where parts 1 and 2
    start)."""
    slot, rows, mask_m = _tile(order_ptr, starts_ptr, tiles_ptr, BLOCK_M)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, R_PAD)
        mask_n, mask_r = offs_n < N, offs_r < R
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * R + offs_r[:, None],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(P):
            s = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
            for piece in range(SPLITS):
                s += tl.load(part_ptr + (piece * T + rows[:, None]) * J + p * R + offs_r[None, :],
                             mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            s = s * tl.load(scale_ptr + slot * P + p)
            lo = 0 if p == 0 else (B1 if p == 1 else B2)
            hi = N if p == P - 1 else (B1 if p == 0 else B2)
            bp = tl.where(((offs_n >= lo) & (offs_n < hi))[None, :], b, 0.0)
            if IEEE:
                acc += tl.dot(s, bp.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(s.to(b.dtype), bp)
        ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


def add_lora(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor,
             scale: torch.Tensor, bounds: list[int],
             plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y += each token's LoRA products (see the module docstring), in place; returns y. x [T, K] and y [T, N]
    with unit column stride, slots int32 [T] (or None with a plan), a [S, P*R, K], b [S, N, R] contiguous, scale float32 [S, P];
    `plan`: plan_tiles' (order, starts, tiles) on the device (worked out here from `slots` when not given)."""
    t, k = x.shape
    n_slots, j, rank = a.shape[0], a.shape[1], b.shape[2]
    n, parts = y.shape[1], len(bounds) - 1
    assert parts <= 3 and j == parts * rank and x.stride(-1) == 1 and y.stride(-1) == 1
    if t == 0:
        return y
    if plan is None:
        plan = tuple(torch.from_numpy(v).to(x.device) for v in plan_tiles(slots[:t].cpu().numpy(), n_slots))
    order, starts, tiles = plan
    splits, bm, grid_m = k_splits(t, k), block_m(t), max_tiles(t, n_slots)
    block_j = max(16, min(64, triton.next_power_of_2(j)))
    ieee = x.dtype == torch.float32
    piece = cdiv(k, splits * 64) * 64 if splits > 1 else k
    part = torch.empty(splits, t, j, device=x.device, dtype=torch.float32)
    _shrink_kernel[(grid_m, cdiv(j, block_j) * splits)](
        x, a, part, order, starts, tiles, t, k, j, piece, x.stride(0), a.stride(0), a.stride(1),
        SPLITS=splits, BLOCK_M=bm, BLOCK_J=block_j, BLOCK_K=64, IEEE=ieee, num_warps=4)
    b1 = bounds[1] if parts > 1 else n
    b2 = bounds[2] if parts > 2 else n
    block_n = 64
    _expand_kernel[(grid_m, cdiv(n, block_n))](
        part, b, scale, y, order, starts, tiles, t, n, j, b1, b2, y.stride(0), b.stride(0), SPLITS=splits,
        P=parts, R=rank, R_PAD=max(16, rank), BLOCK_M=bm, BLOCK_N=block_n, IEEE=ieee, num_warps=4)
    return y
