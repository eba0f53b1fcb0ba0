"""Batched LoRA products for a step whose tokens use different adapters (punica's BGMV / S-LoRA): each token
gathers its own adapter's A and B from the stacked slots by its slot index (negative: no adapter).

    s = x @ A[slot].T                   shrink: [T, K] -> [T, P*R], the P parts' ranks side by side
    y[:, part p] += scale[slot, p] * s[:, p*R:(p+1)*R] @ B[slot, part p rows].T     expand, in place

A merged q/k/v or gate/up layer has P parts: its output columns [bounds[p], bounds[p+1]) read rank columns
[p*R, (p+1)*R). Slots hold every adapter at R, the padded largest rank; the zero padding adds nothing. A
token's work reads only its own row and slot, so the products do not depend on the rest of the batch, and a
step's launches are the same whatever the slots hold (CUDA graphs replay them with new indices).
"""
from __future__ import annotations

import torch

from quanta.kernels.triton_support import cdiv, tl, triton

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


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, s_ptr, slot_ptr, K, J, stride_x, stride_as, stride_aj,
                   BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (token, block of rank columns): s[t, j] = sum_k x[t, k] A[slot, j, k] in float32."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_J,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_j[:, None] * stride_aj + offs_k[None, :],
                    mask=(offs_j[:, None] < J) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * xk[None, :], axis=1)
    tl.store(s_ptr + t * J + offs_j, acc, mask=offs_j < J)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, scale_ptr, y_ptr, slot_ptr, N, J, B1, B2, stride_y, stride_bs,
                   P: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (token, block of output columns): y[t, n] += scale[slot, p(n)] sum_r s[t, p(n) R + r] B[slot, n, r],
    p(n) the part of column n (B1, B2: where parts 1 and 2 start)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    mask_n = offs_n < N
    part = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if P > 1:
        part += (offs_n >= B1).to(tl.int32)
    if P > 2:
        part += (offs_n >= B2).to(tl.int32)
    s = tl.load(s_ptr + t * J + part[:, None] * R + offs_r[None, :], mask=mask_n[:, None], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * R + offs_r[None, :],
                mask=mask_n[:, None], other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + slot * P + part, mask=mask_n, other=0.0)
    delta = tl.sum(s * b, axis=1) * scale
    y = tl.load(y_ptr + t * stride_y + offs_n, mask=mask_n, other=0.0)
    tl.store(y_ptr + t * stride_y + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def add_lora(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scale: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """y += each token's LoRA products (see the module docstring), in place; returns y. x [T, K] and y [T, N]
    with unit column stride, slots int32 [T], a [S, P*R, K], b [S, N, R] contiguous, scale float32 [S, P]."""
    t, k = x.shape
    n, j, rank = y.shape[1], a.shape[1], b.shape[2]
    parts = len(bounds) - 1
    assert parts <= 3 and j == parts * rank and x.stride(-1) == 1 and y.stride(-1) == 1
    if t == 0:
        return y
    s = torch.empty(t, j, device=x.device, dtype=torch.float32)
    block_j = min(64, triton.next_power_of_2(j))
    _shrink_kernel[(t, cdiv(j, block_j))](x, a, s, slots, k, j, x.stride(0), a.stride(0), a.stride(1),
                                         BLOCK_J=block_j, BLOCK_K=128, num_warps=4)
    b1 = bounds[1] if parts > 1 else n
    b2 = bounds[2] if parts > 2 else n
    block_n = 64
    _expand_kernel[(t, cdiv(n, block_n))](s, b, scale, y, slots, n, j, b1, b2, y.stride(0), b.stride(0),
                                         P=parts, R=rank, BLOCK_N=block_n, num_warps=4)
    return y
