"""The small all-reduces of tensor-parallel decode as one-shot reductions over symmetric memory, each fused
with the residual add and RMSNorm that follow it (OneShotAllReduceNorm over kernels/all_reduce_norm.py).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from quanta.kernels import all_reduce_norm

MAX_BYTES = 128 * 1024
log = logging.getLogger(__name__)


class OneShotAllReduceNorm:
    """(y, h) = (norm(sum over ranks of x + residual), sum + residual) for small x, in one kernel. Build it on
    every rank at the same point (the buffer's rendezvous is collective); `usable(x)` says whether `x` may go
    through it, and every rank must make the same calls over the same rows.

    A decode step all-reduces one [batch, hidden] block after every row-parallel layer (o_proj, down_proj) and
    the vocab-parallel embedding, and an RMSNorm always reads the sum next. Each block is a few KB, so each
    all-reduce costs its latency, not its bytes. NCCL's ring pays a protocol's handshakes for each; a one-shot
    all-reduce (vLLM's custom all-reduce, torch's symm_mem.one_shot_all_reduce) has every rank put its block
    where every peer can read it over NVLink, meet the peers at one barrier, and sum all blocks itself. Done
    inside the norm's kernel, the staging copy, the reduction, the cast back and the norm are one kernel
    instead of four. It reads world x the message, so it pays only for small messages; past MAX_BYTES (the
    threshold torch's compiler uses for the same choice) NCCL's all-reduce and the norm kernel run.

    The symmetric buffer, one per rank at the same layout: three rounds of [world, rows, hidden] slots in the
    model's dtype, each rank's row of each round in its own slot, an empty slot holding -0.0 (the kernel's
    Lamport scheme: the data is its own flag). The kernel holds its barrier in itself, so the decode CUDA graphs
    capture it. NVLink multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST, which shared hosts require)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, hidden: int):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.dtype, self.hidden = dtype, hidden
        self.rows = max(1, MAX_BYTES // (hidden * dtype.itemsize))
        shape = (all_reduce_norm.ROUNDS, self.world, self.rows, hidden)
        self.buffer = symm_mem.empty(shape, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        # the buffer may sit at an offset in its allocation, the same on every rank
        self.deltas = torch.tensor([p - handle.buffer_ptrs[self.rank] for p in handle.buffer_ptrs],
                                   dtype=torch.int64, device=device)
        all_reduce_norm.empty_buffer(self.buffer)
        self.rounds = torch.zeros(self.rows, dtype=torch.int32, device=device)
        # no rank stores into a peer's buffer before that peer has emptied it: the collective below is
        # ordered after each rank's fill on its stream, and every later kernel after the collective
        done = torch.ones(1, device=device)
        dist.all_reduce(done, group=group)

    def usable(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.dim() == 2 and x.shape[0] <= self.rows and x.shape[1] == self.hidden
                and x.is_contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, order: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, hidden] this rank's partial sum -> (the norm of the total plus residual, that sum); the norm's
        columns in `order` where it is given (fused_norm)."""
        return all_reduce_norm.all_reduce_norm(x, residual, weight, eps, rank=self.rank, data=self.buffer,
                                               deltas=self.deltas, rounds=self.rounds, order=order)


def _check(reducer: OneShotAllReduceNorm, device: torch.device) -> bool:
    """A known sum, once in each round: every rank adds rank + 1 to a residual of ones."""
    rows = min(2, reducer.rows)
    x = torch.full((rows, reducer.hidden), float(reducer.rank + 1), dtype=reducer.dtype, device=device)
    ones = torch.ones_like(x)
    weight = torch.ones(reducer.hidden, dtype=reducer.dtype, device=device)
    want = reducer.world * (reducer.world + 1) // 2 + 1
    ok = True
    for _ in range(all_reduce_norm.ROUNDS):
        y, h = reducer(x, ones, weight, 1e-6)
        ok = ok and bool(torch.all(h == want)) and bool(torch.allclose(y.float(), torch.ones_like(y.float()),
                                                                       atol=1e-2))
    return ok


def start(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
          hidden: int) -> OneShotAllReduceNorm | None:
    """A checked OneShotAllReduceNorm for the group, or None where it cannot run here (not CUDA, no symmetric
    memory in this torch, GPUs without a peer path, a sum that comes out wrong), in which case NCCL and the
    norm kernel serve every all-reduce. Every rank calls it together and every rank gets the same answer."""
    world = dist.get_world_size(group)
    ok = device.type == "cuda" and all(torch.cuda.can_device_access_peer(device.index, peer)
                                       for peer in range(world) if peer != device.index)
    reducer, why = None, "not every pair of GPUs has a peer path"
    if ok:
        try:
            reducer = OneShotAllReduceNorm(group, device, dtype, hidden)
            ok, why = _check(reducer, device), "its check sum came out wrong"
        except Exception as e:                  # noqa: BLE001 -- any failure here means: use NCCL
            ok, why = False, f"{type(e).__name__}: {e}"
    agreed = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not int(agreed):
        if not ok:
            log.info("one-shot all-reduce unavailable (%s); NCCL serves every all-reduce", why)
        return None
    return reducer
