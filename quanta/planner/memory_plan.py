"""Will it fit: weights, activations, CUDA graphs and KV cache per GPU, from a model's config alone.

    p = plan("llama-3-70b", quantization="awq", gpus="4x24GiB", kv_cache_dtype="fp8", max_model_len=8192)
    p.fits, p.kv_capacity_tokens, format_verdict(p)

The budget is the engine's own (MemoryRequest.budget: gpu_memory_utilization x the card's memory, capped at
max_gpu_memory), less the weights (weight_bytes.py), the activation peak of one step of max_num_batched_tokens
tokens, the CUDA graphs' margin and the runtime's own memory; what is left holds the paged KV cache. A plan
fits when that cache holds one sequence of max_model_len tokens, the engine's own check. When it does not
fit, each suggestion (another format, a larger tensor-parallel size, a shorter context, an fp8 KV cache) is
a plan re-run with that one change, kept only if it fits.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from quanta.kernels.device_caps import PRESETS
from quanta.kernels.paged_kv import KvFormat
from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.formats import Source
from quanta.loaders.weight_format import WeightFormat
from quanta.kernels.ggml.layout import LAYOUTS as GGML_LAYOUTS
from quanta.planner.activation import activation_peak
from quanta.planner.gpus import Gpus, parse_gpus
from quanta.planner.model_shapes import resolve
from quanta.planner.request import PlanRequest
from quanta.planner.scheme import parse_format
from quanta.planner.weight_bytes import (WeightBytes, cdiv, check_gguf_rows, load_peak, lora_slot_bytes, packs,
                                      shard, size_problem, weight_bytes)
from quanta.quant.errors import ConfigError
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME

GIB = 2**30
# CUDA context (with lazily loaded modules), cuBLAS / cuBLASLt handles and workspaces and Triton's
# loaded kernels: memory a process holds outside torch's allocator, which the engine measures as
# total - free - reserved once it runs. A stated constant here, since the plan runs before any GPU work.
RUNTIME_OVERHEAD = 512 * 2**20
# Under tensor parallelism each rank also holds NCCL's communicator outside torch: the channel buffers for
# every peer, for each protocol it may pick, plus the gloo group's host side (none on the device).
NCCL_OVERHEAD = 1 * GIB
SUGGESTED_FORMATS = ("fp8", "awq", "nf4")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Suggestion:
    """One change that makes the plan fit, and what the cache then holds."""
    what: str                                  # in words: "quantization awq (4-bit, groups of 128, ...)"
    change: tuple[tuple[str, Any], ...]        # PlanRequest fields it changes
    kv_capacity_tokens: int
    max_concurrent_seqs: int

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.change)


@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one configuration (bytes), its KV capacity and verdict."""
    model: str
    quantization: str
    gpus: str
    tensor_parallel_size: int
    gpu_memory: int                 # per card, the driver's total
    budget: int                     # gpu_memory_utilization x gpu_memory, capped at max_gpu_memory
    weights: WeightBytes
    activation_peak: int
    cuda_graphs: int
    runtime_overhead: int
    kv_cache_dtype: str
    kv_bytes_per_token: int
    kv_cache_bytes: int             # what is left for the cache (0 when nothing is)
    kv_capacity_tokens: int         # whole blocks of block_size tokens
    max_model_len: int
    max_concurrent_seqs: int        # sequences of max_model_len at once (KV-bound, capped by max_num_seqs)
    fits: bool
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()
    load_peak: int = 0              # device bytes at the height of the load (weight_bytes.load_peak)
    capped: bool = False            # the budget is max_gpu_memory, not the utilization share
    lora_slots: int = 0             # adapter slots (enable_lora: max_loras x every layer's A and B)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV cache."""
        return self.weights.total + self.activation_peak + self.cuda_graphs + self.runtime_overhead + self.lora_slots

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["weights"]["total"] = self.weights.total
        for s, d in zip(self.suggestions, out["suggestions"]):
            d["change"] = s.kwargs
        return out


def plan(model: str | ModelConfig, request: PlanRequest | None = None, *, source: Source | None = None,
         name: str | None = None, **fields: Any) -> MemoryPlan:
    """The memory plan of serving `model` (a known shape name, config.json, checkpoint directory, GGUF file,
    synthetic spec or ModelConfig) as `request` asks (or a PlanRequest of `fields`), with suggestions when it
    does not fit (see the module docstring). ConfigError for impossible requests (an unknown model or GPU, a
    split that cuts heads or quantization groups), naming what would work; UnsupportedError when quantization
    auto meets a checkpoint format the plan does not model. `source`: where a ModelConfig's weights come from
    (quantization auto then means its format); `name`: how the verdict names the model."""
    if request is None:
        request = PlanRequest(**fields)
    elif fields:
        request = replace(request, **fields)
    config, found = resolve(model)
    source = found if source is None else source
    name = name or (config.model_type if isinstance(model, ModelConfig) else str(model))
    result = _plan(name, config, source, request)
    if result.fits:
        return result
    return replace(result, suggestions=tuple(_suggestions(name, config, source, request, result)))


def _plan(name: str, config: ModelConfig, source: Source, r: PlanRequest) -> MemoryPlan:
    """One plan, without suggestions."""
    cards = parse_gpus(r.gpus)
    fmt = parse_format(r.quantization, r.bits, r.group_size, config, source)
    check_gguf_rows(config, fmt)
    tp = cards.count if r.tensor_parallel_size is None else r.tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or tp > cards.count:
        raise ConfigError(f"tensor_parallel_size={tp} needs 1..{cards.count} GPUs ({cards} given)")
    problem = size_problem(config, tp)
    if problem is not None:
        works = [t for t in TP_SIZES if size_problem(config, t) is None]
        raise ConfigError(f"{name} ({fmt.describe()}) cannot run at tensor_parallel_size={tp}: {problem}; "
                          f"sizes that would: {', '.join(map(str, works)) or 'none'}")
    length = config.max_position_embeddings if r.max_model_len is None else r.max_model_len
    if not 1 <= length <= config.max_position_embeddings:
        raise ConfigError(f"max_model_len={length} must be between 1 and the model's max_position_embeddings="
                          f"{config.max_position_embeddings}")
    e, s = r.element_bytes, shard(config, tp)
    weights = weight_bytes(config, fmt, s, e)
    w8a8 = cards.caps is not None and PRESETS[cards.caps].fp8      # fp8 weights meet fp8 activations
    quantized = (fmt.kind == "gguf" or packs(fmt, config.hidden_size)) and (fmt.kind != "fp8" or not w8a8)
    peak = activation_peak(config, s.q, s.kv, s.inter, r.max_num_batched_tokens,
                           min(r.max_num_batched_tokens, r.max_num_seqs), e, quantized)
    graphs, budget = r.graph_margin, r.budget(cards.memory)
    kv: KvFormat = r.kv_cache_dtype
    per_token = kv.bytes_per_token(config.num_hidden_layers, s.kv_heads, config.head_dim, e)
    runtime = RUNTIME_OVERHEAD + (NCCL_OVERHEAD if tp > 1 else 0)
    lora = lora_slot_bytes(config, s, r.max_loras, r.max_lora_rank, e) if r.enable_lora else 0
    kv_bytes = r.kv_cache_bytes(cards.memory, weights.total, peak, graphs, runtime, lora)
    blocks = kv_bytes // (per_token * r.block_size)
    seqs = blocks // cdiv(length, r.block_size)
    return MemoryPlan(
        model=name, quantization=fmt.describe(), gpus=str(cards), tensor_parallel_size=tp, gpu_memory=cards.memory,
        budget=budget, weights=weights, activation_peak=peak, cuda_graphs=graphs, runtime_overhead=runtime,
        kv_cache_dtype=kv.name, kv_bytes_per_token=per_token, kv_cache_bytes=kv_bytes,
        kv_capacity_tokens=blocks * r.block_size, max_model_len=length,
        max_concurrent_seqs=min(seqs, r.max_num_seqs), fits=seqs >= 1,
        notes=tuple(_notes(config, fmt, cards, s, e)), load_peak=load_peak(config, fmt, s, e),
        capped=budget < int(cards.memory * r.gpu_memory_utilization), lora_slots=lora)


def _notes(config: ModelConfig, fmt: WeightFormat, cards: Gpus, s, e: int) -> list[str]:
    notes = []
    unpacked = sorted(t for t in set(fmt.gguf.types.values())
                      if GGML_TYPES_BY_NAME[t].affine is None and t not in GGML_LAYOUTS) if fmt.kind == "gguf" else []
    if unpacked:
        notes.append(f"GGUF types that neither the affine nor the ggml kernels run ({', '.join(unpacked)}) "
                     f"are held dequantized ({8 * e}-bit) on CUDA")
    if fmt.name in ("fp32", "float32") and e == 2:
        notes.append("fp32 weights are held in the 16-bit compute dtype (dtype auto); dtype float32 keeps them")
    if fmt.kind == "affine" and not packs(fmt, config.hidden_size):
        notes.append(f"{fmt.describe()} has no packing kernel (4- or 8-bit, groups a multiple of 16): "
                     f"held dequantized at {8 * e} bits")
    if config.tie_word_embeddings:
        notes.append("tied embeddings: the engine loads the lm_head as a second copy of the table")
    if s.kv_heads * s.tp > config.num_key_value_heads:
        notes.append(f"{config.num_key_value_heads} KV heads over {s.tp} ranks: each rank holds a replica of one")
    if s.tp < cards.count:
        notes.append(f"tensor-parallel size {s.tp} uses {s.tp} of the {cards.count} GPUs")
    return notes


def _suggestions(name: str, config: ModelConfig, source: Source, request: PlanRequest,
                 current: MemoryPlan) -> list[Suggestion]:
    """Single changes that make the request fit, each checked by re-running the plan."""
    cards = parse_gpus(request.gpus)
    tries: list[tuple[str, dict[str, Any]]] = []
    for q in SUGGESTED_FORMATS:
        tries.append((f"quantization {q}", dict(quantization=q, bits=None, group_size=None)))
    for tp in TP_SIZES:
        if tp > current.tensor_parallel_size:
            gpus = f"{max(tp, cards.count)}x{cards.name}"
            tries.append((f"{gpus} at tensor-parallel size {tp}", dict(gpus=gpus, tensor_parallel_size=tp)))
    if current.kv_capacity_tokens >= request.block_size:
        step = 1024 if current.kv_capacity_tokens >= 1024 else request.block_size
        length = min(current.kv_capacity_tokens // step * step, current.max_model_len - 1)
        tries.append((f"max_model_len {length}", dict(max_model_len=length)))
    if request.kv_cache_dtype.fp8 is None:
        tries.append(("kv_cache_dtype fp8", dict(kv_cache_dtype="fp8")))
    found, tp_found = [], False
    for what, change in tries:
        if "tensor_parallel_size" in change and tp_found:
            continue
        try:
            p = _plan(name, config, source, replace(request, **change))
        except ConfigError:
            continue
        if not p.fits or ("quantization" in change and p.weights.total >= current.weights.total):
            continue
        if "quantization" in change:
            what = f"quantization {p.quantization}"
        tp_found = tp_found or "tensor_parallel_size" in change
        found.append(Suggestion(what, tuple(change.items()), p.kv_capacity_tokens, p.max_concurrent_seqs))
    return found


def format_verdict(p: MemoryPlan) -> str:
    """The verdict in words, the same for `quanta plan` and the engine's start-up refusal."""
    cap = f" capped at {p.budget / GIB:.4g} GiB each" if p.capped else ""
    where = f"{p.model} ({p.quantization}) on {p.gpus}{cap} at tensor-parallel size {p.tensor_parallel_size}"
    if p.fits:
        slots = f" and {p.lora_slots / GIB:.2f} GiB of LoRA slots" if p.lora_slots else ""
        return (f"fits: {where}: {p.weights.total / GIB:.2f} GiB of weights{slots} per GPU, KV cache for "
                f"{p.kv_capacity_tokens:,} tokens ({p.max_concurrent_seqs} sequences of {p.max_model_len:,} "
                f"tokens at once)")
    if p.kv_cache_bytes == 0:
        why = (f"{p.weights.total / GIB:.2f} GiB of weights per GPU and {(p.fixed_bytes - p.weights.total) / GIB:.2f}"
               f" GiB of activations, CUDA graphs, runtime and LoRA slots leave nothing for the KV cache in the "
               f"{p.budget / GIB:.2f} GiB budget ("
               + ("max_gpu_memory)" if p.capped else f"{p.budget / p.gpu_memory:.2g} of {p.gpu_memory / GIB:.2f} GiB)"))
    else:
        why = (f"the KV cache holds {p.kv_capacity_tokens:,} tokens, fewer than max_model_len="
               f"{p.max_model_len:,}")
    fixes = "; ".join(s.what for s in p.suggestions)
    return f"does not fit: {where}: {why}; " + (f"it would fit with {fixes}" if fixes else
                                                 "no single change of format, GPUs, context or KV dtype fits it")
