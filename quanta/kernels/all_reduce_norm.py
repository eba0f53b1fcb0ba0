"""The sum of a row-parallel layer's partial outputs over the tensor-parallel ranks, fused with the residual
add and the RMSNorm that follow it: one kernel where unfused decode runs four (stage, all-reduce, cast, norm).

Every rank runs the kernel on its own x over the same rows. The ranks meet by peer stores into a symmetric
buffer whose data is its own flag, with no handshake (_all_reduce_norm_kernel describes the scheme); `reference`
states what it computes.
"""
from __future__ import annotations

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.fused_norm import add_rms_norm, row_and_weight, store_row
from quanta.kernels.fused_norm import reference as norm_reference
from quanta.kernels.triton_support import pdl_launch, tl, triton

NAME = "triton_all_reduce_norm"


def reference(parts: list[torch.Tensor], weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
              order: torch.Tensor | None = None):
    """The ranks' partial outputs `parts` (rank order) -> (y, h), as the kernel computes them:

        s = sum over ranks of x (float32, in rank order, rounded once);  h = s + residual (when given);
        y = weight * (h.float() * rsqrt(mean(h**2) + eps)).to(dtype)

    that is, fused_norm's outputs for the all-reduced x (y's columns in `order`, as there), and with no residual
    h = s."""
    s = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    if residual is None:
        return norm_reference(s, weight, eps, order=order), s
    return norm_reference(s, weight, eps, residual, order)


@triton.jit
def _peer(ptr, deltas, rank, unit: tl.constexpr):
    """`ptr` (into this rank's buffer) moved to the same place in `rank`'s buffer: deltas[rank] bytes on,
    in elements of `unit` bytes. Every buffer starts on a 16-byte boundary, which lets rows be read and
    written 16 bytes at a time."""
    return ptr + tl.multiple_of(tl.load(deltas + rank) // unit, 16 // unit)


ROUNDS = 3                       # rounds of slots a buffer cycles over (see _all_reduce_norm_kernel)


def sentinel_bits(dtype: torch.dtype) -> int:
    """The bit pattern (as a signed integer of dtype's width) of -0.0, the value of an empty slot's elements."""
    return -(1 << (dtype.itemsize * 8 - 1))


@triton.jit
def _empty(v, mask):
    """How many elements of row v (under mask) still hold the sentinel -0.0, read by bit pattern."""
    BITS: tl.constexpr = v.dtype.primitive_bitwidth
    ITYPE: tl.constexpr = tl.int16 if BITS == 16 else tl.int32
    bits = v.to(ITYPE, bitcast=True)
    return tl.sum(tl.where(mask & (bits == -(1 << (BITS - 1))), 1, 0), axis=0)


@triton.jit
def _all_reduce_norm_kernel(
    # this rank's tensors, its round counters and buffer
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, order_ptr, round_ptr, data_ptr,
    # every rank's buffer's address less this rank's, in bytes (int64 [WORLD])
    deltas,
    # sizes
    rank, D, eps, rows,
    # strides (rows)
    stride_x, stride_r, stride_y, stride_h,
    # meta
    WORLD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_ORDER: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One program per row of D features (BLOCK_D >= D: the row stays in registers). The buffer holds
    [ROUNDS, WORLD, rows, D] slots: round, sending rank, row.

    No flags (the Lamport scheme of TensorRT-LLM's one-shot all-reduce): a slot that holds no data holds the
    sentinel -0.0 in every element, which no data element ever is (a partial sum's -0.0 is sent as +0.0, the same
    number), so the data is its own flag:
      1. the program stores its row into its own slot of this call's round in every rank's buffer (NVLink
         peer stores, fire-and-forget: no fence, no handshake);
      2. it reads the round's slots in its own buffer until no element is the sentinel: every peer's row has
         landed, in whatever order its bytes arrived;
      3. it sums them in rank order (the same number on every rank), adds the residual and normalizes;
      4. it writes the sentinel back over its own buffer's slots of the previous round.
    Calls cycle over three rounds by a per-row counter each rank keeps on its GPU (every rank runs the same
    calls over the same rows, so the counters agree). A peer stores into round r + 3 (the same slots as r) only
    after this rank has sent its rows of r + 1 and r + 2, so after this rank's call r + 1 has cleared round r;
    and no peer's rows of round r + 1 can land in a slot this rank is still reading. The critical path is one
    NVLink store and local reads; nothing waits for a remote acknowledgement.

    Every rank's buffer has the same layout (engine/parallel/one_shot.py's symmetric buffer); the kernel
    finds a peer's by the byte distance of its buffer from this rank's (_peer). The kernel holds its barrier in
    itself, so CUDA graphs capture it as any kernel."""
    row, offs, mask, w = row_and_weight(w_ptr, D, BLOCK_D, PDL)
    dtype = x_ptr.dtype.element_ty
    unit: tl.constexpr = dtype.primitive_bitwidth // 8
    this_round = (tl.load(round_ptr + row) + 1) % 3                   # % ROUNDS (a Python constant)
    # --- 1. this rank's row into its slot of this round in every rank's buffer; -0.0 goes as +0.0
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x = tl.where(x == 0.0, tl.zeros_like(x), x)
    mine = ((this_round * WORLD + rank) * rows + row) * D
    for r in tl.static_range(WORLD):
        tl.store(_peer(data_ptr, deltas, r, unit) + mine + offs, x, mask=mask)
    # --- 2. every rank's row of this round, once all of it has landed, summed in rank order
    acc = tl.zeros([BLOCK_D], tl.float32)
    for r in tl.static_range(WORLD):
        slot = data_ptr + ((this_round * WORLD + r) * rows + row) * D + offs
        v = tl.load(slot, mask=mask, other=0.0, volatile=True)
        while _empty(v, mask) > 0:
            v = tl.load(slot, mask=mask, other=0.0, volatile=True)
        acc += v.to(tl.float32)
    # --- 3. the residual and the norm
    h, y = add_rms_norm(acc.to(dtype), r_ptr + row * stride_r + offs, w, mask, D, eps, HAS_RESIDUAL)
    tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    store_row(y_ptr + row * stride_y, y, offs, mask, order_ptr, HAS_ORDER)
    # --- 4. the previous round's slots of this row emptied for its next use, three calls on
    empty = tl.full([BLOCK_D], -(1 << (dtype.primitive_bitwidth - 1)),
                    tl.int16 if unit == 2 else tl.int32).to(dtype, bitcast=True)
    for r in tl.static_range(WORLD):
        tl.store(data_ptr + ((((this_round + 2) % 3) * WORLD + r) * rows + row) * D + offs, empty, mask=mask)
    tl.store(round_ptr + row, this_round)


def all_reduce_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                    rank: int, data: torch.Tensor, deltas: torch.Tensor,
                    rounds: torch.Tensor, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, D] this rank's partial rows (and residual, same shape) -> (y, h) as `reference` over all ranks'
    x (y's column k holding feature order[k] where `order`, int32 [D], is given). This rank's buffer: data
    [ROUNDS, world, rows, D] of x's dtype, filled with -0.0 before the first call (`empty_buffer`), every
    rank's at deltas[r] bytes from this rank's (int64 [world] on x's device, multiples of 16); rounds [rows]
    int32, zeroed. Every rank calls it with the same R <= rows."""
    r_rows, d = x.shape
    _, world, rows, _ = data.shape
    assert r_rows <= rows == rounds.numel() and data.shape == (ROUNDS, world, rows, d) and weight.shape == (d,)
    assert data.dtype == x.dtype and rounds.dtype == torch.int32 and deltas.numel() == world
    assert order is None or (order.shape == (d,) and order.dtype == torch.int32)
    assert x.stride(-1) == 1 and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
    y = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    h = torch.empty_like(x)
    r = residual if residual is not None else x
    block = triton.next_power_of_2(d)
    _all_reduce_norm_kernel[(r_rows,)](
        x, r, weight, y, h, rounds if order is None else order, rounds, data, deltas, rank, d, eps, rows,
        x.stride(0), r.stride(0), y.stride(0), h.stride(0),
        WORLD=world, BLOCK_D=block, HAS_RESIDUAL=residual is not None, HAS_ORDER=order is not None,
        num_warps=min(16, max(1, block // 256)), **pdl_launch(device_caps(x.device)))
    return y, h


def empty_buffer(data: torch.Tensor) -> torch.Tensor:
    """Fill a buffer's slots with the sentinel -0.0 (every slot empty), as the first call needs them."""
    itype = {2: torch.int16, 4: torch.int32}[data.element_size()]
    data.view(itype).fill_(sentinel_bits(data.dtype))
    return data
