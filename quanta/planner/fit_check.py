"""The engine's start-up check: the memory plan of its own configuration, before anything is loaded.

`check_fits` runs memory_plan.plan for what the engine is about to build (its MemoryRequest, the checkpoint's
shapes and format) on GPUs of the given total, and refuses a configuration that cannot fit with
`format_verdict`'s words, the same that `quanta plan --gpus CARD --max-gpu-memory CAP` prints.
`check_shardable` refuses a tensor-parallel size the model's sizes or groups cannot split. `out_of_memory`
turns a real CUDA out-of-memory error during start-up (the card holds less than it was told: another
process, fragmentation) into a ConfigError with that verdict.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import fields

import torch

from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.formats import Source
from quanta.planner.gpus import CARDS, MIB, Gpus
from quanta.planner.memory_plan import TP_SIZES, MemoryPlan, format_verdict, plan
from quanta.planner.request import MemoryRequest, PlanRequest
from quanta.planner.weight_bytes import size_problem
from quanta.quant.errors import ConfigError, UnsupportedError


def gpu_name(total: int) -> str:
    """How a card of `total` bytes is named: a known card whose reported total it is, else its size."""
    for name, (mib, _) in CARDS.items():
        if mib * MIB == total:
            return name
    return f"{total / 2**30:.4g}GiB"


def check_fits(request: MemoryRequest, tensor_parallel_size: int, model_config: ModelConfig, source: Source,
               gpu_total_bytes: int, name: str) -> MemoryPlan | None:
    """The plan of `request` for the model `name` (`model_config`, weights as `source` says) on
    tensor_parallel_size GPUs of `gpu_total_bytes` each, per rank; ConfigError with the plan's verdict when
    it does not fit. None when the plan cannot be made (a format the plan does not model)."""
    memory = {f.name: getattr(request, f.name) for f in fields(MemoryRequest)}
    cards = Gpus(gpu_name(gpu_total_bytes), tensor_parallel_size, gpu_total_bytes)
    try:
        p = plan(model_config, PlanRequest(**memory, gpus=cards, tensor_parallel_size=tensor_parallel_size),
                 source=source, name=name)
    except UnsupportedError:
        return None
    if not p.fits:
        raise ConfigError(format_verdict(p))
    return p


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


def check_shardable(config: ModelConfig, world: int, name: str) -> None:
    """ConfigError, before anything is loaded, when the model's sizes cannot be split over `world` ranks (heads,
    KV heads, intermediate size, vocabulary), naming the sizes that would work. A group or block that straddles
    two ranks is held whole by both (shard.widened_cols); a cut only the load can find (a row block of an fp8
    weight split across ranks) is refused there (shard.ShardError)."""
    why = size_problem(config, world)
    if why is not None:
        works = [t for t in TP_SIZES if size_problem(config, t) is None]
        raise ConfigError(f"{name} cannot run at tensor_parallel_size={world}: {why}; sizes that would: "
                          f"{', '.join(map(str, works)) or 'none'}")
