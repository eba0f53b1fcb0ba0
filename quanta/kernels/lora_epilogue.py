"""LoRA products finished inside a GEMV's epilogue: for a decode step's one or two rows, the adapter's shrink runs
before the GEMV (quanta.lora.kernels: shrink_rows, or norm_shrink in the launch of the norm that feeds it) and its
expand is added to the GEMV's float32 output here, so the layer keeps its fused epilogue (SwiGLU, rotary + KV store).

    part[piece, m, :] = A[slot(m), :, piece's K columns] @ x[m, piece's K columns]        shrink_rows, float32
    y[m, n] += scale[slot(m), p(n)] * sum_r (sum_piece part[piece, m, p(n) R + r]) B[slot(m), n, r]  lora_delta

A row without an adapter (slot < 0) skips both. The slots' layout is quanta.lora.kernels' (A [S, P*R, K],
B [S, N, R], scale [S, P], parts' column bounds); a step's launches are the same whatever the slots hold.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.triton_support import tl, triton

MAX_ROWS = 2            # the rows a fused epilogue takes (the GEMV's)
# B's rank columns an epilogue step reads: few, so the epilogue needs no more registers than the GEMV's loop (more
# registers a thread would leave fewer programs an SM to stream the weight)
RANK_CHUNK = 2


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
                "LORA_PIECES_PAD": triton.next_power_of_2(self.part.shape[0]), "LORA_CHUNK": RANK_CHUNK}


def no_lora_args(filler: torch.Tensor) -> tuple:
    """The GEMV kernel's LoRA arguments when there is no epilogue (pointers never read)."""
    return (filler,) * 4 + (1, 1, 0, 0, 0)


@triton.jit
def lora_delta(part_ptr, b_ptr, scale_ptr, slot_ptr, m, T, J, PIECES, B1, B2, stride_bs, offs_n, mask_n,
               P: tl.constexpr, R: tl.constexpr, PIECES_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Row m's adapter products at output columns offs_n (float32, zero without an adapter): CHUNK rank
    columns of B at a time (RANK_CHUNK), times each part's shrink (its pieces summed, scaled), kept for the
    part's columns."""
    delta = tl.zeros(offs_n.shape, dtype=tl.float32)
    slot = tl.load(slot_ptr + m)
    if slot >= 0:
        offs_p = tl.arange(0, PIECES_PAD)
        for r0 in range(0, R, CHUNK):              # a loop, not unrolled: one chunk live at a time
            offs_r = r0 + tl.arange(0, CHUNK)
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
