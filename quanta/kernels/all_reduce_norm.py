"""The sum of a row-parallel layer's partial outputs over the tensor-parallel ranks, fused with the residual
add and the RMSNorm that follow it: one kernel where unfused decode runs four (stage, all-reduce, cast, norm).

    s = sum over ranks of x (float32, in rank order, rounded once);  h = s + residual (when given);
    y = weight * (h.float() * rsqrt(mean(h**2) + eps)).to(dtype)
returns (y, h): fused_norm's outputs for the all-reduced x, and with no residual h = s.

Every rank runs the kernel on its own x over the same rows. One program per row:
  1. it writes its row into its own symmetric buffer, which every peer can read (NVLink peer memory);
  2. it raises its flag for the row in every rank's flag array (a release store at system scope: the row's
     stores are visible to a peer that sees the flag) and spins until each peer's flag for the row has
     reached this call's epoch (an acquire at system scope);
  3. it reads the row from every rank's buffer, sums, adds the residual and normalizes.
The epoch is a per-row call counter each rank keeps on its GPU; every rank runs the same calls over the same
rows, so the counters agree. Calls alternate between two data slots by epoch: a rank may write slot e % 2
again at epoch e + 2 only after every peer has raised its epoch e + 1 flag, which each peer does after it
has finished reading epoch e's slot, so no row is overwritten while a peer still reads it, and no barrier
is needed at the end of the kernel. Flags compare by signed difference, so the counter may wrap.

Every rank's buffer has the same layout (engine/one_shot_all_reduce.py's symmetric buffer); the kernel
finds a peer's by the byte distance of its buffer from this rank's. The kernel holds its barrier in itself,
so CUDA graphs capture it as any kernel.
"""
from __future__ import annotations

import torch

from quanta.kernels.device_caps import device_caps
from quanta.kernels.fused_norm import add_rms_norm
from quanta.kernels.fused_norm import reference as norm_reference
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait, tl, triton

NAME = "triton_all_reduce_norm"


def reference(parts: list[torch.Tensor], weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The ranks' partial outputs `parts` (rank order) -> (y, h), as the kernel computes them."""
    s = torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
    if residual is None:
        return norm_reference(s, weight, eps), s
    return norm_reference(s, weight, eps, residual)


@triton.jit
def _peer(ptr, deltas, rank, unit: tl.constexpr):
    """`ptr` (into this rank's buffer) moved to the same place in `rank`'s buffer: deltas[rank] bytes on,
    in elements of `unit` bytes. Every buffer starts on a 16-byte boundary, which lets rows be read and
    written 16 bytes at a time."""
    return ptr + tl.multiple_of(tl.load(deltas + rank) // unit, 16 // unit)


@triton.jit
def _lag(flags, is_rank, epoch):
    """The slowest rank's flag minus `epoch` (0 once every rank has reached it), read with acquire at system
    scope (an atomic add of 0: Triton's atomics carry the memory order, its loads do not)."""
    seen = tl.atomic_add(flags, tl.zeros_like(is_rank.to(tl.int32)), mask=is_rank, sem="acquire", scope="sys")
    return tl.min(tl.where(is_rank, seen - epoch, 0), axis=0)


@triton.jit
def _all_reduce_norm_kernel(
    # this rank's tensors, its buffer's flags and data
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, epoch_ptr, flag_ptr, data_ptr,
    # every rank's buffer's address less this rank's, in bytes (int64 [WORLD])
    deltas,
    # sizes
    rank, D, eps, slot_elems,
    # strides (rows)
    stride_x, stride_r, stride_y, stride_h,
    # meta
    WORLD: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per row of D features (BLOCK_D >= D: the row stays in registers; BLOCK_W >= WORLD)."""
    pdl_launch_dependents(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    ranks = tl.arange(0, BLOCK_W)
    is_rank = ranks < WORLD
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)       # a weight: no predecessor wrote it
    pdl_wait(PDL)
    dtype = x_ptr.dtype.element_ty
    epoch = tl.load(epoch_ptr + row) + 1
    at = (epoch & 1) * slot_elems + row * D
    # --- 1. this rank's row into its own buffer
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    tl.store(data_ptr + at + offs, x, mask=mask)
    tl.debug_barrier()
    # --- 2. raise this rank's flag for the row everywhere, then wait for every rank's
    theirs = flag_ptr + tl.load(deltas + ranks, mask=is_rank, other=0) // 4 + row * WORLD + rank
    tl.atomic_xchg(theirs, tl.full([BLOCK_W], 0, tl.int32) + epoch, mask=is_rank, sem="release", scope="sys")
    while _lag(flag_ptr + row * WORLD + ranks, is_rank, epoch) < 0:
        pass
    tl.debug_barrier()
    # --- 3. the sum in rank order (the same number on every rank), the residual, the norm
    acc = tl.zeros([BLOCK_D], tl.float32)
    for r in tl.static_range(WORLD):
        src = _peer(data_ptr, deltas, r, dtype.primitive_bitwidth // 8)
        acc += tl.load(src + at + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    h, y = add_rms_norm(acc.to(dtype), r_ptr + row * stride_r + offs, w, mask, D, eps, HAS_RESIDUAL)
    tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(epoch_ptr + row, epoch)


def all_reduce_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                    rank: int, flags: torch.Tensor, data: torch.Tensor, deltas: torch.Tensor,
                    epochs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, D] this rank's partial rows (and residual, same shape) -> (y, h) as `reference` over all ranks'
    x. This rank's buffer: flags [rows, world] int32 and data [2, rows, D] of x's dtype, every rank's at
    deltas[r] bytes from this rank's (int64 [world] on x's device, multiples of 16), epochs [rows] int32.
    Every rank calls it with the same R <= rows."""
    rows, d = x.shape
    world = flags.shape[1]
    assert rows <= epochs.numel() == flags.shape[0] == data.shape[1] and data.shape[2] == d and weight.shape == (d,)
    assert data.dtype == x.dtype and flags.dtype == torch.int32 and deltas.numel() == world
    assert x.stride(-1) == 1 and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))
    y = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    h = torch.empty_like(x)
    r = residual if residual is not None else x
    block = triton.next_power_of_2(d)
    _all_reduce_norm_kernel[(rows,)](
        x, r, weight, y, h, epochs, flags, data, deltas, rank, d, eps, data[0].numel(),
        x.stride(0), r.stride(0), y.stride(0), h.stride(0),
        WORLD=world, BLOCK_W=triton.next_power_of_2(world), BLOCK_D=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)), **pdl_launch(device_caps(x.device)))
    return y, h
