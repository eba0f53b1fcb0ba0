"""Batched LoRA products for a step whose tokens use different adapters (punica's SGMV / S-LoRA): the token
rows come grouped by slot (`order`, `starts`: see sort_by_slot), and each program multiplies a tile of one slot's
rows by that slot's A or B with tl.dot, so a tile reads its adapter's matrices once.

    s = x @ A[slot].T                   shrink: [T, K] -> [T, P*R], the P parts' ranks side by side
    y[:, part p] += scale[slot, p] * s[:, p*R:(p+1)*R] @ B[slot, part p rows].T     expand, in place

A merged q/k/v or gate/up layer has P parts: its output columns [bounds[p], bounds[p+1]) read rank columns
[p*R, (p+1)*R). Slots hold every adapter at R, the padded largest rank; the zero padding adds nothing. A
few rows (decode) split the shrink's K over programs and the expand sums the pieces, since one program walking
all of K would wait on memory; a step's launches are the same whatever the slots hold (CUDA graphs replay them).
At a GEMV's rows `shrink_rows` runs the shrink alone and the GEMV adds the expand (quanta.kernels.lora_epilogue).
"""
from __future__ import annotations

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.fused_norm import (add_residual, add_rms_norm, inverse_rms, norm_outputs, norm_rows, norm_warps,
                                       normed, row_and_weight)
from quanta.kernels.lora_epilogue import MAX_ROWS, LoRAEpilogue
from quanta.kernels.triton_support import cdiv, pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

NAME = "triton_lora"


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


def sort_by_slot(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, starts) of a step's slots (int [T], negative: none): the rows grouped by slot, those without one
    last (int32 [T]), and where slot s's rows start in order (int32 [n_slots + 1]; starts[n_slots] counts the
    rows with an adapter). The engine builds the same on the host (quanta.lora.slots.LoRAStep)."""
    key = torch.where(slots < 0, n_slots, slots).long()
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(n_slots + 1, dtype=torch.int64, device=slots.device).scatter_add_(0, key, torch.ones_like(key))
    starts = torch.zeros(n_slots + 1, dtype=torch.int64, device=slots.device)
    starts[1:] = torch.cumsum(counts[:-1], 0)
    return order, starts.to(torch.int32)


def k_splits(rows: int, k: int) -> int:
    """Pieces of K the shrink splits into: one for many rows (a prefill's tiles fill the GPU), else pieces of
    SPLIT_K, since a slot's few row tiles walking all of K alone would wait on memory."""
    return 1 if rows > 512 else cdiv(k, SPLIT_K)


SPLIT_K = 512
SPLIT_BLOCK_N = 256     # the expand's output columns a program takes when the shrink ran in K pieces


@triton.jit
def _rows(order_ptr, starts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """The token rows of tile pid_m of `slot` (and which of them exist), or an empty mask past its last row."""
    lo = tl.load(starts_ptr + slot)
    hi = tl.load(starts_ptr + slot + 1)
    offs = lo + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = offs < hi
    return tl.load(order_ptr + offs, mask=mask, other=0).to(tl.int64), mask, lo + pid_m * BLOCK_M < hi


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, part_ptr, order_ptr, starts_ptr, T, K, J, K_PIECE, stride_x, stride_as, stride_aj,
                   SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    """Program (tile of one slot's rows, block of rank columns and piece of K, slot): the piece's share of
    s[row, j] = sum_k x[row, k] A[slot, j, k], float32, into part[piece, row, j]."""
    slot = tl.program_id(2)
    rows, mask_m, live = _rows(order_ptr, starts_ptr, slot, tl.program_id(0), BLOCK_M)
    if live:
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
def _expand_kernel(part_ptr, b_ptr, scale_ptr, y_ptr, order_ptr, starts_ptr, T, N, J, B1, B2, stride_y, stride_bs,
                   SPLITS: tl.constexpr, P: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (tile of one slot's rows, block of output columns, slot): y[row, n] += scale[slot, p(n)]
    sum_r s[row, p(n) R + r] B[slot, n, r], s summed over the shrink's pieces, p(n) the part of column n
    (B1, B2: where parts 1 and 2 start)."""
    slot = tl.program_id(2)
    rows, mask_m, live = _rows(order_ptr, starts_ptr, slot, tl.program_id(0), BLOCK_M)
    if live:
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


def add_lora(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scale: torch.Tensor, bounds: list[int], order: torch.Tensor | None = None,
             starts: torch.Tensor | None = None) -> torch.Tensor:
    """y += each token's LoRA products (see the module docstring), in place; returns y. x [T, K] and y [T, N]
    with unit column stride, slots int32 [T], a [S, P*R, K], b [S, N, R] contiguous, scale float32 [S, P];
    `order` and `starts` as sort_by_slot gives them (worked out here when not given)."""
    t, k = x.shape
    n_slots, j, rank = a.shape[0], a.shape[1], b.shape[2]
    n, parts = y.shape[1], len(bounds) - 1
    assert parts <= 3 and j == parts * rank and x.stride(-1) == 1 and y.stride(-1) == 1
    if t == 0:
        return y
    if order is None:
        order, starts = sort_by_slot(slots[:t], n_slots)
    splits = k_splits(t, k)
    block_m = 16 if t <= 16 else (32 if t <= 64 else 64)
    block_j = max(16, min(64, triton.next_power_of_2(j)))
    ieee = x.dtype == torch.float32
    piece = cdiv(k, splits * 64) * 64 if splits > 1 else k
    part = torch.empty(splits, t, j, device=x.device, dtype=torch.float32)
    _shrink_kernel[(cdiv(t, block_m), cdiv(j, block_j) * splits, n_slots)](
        x, a, part, order, starts, t, k, j, piece, x.stride(0), a.stride(0), a.stride(1),
        SPLITS=splits, BLOCK_M=block_m, BLOCK_J=block_j, BLOCK_K=64, IEEE=ieee, num_warps=4)
    b1 = bounds[1] if parts > 1 else n
    b2 = bounds[2] if parts > 2 else n
    # each program reads its rows' rank sums from every K piece: wider column blocks read them fewer times
    block_n = SPLIT_BLOCK_N if splits > 1 else 64
    _expand_kernel[(cdiv(t, block_m), cdiv(n, block_n), n_slots)](
        part, b, scale, y, order, starts, t, n, j, b1, b2, y.stride(0), b.stride(0), SPLITS=splits, P=parts,
        R=rank, R_PAD=max(16, rank), BLOCK_M=block_m, BLOCK_N=block_n, IEEE=ieee, num_warps=8 if block_n > 64 else 4)
    return y


# --- decode rows: the shrink alone; the GEMV's epilogue adds the expand (quanta.kernels.lora_epilogue) ----
PIECE_K = 256           # input columns a shrink program reduces: many programs, one load round each
BLOCK_J = 32            # rank columns a shrink program makes (a 32 x 256 tile of A: 64 values a thread)


@triton.jit
def _shrink_rows_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, T, K, J, stride_x, stride_as,
                        BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row m, piece of BLOCK_K input columns, block of BLOCK_J rank columns): part[piece, m, j] =
    sum_k A[slot, j, k] x[m, k] over the piece, float32; nothing for a row without an adapter. A is read before
    waiting for the kernel that wrote x."""
    pdl_launch_dependents(PDL)
    m = tl.program_id(0)
    piece = tl.program_id(1)
    slot = tl.load(slot_ptr + m)
    if slot >= 0:
        offs_k = piece * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
        a = _a_tile(a_ptr, slot, stride_as, offs_j, offs_k, J, K)
        pdl_wait(PDL)
        x = tl.load(x_ptr + m * stride_x + offs_k, mask=offs_k < K, other=0.0)
        _store_piece(part_ptr, a, x, piece, T, m, J, offs_j)
    else:
        pdl_wait(PDL)


@triton.jit
def _a_tile(a_ptr, slot, stride_as, offs_j, offs_k, J, K):
    """A[slot]'s rank columns offs_j at input columns offs_k (zero outside [0, J) x [0, K))."""
    return tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_j[:, None] * K + offs_k[None, :],
                   mask=(offs_j < J)[:, None] & (offs_k < K)[None, :], other=0.0)


@triton.jit
def _store_piece(part_ptr, a, x, piece, T, m, J, offs_j):
    """part[piece, m, offs_j] = a [BLOCK_J, columns] @ x [columns], in float32."""
    s = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + (piece * T + m) * J + offs_j, s, mask=offs_j < J)


def shrink_rows(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                bounds: list[int]) -> LoRAEpilogue:
    """The shrink of x [T, K] (T <= MAX_ROWS, unit column stride) by each row's slot of a [S, P*R, K]; returns the
    epilogue a GEMV finishes (LoRAEpilogue)."""
    t, k = x.shape
    j = a.shape[1]
    assert t <= MAX_ROWS and x.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    pieces = cdiv(k, PIECE_K)
    part = torch.empty(pieces, t, j, device=x.device, dtype=torch.float32)
    _shrink_rows_kernel[(t, pieces, cdiv(j, BLOCK_J))](x, a, slots, part, t, k, j, x.stride(0), a.stride(0),
                                                       BLOCK_J=BLOCK_J, BLOCK_K=PIECE_K, num_warps=4,
                                                       **pdl_launch(device_caps(x.device)))
    return LoRAEpilogue(part, b, scale, slots, tuple(bounds))


@triton.jit
def _norm_shrink_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, a_ptr, slot_ptr, part_ptr, T, D, J, eps,
                        stride_x, stride_r, stride_y, stride_h, stride_as,
                        BLOCK_D: tl.constexpr, PK: tl.constexpr, BLOCK_J: tl.constexpr, JB: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, 0): the fused norm (fused_norm's kernel: h = x + residual, y). Program (row, 1 + piece * JB +
    jb): the shrink of the row's PK columns of y as stored (rounded to y's dtype) by A[slot]'s rank columns
    jb * BLOCK_J..: part[piece, row, j], float32; nothing for a row without an adapter. A shrink program takes the
    row's inverse RMS as program 0 does (the same reduction of the same registers) and makes only its piece of y,
    loaded in the layout of A's tile; it reads A before waiting for the kernel that wrote x."""
    task = tl.program_id(1)
    if task == 0:
        row, offs, mask, w = row_and_weight(w_ptr, D, BLOCK_D, PDL)
        h, y = add_rms_norm(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0),
                            r_ptr + row * stride_r + offs, w, mask, D, eps, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
        tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        pdl_launch_dependents(PDL)
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        if slot >= 0:
            piece = (task - 1) // JB
            offs_j = ((task - 1) % JB) * BLOCK_J + tl.arange(0, BLOCK_J)
            offs_p = piece * PK + tl.arange(0, PK)
            mask_p = offs_p < D
            a = _a_tile(a_ptr, slot, stride_as, offs_j, offs_p, J, D)
            w = tl.load(w_ptr + offs_p, mask=mask_p, other=0.0).to(tl.float32)
            pdl_wait(PDL)
            offs = tl.arange(0, BLOCK_D)
            mask = offs < D
            inv = inverse_rms(add_residual(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0),
                                           r_ptr + row * stride_r + offs, mask, HAS_RESIDUAL), D, eps)
            hp = add_residual(tl.load(x_ptr + row * stride_x + offs_p, mask=mask_p, other=0.0),
                              r_ptr + row * stride_r + offs_p, mask_p, HAS_RESIDUAL)
            _store_piece(part_ptr, a, normed(hp, inv, w).to(y_ptr.dtype.element_ty), piece, T, row, J, offs_j)
        else:
            pdl_wait(PDL)


def norm_shrink(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, bounds: list[int]):
    """fused_norm.rms_norm(x, weight, eps, residual) (y, or (y, h)) for the rows of a GEMV whose adapters' shrink
    the same launch makes (the GEMV's LoRAEpilogue, second): a launch fewer than the norm, then shrink_rows."""
    d = x.shape[-1]
    x2, r2, y, h = norm_rows(x, weight, residual)
    t, j = x2.shape[0], a.shape[1]
    assert t <= MAX_ROWS and a.shape[2] == d and a.is_contiguous()
    block = triton.next_power_of_2(d)
    pk = min(PIECE_K, block)
    pieces, jb = cdiv(d, pk), cdiv(j, BLOCK_J)
    part = torch.empty(pieces, t, j, device=x.device, dtype=torch.float32)
    _norm_shrink_kernel[(t, 1 + pieces * jb)](
        x2, r2, weight, y, h, a, slots, part, t, d, j, eps, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
        a.stride(0), BLOCK_D=block, PK=pk, BLOCK_J=BLOCK_J, JB=jb, HAS_RESIDUAL=residual is not None,
        num_warps=norm_warps(block), **pdl_launch(device_caps(x.device)))
    return norm_outputs(x, y, h, residual), LoRAEpilogue(part, b, scale, slots, tuple(bounds))
