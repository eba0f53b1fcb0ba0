"""LoRA products finished inside a GEMV's epilogue: for a decode step's one or two rows, the adapter's shrink runs
as one small launch before the GEMV and its expand is added to the GEMV's float32 output columns, so the
adapted layer keeps its fused epilogue (SwiGLU, rotary + KV store) and adds one launch, not two plus those.

    part[piece, m, :] = A[slot(m), :, piece's K columns] @ x[m, piece's K columns]        shrink_rows, float32
    y[m, n] += scale[slot(m), p(n)] * sum_r (sum_piece part[piece, m, p(n) R + r]) B[slot(m), n, r]  lora_delta

A row without an adapter (slot < 0) skips both. The slots' layout is quanta.lora.kernels' (A [S, P*R, K],
B [S, N, R], scale [S, P], parts' column bounds); a step's launches are the same whatever the slots hold.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.triton_support import cdiv, pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

PIECE_K = 256           # input columns a shrink program reduces: many programs, one load round each
BLOCK_J = 32            # rank columns a shrink program makes (a 32 x 256 tile of A: 64 values a thread)
MAX_ROWS = 2            # the rows a fused epilogue takes (the GEMV's)


class LoRAEpilogue(NamedTuple):
    """One layer's adapter products for a GEMV's epilogue: the shrink's float32 pieces [pieces, T, P*R], the
    slots' B [S, N, R] and scale [S, P], each row's slot (int32 [T], negative: none) and the parts' bounds."""
    part: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    slots: torch.Tensor
    bounds: tuple[int, ...]

    def kernel_args(self) -> tuple:
        """The GEMV kernel's LoRA arguments after its own: pointers, J = P*R, pieces, part bounds 1 and 2, B's
        slot stride."""
        n, parts = self.b.shape[1], len(self.bounds) - 1
        b1 = self.bounds[1] if parts > 1 else n
        b2 = self.bounds[2] if parts > 2 else n
        return (self.part, self.b, self.scale, self.slots, self.part.shape[2], self.part.shape[0], b1, b2,
                self.b.stride(0))

    def constexprs(self) -> dict:
        """The GEMV kernel's LoRA constexprs: on, the parts, the rank tile, the pieces padded to a power of two."""
        return {"LORA": True, "LORA_P": len(self.bounds) - 1, "LORA_R": self.b.shape[2],
                "LORA_PIECES_PAD": triton.next_power_of_2(self.part.shape[0])}


def no_lora_args(filler: torch.Tensor) -> tuple:
    """The GEMV kernel's LoRA arguments when there is no epilogue (pointers never read)."""
    return (filler,) * 4 + (1, 1, 0, 0, 0)


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
        mask_k, mask_j = offs_k < K, offs_j < J
        a = tl.load(a_ptr + slot.to(tl.int64) * stride_as + offs_j[:, None] * K + offs_k[None, :],
                    mask=mask_j[:, None] & mask_k[None, :], other=0.0)
        pdl_wait(PDL)
        x = tl.load(x_ptr + m * stride_x + offs_k, mask=mask_k, other=0.0)
        s = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(part_ptr + (piece * T + m) * J + offs_j, s, mask=mask_j)
    else:
        pdl_wait(PDL)


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
def lora_delta(part_ptr, b_ptr, scale_ptr, slot_ptr, m, T, J, PIECES, B1, B2, stride_bs, offs_n, mask_n,
               P: tl.constexpr, R: tl.constexpr, PIECES_PAD: tl.constexpr):
    """Row m's adapter products at output columns offs_n (float32, zero without an adapter): 16 rank columns of B
    at a time (a large rank keeps a small tile), times each part's shrink (its pieces summed, scaled), kept for
    the part's columns."""
    delta = tl.zeros(offs_n.shape, dtype=tl.float32)
    slot = tl.load(slot_ptr + m)
    if slot >= 0:
        offs_p = tl.arange(0, PIECES_PAD)
        for r0 in range(0, R, 16):                 # a loop, not unrolled: one chunk live at a time
            offs_r = r0 + tl.arange(0, 16)
            b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None] * R + offs_r[None, :],
                        mask=mask_n[:, None] & (offs_r < R)[None, :], other=0.0)      # kept 16-bit: registers
            for p in tl.static_range(P):
                s = tl.load(part_ptr + (offs_p[:, None] * T + m) * J + p * R + offs_r[None, :],
                            mask=(offs_p < PIECES)[:, None] & (offs_r < R)[None, :], other=0.0)
                s = tl.sum(s, axis=0) * tl.load(scale_ptr + slot * P + p)
                lo = 0 if p == 0 else (B1 if p == 1 else B2)
                hi = B1 if p == 0 else (B2 if p == 1 else 1 << 30)      # B1 = N with one part, B2 = N with two
                c = tl.sum(b.to(tl.float32) * s[None, :], axis=1)
                delta += tl.where((offs_n >= lo) & (offs_n < hi), c, 0.0)
    return delta
