"""How many KV blocks the engine gets, and the check that they hold a sequence of max_model_len tokens.

With num_kv_blocks given, or on the CPU (kv_cache_memory bytes), the count follows from the config
alone, so an impossible configuration is refused before a weight is built. On a GPU the pool gets what
the memory plan's rule leaves (MemoryRequest.kv_cache_bytes) of the budget after the weights, the
activation peak of a dry run, memory held outside torch or reserved by torch in no tensor, and (unless
enforce_eager) head-room for the CUDA graphs' memory pool.
"""
from __future__ import annotations

import logging
import os

import torch

from quanta.engine.config import EngineConfig
from quanta.quant.errors import ConfigError

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30        # kv_cache_memory's default on the CPU


def blocks_from_config(cfg: EngineConfig, block_bytes: int) -> int | None:
    """The block count the config fixes (num_kv_blocks, or kv_cache_memory on the CPU); None on a GPU
    without num_kv_blocks, where it is measured after loading (blocks_from_gpu_memory)."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    if torch.device(cfg.device).type != "cuda":
        return (cfg.kv_cache_memory or CPU_KV_CACHE_BYTES) // block_bytes
    return None


def use_expandable_segments() -> None:
    """Let torch's allocator grow its segments in place and unmap their free pages (expandable_segments),
    unless the user configured the allocator. A load interleaves transient and kept tensors; in fixed
    segments the kept weights end up scattered with free holes between them that stay reserved, memory
    the KV sizing cannot give out and the device still counts against the cap."""
    configure = getattr(torch.cuda.memory, "_set_allocator_settings", None)      # torch's own, not public
    if configure is not None and not any(k in os.environ for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        configure("expandable_segments:True")


def blocks_from_gpu_memory(cfg: EngineConfig, block_bytes: int, weight_bytes: int, activation_peak: int) -> int:
    """This engine's share of the GPU (MemoryRequest.budget) less its weights, the activation peak, memory used
    outside torch, memory the allocator holds in no tensor (what empty_cache could not return) and the
    graph margin, in blocks of `block_bytes`."""
    device = torch.device(cfg.device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    non_torch = total - free - reserved
    idle = reserved - torch.cuda.memory_allocated(device)
    blocks = cfg.kv_cache_bytes(total, weight_bytes, activation_peak, non_torch, idle, cfg.graph_margin) // block_bytes
    log.info("KV cache: %d blocks (%.2f GiB); weights %.2f GiB, activation peak %.2f GiB", blocks,
             blocks * block_bytes / 2**30, weight_bytes / 2**30, activation_peak / 2**30)
    return blocks


def check_capacity(blocks: int, block_size: int, max_model_len: int) -> None:
    """ConfigError unless `blocks` blocks of `block_size` tokens hold one sequence of max_model_len."""
    if blocks * block_size < max_model_len:
        blocks = max(blocks, 0)
        raise ConfigError(f"the KV cache holds {blocks * block_size} tokens ({blocks} blocks "
                          f"of {block_size}), less than max_model_len={max_model_len}: lower "
                          "max_model_len or give the cache more memory (gpu_memory_utilization, "
                          "kv_cache_memory, num_kv_blocks)")
