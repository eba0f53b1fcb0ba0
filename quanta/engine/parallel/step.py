"""What rank 0 tells the other tensor-parallel ranks to run, one message per step (vLLM's
broadcast_tensor_dict, in two parts): a small header over the gloo group -- the step's kind and sizes,
its scalars and the rows that get logits -- then the step's integers as tensors over the device group.

  eager   input ids, positions, slot mapping, block tables, sequence lengths and query starts packed
          into one int64 tensor, unpacked by the header's shapes into the same ForwardBatch;
  graph   the decode graph's two static input buffers, broadcast straight into the workers' own;
  None    stop: rank 0 is closing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from quanta.engine.forward_batch import ForwardBatch
from quanta.engine.kv_cache import PagedKVCache
from quanta.engine.parallel.group import TensorParallel

# ForwardBatch's tensor fields in the eager message, after input_ids and positions, with their dtypes.
FIELDS = (("slot_mapping", torch.int64), ("block_tables", torch.int32), ("seq_lens", torch.int32),
          ("query_start_loc", torch.int32), ("prefill_start_loc", torch.int32))


@dataclass
class Step:
    """One received step: an eager batch (fb, input_ids, positions) or a graph replay (bucket, n)."""
    rows: list[int]
    fb: ForwardBatch | None = None
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    bucket: int = 0
    n: int = 0


def _header(tp: TensorParallel, header=None):
    box = [header]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


def send_eager(tp: TensorParallel, fb: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
               rows: list[int]) -> None:
    """Rank 0: the eager step about to run."""
    tensors = [input_ids, positions] + [getattr(fb, name) for name, _ in FIELDS]
    present = [t for t in tensors if t is not None]
    shapes = [None if t is None else tuple(t.shape) for t in tensors]
    _header(tp, ("eager", shapes, fb.num_decodes, fb.max_query_len, fb.num_splits, fb.calibrate, rows))
    dist.broadcast(torch.cat([t.reshape(-1).to(torch.int64) for t in present]), src=0)


def send_graph(tp: TensorParallel, bucket: int, n: int, used: int, rows: list[int],
               static_i64: torch.Tensor, static_i32: torch.Tensor) -> None:
    """Rank 0: the decode graph of `bucket` about to replay for `n` sequences, its inputs copied in."""
    _header(tp, ("graph", bucket, n, used, rows))
    dist.broadcast(static_i64, src=0)
    dist.broadcast(static_i32[:used], src=0)


def send_stop(tp: TensorParallel) -> None:
    """Rank 0: no more steps; the workers leave their loop."""
    _header(tp, None)


def receive(tp: TensorParallel, kv_cache: PagedKVCache, sliding_window: int | None, device: torch.device,
            static: tuple[torch.Tensor, torch.Tensor] | None = None) -> Step | None:
    """A worker: the next step (a graph step's inputs land in `static`, the graph's buffers), or None."""
    header = _header(tp)
    if header is None:
        return None
    if header[0] == "graph":
        _, bucket, n, used, rows = header
        dist.broadcast(static[0], src=0)
        dist.broadcast(static[1][:used], src=0)
        return Step(rows, bucket=bucket, n=n)
    _, shapes, num_decodes, max_query_len, num_splits, calibrate, rows = header
    sizes = [0 if s is None else int(torch.Size(s).numel()) for s in shapes]
    packed = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(packed, src=0)
    parts, at = [], 0
    for shape, size, dtype in zip(shapes, sizes, [torch.long, torch.long] + [d for _, d in FIELDS]):
        parts.append(None if shape is None else packed[at:at + size].view(shape).to(dtype))
        at += size
    input_ids, positions, *fields = parts
    if calibrate:
        kv_cache.claim_calibration()
    fb = ForwardBatch(kv_cache, *fields, num_decodes=num_decodes, max_query_len=max_query_len,
                      num_splits=num_splits, sliding_window=sliding_window, calibrate=calibrate)
    return Step(rows, fb, input_ids, positions)
