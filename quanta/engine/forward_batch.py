"""ForwardBatch: one step's attention metadata, handed to the model explicitly as its attention
context. Sequences are ordered decodes first (one query each), then prefill chunks; `attend` stores
the step's K/V in the paged cache and runs the decode and prefill kernels over their parts (on the CPU, the native
layer_ops' batch-invariant rows, or cpu_attention's row blocks without them); `rope_store` lets the q/k/v GEMM
store them itself, and `attend_cached` then attends."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quanta.engine.kv_cache import PagedKVCache
from quanta.kernels import paged_attention
from quanta.cpu import attention as cpu_attention, layer_ops as cpu_layer_ops
from quanta.kernels.rotary import RopeStore

ROPE_EPILOGUE = os.environ.get("QUANTA_ROPE_EPILOGUE", "1") != "0"      # 0: the rotary kernel after the GEMM


@dataclass(slots=True)
class ForwardBatch:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor          # [T] int64, < 0: padding (not stored)
    block_tables: torch.Tensor          # [B, max_blocks] int32
    seq_lens: torch.Tensor              # [B] int32: cached tokens after this step (0: padding)
    query_start_loc: torch.Tensor       # [B + 1] int32 over all sequences
    prefill_start_loc: torch.Tensor | None   # [B - num_decodes + 1] int32, the prefill part from 0
    num_decodes: int                    # the first num_decodes sequences have exactly one query
    max_query_len: int                  # over the prefill part
    num_splits: int                     # decode kernel's KV splits
    sliding_window: int | None = None
    calibrate: bool = False             # compute fp8 scales from this batch (first real prefill)
    cpu_plan: object = None             # the CPU path's rows (layer_ops.rows, or cpu_attention.plan), made at
                                        # layer 0 of each forward

    def rope_store(self, layer: int, rope: Callable | None, q_size: int, kv_size: int,
                   head_dim: int) -> RopeStore | None:
        """What a q/k/v GEMM needs to rotate q and k and store k and v itself (rotary.RopeStore), where this step
        allows it: the Triton rope and cache, and no fp8 scales being calibrated from this batch. Its output
        then goes to `attend_cached`."""
        cache = self.kv_cache
        if not ROPE_EPILOGUE or not self._stores_as_it_rotates(rope):
            return None
        k_cache, v_cache = cache.layer(layer)
        return RopeStore(rope.positions, rope.inv_freq.float().contiguous(), q_size, kv_size, head_dim, k_cache,
                         v_cache, self.slot_mapping, cache.k_scale[layer], cache.v_scale[layer], cache.fmt)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               rope: Callable | None = None) -> torch.Tensor:
        """Rotate q and k by `rope` (if given), store the step's k and v in the paged cache, attend. A rope
        that can store as it rotates (TritonRope) does both in one launch, except while the fp8 scales are
        being calibrated from this batch."""
        cache = self.kv_cache
        k_cache, v_cache = cache.layer(layer)
        if self._stores_as_it_rotates(rope):
            q = rope.rotate_and_store(q, k, v, k_cache, v_cache, self.slot_mapping, cache.k_scale[layer],
                                      cache.v_scale[layer], cache.fmt)
        elif (rotated := self._native_rope_store(q, k, v, rope, k_cache, v_cache)) is not None:
            q = rotated
        else:
            if rope is not None:
                q, k = rope(q, k)
            cache.write(layer, k, v, self.slot_mapping, self.calibrate)
        return self.attend_cached(layer, q, scale)

    def _native_rope_store(self, q, k, v, rope, k_cache, v_cache) -> torch.Tensor | None:
        """On the CPU, q rotated with k rotated and stored, v stored, in one native call (layer_ops.rope_store: the
        same numbers as the torch rotation and store) where the step allows it: float32, a torch rope with its
        cos / sin, no fp8 scales being calibrated. Else None."""
        if self.kv_cache.triton or self.calibrate or getattr(rope, "cos", None) is None \
                or not cpu_layer_ops.usable(q):
            return None
        return cpu_layer_ops.rope_store(q, k, v, rope.cos, rope.sin, k_cache, v_cache, self.slot_mapping)

    def _stores_as_it_rotates(self, rope: Callable | None) -> bool:
        """Whether the step's k and v may be stored by the kernel that rotates them (a Triton rope and cache),
        not by the cache's own write: not while the fp8 scales are calibrated from this batch."""
        return getattr(rope, "rotate_and_store", None) is not None and self.kv_cache.triton and not self.calibrate

    def attend_cached(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of the step's (rotated) queries q [T, Hq, D] over the paged cache, which already holds the
        step's k and v."""
        cache = self.kv_cache
        k_cache, v_cache = cache.layer(layer)
        if not cache.triton:                    # the native rows where they run, else torch's row blocks
            native = cpu_layer_ops.usable(q)
            if layer == 0 or self.cpu_plan is None:
                self.cpu_plan = cpu_layer_ops.rows(self.block_tables, self.seq_lens, self.query_start_loc,
                                                   self.sliding_window) if native else \
                    cpu_attention.plan(self.block_tables, self.seq_lens, self.query_start_loc, cache.block_size,
                                       self.sliding_window)
            attend = cpu_layer_ops.attention if native else cpu_attention.attend
            return attend(q, k_cache, v_cache, self.cpu_plan, scale, cache.k_scale[layer], cache.v_scale[layer],
                          cache.fmt)
        kw = dict(sliding_window=self.sliding_window, k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer],
                  fmt=cache.fmt)
        out = torch.empty_like(q)
        nd = self.num_decodes
        if nd:
            paged_attention.decode(q[:nd], k_cache, v_cache, self.block_tables[:nd], self.seq_lens[:nd], scale,
                                   num_splits=self.num_splits, out=out[:nd], **kw)
        if self.prefill_start_loc is not None:
            paged_attention.prefill(q[nd:], k_cache, v_cache, self.block_tables[nd:], self.seq_lens[nd:],
                                    self.prefill_start_loc, self.max_query_len, scale, out=out[nd:], **kw)
        return out
