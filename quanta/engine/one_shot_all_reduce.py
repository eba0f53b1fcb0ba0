"""The small all-reduces of tensor-parallel decode as one-shot reductions over symmetric memory.

A decode step all-reduces one [batch, hidden] block after every row-parallel layer, two a layer: a few
KB each, so each costs its latency, not its bytes. NCCL's ring pays a protocol's handshakes for each; a
one-shot all-reduce (vLLM's custom all-reduce, torch's symm_mem.one_shot_all_reduce) has every rank
put its block in a buffer that every peer can read over NVLink, meet the peers at one barrier, and sum
all blocks itself: one kernel, no round trips. It reads world x the message, so it pays only for small
messages; past MAX_BYTES (the threshold torch's compiler uses for the same choice) NCCL runs.

torch's one-shot kernel sums float32 and bfloat16; a float16 block is staged in a float32 buffer, which
also keeps the sum in float32 before its one rounding back. The kernel holds its barrier inside itself,
so it is captured in the decode CUDA graphs as NCCL's all-reduce is. NVLink multicast is never used
(TORCH_SYMM_MEM_DISABLE_MULTICAST, which shared hosts require).
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

MAX_BYTES = 128 * 1024
SUMMED_DTYPES = (torch.float32, torch.bfloat16)   # what torch's one-shot kernel reduces
log = logging.getLogger(__name__)


class OneShotAllReduce:
    """Sum of a small tensor over the group's ranks, one kernel. Build it on every rank at the same point
    (the buffer's rendezvous is collective); `usable(x)` says whether `x` may go through it."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem
        self.dtype = dtype
        self.buffer_dtype = dtype if dtype in SUMMED_DTYPES else torch.float32
        self.group_name = group.group_name
        self.capacity = MAX_BYTES // dtype.itemsize                 # elements of the model's dtype
        self.buffer = symm_mem.empty(self.capacity, dtype=self.buffer_dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def usable(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.capacity and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, a new tensor of x's shape and dtype (x is left as it was)."""
        staged = self.buffer[:x.numel()]
        staged.copy_(x.view(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        return out.view(x.shape).to(x.dtype)


def start(group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype) -> OneShotAllReduce | None:
    """A checked OneShotAllReduce for the group, or None where it cannot run here (not CUDA, no symmetric
    memory in this torch, GPUs without a peer path, a sum that comes out wrong), in which case NCCL
    serves every all-reduce. Every rank calls it together and every rank gets the same answer."""
    world = dist.get_world_size(group)
    ok = device.type == "cuda" and all(torch.cuda.can_device_access_peer(device.index, peer)
                                       for peer in range(world) if peer != device.index)
    reducer, why = None, "not every pair of GPUs has a peer path"
    if ok:
        try:
            reducer = OneShotAllReduce(group, device, dtype)
            probe = torch.full((4, 8), float(dist.get_rank(group) + 1), dtype=dtype, device=device)
            ok = bool(torch.all(reducer(probe) == world * (world + 1) // 2))
            why = "its check sum came out wrong"
        except Exception as e:                  # noqa: BLE001 -- any failure here means: use NCCL
            ok, why = False, f"{type(e).__name__}: {e}"
    agreed = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not int(agreed):
        if not ok:
            log.info("one-shot all-reduce unavailable (%s); NCCL serves every all-reduce", why)
        return None
    return reducer
