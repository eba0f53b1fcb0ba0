"""The engine's start-up check: the memory plan of its own configuration, before anything is loaded.

`check_fits` runs memory_plan.plan for what the engine is about to build (the checkpoint's shapes and
format, the KV dtype, max_model_len, batch limits) on one GPU of the given total, capped at
max_gpu_memory, and refuses a configuration that cannot fit with `format_verdict`'s words, the same
that `quanta plan` prints. `plan_source` says what a checkpoint's weights are as the plan reads them.
`out_of_memory` turns a real CUDA out-of-memory error during start-up (the plan said it fits, but the
card holds less than it was told: another process, fragmentation) into a ConfigError with that verdict.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from quanta.engine.config import EngineConfig
from quanta.engine.gpus import CARDS, MIB, Gpus
from quanta.engine.memory_plan import MemoryPlan, format_verdict, plan
from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.quant.errors import ConfigError, UnsupportedError


def gpu_name(total: int) -> str:
    """How a card of `total` bytes is named: a known card whose reported total it is, else its size."""
    for name, (mib, _) in CARDS.items():
        if mib * MIB == total:
            return name
    return size_name(total)


def size_name(size: int) -> str:
    """`size` bytes as `quanta plan --gpus` takes it: 15GiB, 23.5GiB."""
    return f"{size / 2**30:.4g}GiB"


def check_fits(cfg: EngineConfig, model_config: ModelConfig, source: dict[str, Any],
               gpu_total_bytes: int) -> MemoryPlan | None:
    """The plan of `cfg` on one GPU of `gpu_total_bytes` (its budget gpu_memory_utilization x total, at
    most max_gpu_memory, as kv_sizing.gpu_budget); ConfigError with the plan's verdict when it does not
    fit. None when the plan cannot be made from the config (a format the plan does not model). Capped,
    the plan is made for a card of max_gpu_memory bytes used whole (`quanta plan --gpus 1xSIZE
    --gpu-memory-utilization 1` gives the same words); otherwise the card is named as `--gpus` names it.
    `source`: what the checkpoint says about its weights (plan_source). Under tensor parallelism the plan
    is per rank: tensor_parallel_size cards of this one's size, each holding its shard."""
    tp = cfg.tensor_parallel_size
    if cfg.max_gpu_memory is not None and cfg.max_gpu_memory < gpu_total_bytes * cfg.gpu_memory_utilization:
        cards, utilization = Gpus(size_name(cfg.max_gpu_memory), tp, cfg.max_gpu_memory), 1.0
    else:
        cards, utilization = Gpus(gpu_name(gpu_total_bytes), tp, gpu_total_bytes), cfg.gpu_memory_utilization
    dtype = str(cfg.dtype).removeprefix("torch.")
    try:
        p = plan(model_config, "auto", gpus=cards, kv_cache_dtype=cfg.kv_cache_dtype,
                 max_model_len=cfg.max_model_len, tensor_parallel_size=tp, max_num_seqs=cfg.max_num_seqs,
                 max_num_batched_tokens=cfg.max_num_batched_tokens, gpu_memory_utilization=utilization,
                 dtype=dtype, enforce_eager=cfg.enforce_eager, block_size=cfg.block_size, source=source,
                 name=str(cfg.model))
    except UnsupportedError:
        return None
    if not p.fits:
        raise ConfigError(format_verdict(p))
    return p


def plan_source(ckpt: Checkpoint) -> dict[str, Any]:
    """What `ckpt` says about its weights in model_shapes.resolve's terms: the family, its quantization
    config, a GGUF file's per-tensor types (read from its header) or a synthetic model's format."""
    if ckpt.format == "synthetic":
        return {"family": "synthetic", "format": ckpt.quant_config["synthetic"]}
    if ckpt.format == "gguf":
        from quanta.engine.model_shapes import resolve
        return resolve(ckpt.path)[1]
    if ckpt.format == "hf":
        return {"family": "hf"}
    return {"family": ckpt.format, "quant_config": dict(ckpt.quant_config)}


def device_total(device: torch.device) -> int | None:
    """The driver's total memory of a CUDA `device`; None elsewhere (no plan is made on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[1]


@contextlib.contextmanager
def out_of_memory(what: str, plan: MemoryPlan | None) -> Iterator[None]:
    """Run the block; a torch.cuda.OutOfMemoryError in it becomes a ConfigError naming `what` the engine
    was doing, the allocator's words and the memory plan's verdict (`plan`: check_fits' result), with
    what to change. The OOM's traceback is dropped (`from None`): its frames would keep the half-built
    tensors alive."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        reason = str(e).splitlines()[0] if str(e) else "CUDA out of memory"
        verdict = (f"the memory plan for this configuration: {format_verdict(plan)}" if plan is not None
                   else "no memory plan could be made for this checkpoint's format")
        error = ConfigError(f"out of GPU memory while {what} ({reason}); {verdict}. The card may hold less than "
                            f"the plan assumes (another process, fragmentation): lower gpu_memory_utilization, "
                            f"max_model_len or max_num_seqs, or set max_gpu_memory / num_kv_blocks")
    else:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    raise error from None
