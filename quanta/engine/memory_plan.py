"""Will it fit: weights, activations, CUDA graphs and KV cache per GPU, from a model's config alone.

    p = plan("llama-3-70b", quantization="awq", gpus="4x24GiB", kv_cache_dtype="fp8", max_model_len=8192)
    p.fits, p.kv_capacity_tokens, format_verdict(p)

The budget is the engine's own (LLM._plan_kv_blocks): gpu_memory_utilization x the card's memory, less
the weights (weight_bytes.py), the activation peak of one step of max_num_batched_tokens tokens, the
CUDA graphs' margin and the runtime's own memory; what is left holds the paged KV cache. A plan fits
when that cache holds at least one sequence of max_model_len tokens, which is the engine's own check.
When it does not fit, each suggestion (another format, a larger tensor-parallel size, a shorter
context, an fp8 KV cache) is a plan re-run with that one change, kept only if it fits.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from quanta.loaders.gguf_mix import assign, from_file
from quanta.engine.gpus import Gpus, parse_gpus
from quanta.engine.kv_cache import KV_CACHE_DTYPES
from quanta.engine.kv_sizing import GRAPH_MEMORY_MARGIN
from quanta.engine.model_shapes import resolve
from quanta.engine.weight_bytes import (
    WeightBytes,
    WeightFormat,
    check_gguf_rows,
    cdiv,
    shard,
    load_peak,
    tp_problem,
    weight_bytes,
)
from quanta.kernels.affine.plan import CUBLAS_MIN_M
from quanta.kernels.device_caps import PRESETS
from quanta.loaders.checkpoint import ModelConfig
from quanta.quant.errors import ConfigError, UnsupportedError
from quanta.quant.ggml_types import GGML_TYPES_BY_NAME

GIB = 2**30
# CUDA context (with lazily loaded modules), cuBLAS / cuBLASLt handles and workspaces and Triton's
# loaded kernels: memory a process holds outside torch's allocator, which the engine measures as
# total - free - reserved once it runs. A stated constant here, since the plan runs before any GPU work.
RUNTIME_OVERHEAD = 512 * 2**20
# Under tensor parallelism each rank also holds NCCL's communicator outside torch: the channel buffers for
# every peer, for each protocol it may pick, plus the gloo group's host side (none on the device).
NCCL_OVERHEAD = 1 * GIB
LOGIT_ROW_COPIES = 4                 # float32 [rows, vocab] alive in sampling: logits, probs, noise, probs/noise
FORMATS = {"fp16": "dense", "float16": "dense", "bf16": "dense", "bfloat16": "dense", "fp32": "dense",
           "float32": "dense", "awq": "affine", "gptq": "affine", "nf4": "codebook", "fp8": "fp8"}
SUGGESTED_FORMATS = ("fp8", "awq", "nf4")
TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Suggestion:
    """One change that makes the plan fit, and what the cache then holds."""
    what: str                                  # in words: "quantization awq (4-bit, groups of 128, ...)"
    change: tuple[tuple[str, Any], ...]        # plan() keyword arguments it changes
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
    budget: int                     # gpu_memory_utilization x gpu_memory
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

    @property
    def fixed_bytes(self) -> int:
        """Everything but the KV cache."""
        return self.weights.total + self.activation_peak + self.cuda_graphs + self.runtime_overhead

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["weights"]["total"] = self.weights.total
        for s, d in zip(self.suggestions, out["suggestions"]):
            d["change"] = s.kwargs
        return out


def plan(model: str | ModelConfig, quantization: str = "auto", bits: int | None = None,
         group_size: int | None = None, gpus: str | Gpus = "1x80GiB", kv_cache_dtype: str = "auto",
         max_model_len: int | None = None, tensor_parallel_size: int | None = None, max_num_seqs: int = 256,
         max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.9, dtype: str = "auto",
         enforce_eager: bool = False, block_size: int = 16, source: dict[str, Any] | None = None,
         name: str | None = None) -> MemoryPlan:
    """The memory plan of serving `model` (a known shape name, config.json, checkpoint directory, GGUF
    file or ModelConfig) as described, with suggestions when it does not fit (see the module docstring).

    quantization: auto (the checkpoint's own; fp16 for a shape name), fp16 | bf16 | fp32, awq | gptq
    (4-bit, groups of 128 unless bits / group_size say otherwise; group_size -1: per channel), nf4, fp8,
    or gguf:TYPE (Q4_0 ... Q8_0, Q2_K ... Q6_K, Q3_K_M, Q4_K_M, Q5_K_M). gpus: NxSIZE, [Nx]NAME or a
    Gpus. tensor_parallel_size defaults to the number of GPUs; block_size is the KV cache's tokens per
    block. ConfigError for impossible requests (unknown model or GPU, a split that cuts heads or
    quantization groups), naming what would work. `source` (with a ModelConfig): what its checkpoint says
    about its weights, as model_shapes.resolve's second value, so that quantization auto means the
    checkpoint's format; `name`: how the verdict names the model (default: `model` as given).
    """
    config, found = resolve(model)
    source = found if source is None else source
    request = dict(quantization=quantization, bits=bits, group_size=group_size, gpus=gpus,
                   kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                   tensor_parallel_size=tensor_parallel_size, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
                   dtype=dtype, enforce_eager=enforce_eager, block_size=block_size)
    name = name or (config.model_type if isinstance(model, ModelConfig) else str(model))
    result = _plan(name, config, source, **request)
    if result.fits:
        return result
    return replace(result, suggestions=tuple(_suggestions(name, config, source, request, result)))


def parse_format(quantization: str, bits: int | None, group_size: int | None, config: ModelConfig,
                 source: dict[str, Any]) -> WeightFormat:
    """The WeightFormat a quantization name (and bits / group overrides) stands for."""
    q = str(quantization).strip()
    if q.lower() == "auto":
        return _source_format(config, source, bits, group_size)
    if q.lower().startswith("gguf:"):
        if bits is not None or group_size is not None:
            raise ConfigError(f"{q}: bits and group_size do not apply to GGUF types")
        return WeightFormat(q, "gguf", gguf=assign(q[5:], config))
    kind = FORMATS.get(q.lower())
    if kind is None:
        raise ConfigError(f"quantization {q!r} is not one of auto, {', '.join(FORMATS)}, gguf:TYPE")
    if kind in ("dense", "fp8") and (bits is not None or group_size is not None):
        raise ConfigError(f"quantization {q}: bits and group_size apply to awq, gptq and nf4 only")
    q = q.lower()
    if kind == "codebook":
        if bits not in (None, 4):
            raise ConfigError(f"nf4 codes are 4-bit, not {bits}")
        return WeightFormat("nf4", "codebook", 4, group_size or 64)
    if kind == "affine":
        bits = 4 if bits is None else bits
        allowed = (4,) if q == "awq" else (2, 3, 4, 8)
        if bits not in allowed:
            raise ConfigError(f"{q}: bits={bits} is not one of {allowed}")
        group = 128 if group_size is None else group_size
        if group != -1 and group < 1:
            raise ConfigError(f"{q}: group_size must be positive or -1 (per channel), got {group}")
        return WeightFormat(q, "affine", bits, None if group == -1 else group, symmetric=q == "gptq")
    return WeightFormat(q, kind)


def _source_format(config: ModelConfig, source: dict[str, Any], bits, group_size) -> WeightFormat:
    """The format a checkpoint declares (auto): its quantization config or GGUF tensor types."""
    family = source.get("family", "hf")
    if family == "gguf":
        return WeightFormat("gguf (as stored)", "gguf", gguf=from_file("gguf (as stored)", source["tensor_types"]))
    if family == "hf":
        dense = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(config.torch_dtype, "fp16")
        return parse_format(dense, bits, group_size, config, {})
    if family == "synthetic":
        fmt = source["format"]
        if fmt in ("fp16", "bf16", "nf4"):
            return parse_format(fmt, None, None, config, {})
        if fmt.startswith("fp8"):
            return parse_format("fp8", None, None, config, {})
        if fmt.startswith("gguf-"):
            return parse_format(f"gguf:{fmt[5:]}", None, None, config, {})
        w = fmt[1:].removesuffix("act").split("g")
        return replace(parse_format("gptq", int(w[0]), int(w[1]) if len(w) > 1 else -1, config, {}),
                       act_order=fmt.endswith("act"))
    qc = source.get("quant_config", {})
    if family == "awq":
        return parse_format("awq", qc.get("bits", qc.get("w_bit", 4)),
                            qc.get("group_size", qc.get("q_group_size", 128)), config, {})
    if family == "gptq":
        fmt = parse_format("gptq", int(qc.get("bits", 4)), int(qc.get("group_size", 128)), config, {})
        return replace(fmt, symmetric=bool(qc.get("sym", True)), act_order=bool(qc.get("desc_act", False)))
    if family == "bnb" and qc.get("load_in_4bit", True) and not qc.get("load_in_8bit", False):
        return parse_format("nf4", None, None, config, {})
    if family == "fp8":
        return parse_format("fp8", None, None, config, {})
    raise UnsupportedError(f"quantization auto: {family} checkpoints are not modelled; pass the format "
                           "(e.g. quantization='gptq', bits=4, group_size=128)")


def kv_bytes_per_token(config: ModelConfig, kv_heads: int, kv_cache_dtype: str, e: int) -> int:
    """2 (K and V) x layers x KV heads (this rank's) x head_dim x element (1 byte for fp8, else the
    compute dtype's), as kv_cache.bytes_per_block counts it for one token."""
    element = 1 if KV_CACHE_DTYPES[kv_cache_dtype] is not None else e
    return 2 * config.num_hidden_layers * kv_heads * config.head_dim * element


def activation_peak(config: ModelConfig, q: int, kv: int, inter: int, tokens: int, rows: int, e: int,
                    dequantized: bool) -> int:
    """Peak activation bytes of one step of `tokens` tokens sampling `rows` rows (one rank's widths q, kv,
    inter; e the compute dtype's size), as ModelRunner.profile_peak_memory measures it:

        peak = 3*T*h*e + max(attention, mlp, logits)
        attention = max(T*qkv*e + D(qkv, h), T*(qkv + 2q)*e, T*q*e + D(h, q) + T*h*e)
        mlp       = max(T*2I*e + D(2I, h), T*3I*e, T*I*e + D(h, I) + T*h*e)
        logits    = 4 * rows * vocab * 4

    T tokens, h hidden, qkv = q + 2kv, I intermediate; 3*T*h*e: the residual stream, the layer input and
    its normed copy. The attention terms: the merged qkv output, then it with the rotated q and the
    attention output, then o_proj's. The MLP terms: gate_up's output, then it with its SiLU-and-mul
    product, then down_proj's. D(N, K) = N*K*e is the dequantized copy of a quantized weight
    (dequantize + cuBLAS from CUBLAS_MIN_M rows), 0 for 16-bit weights. Sampling holds four float32
    [rows, vocab] tensors (logits, probabilities, the exponential noise and their quotient)."""
    h, qkv = config.hidden_size, q + 2 * kv
    t = tokens

    def d(n: int, k: int) -> int:
        return n * k * e if dequantized and t >= CUBLAS_MIN_M else 0

    attention = max(t * qkv * e + d(qkv, h), t * (qkv + 2 * q) * e, t * q * e + d(h, q) + t * h * e)
    mlp = max(t * 2 * inter * e + d(2 * inter, h), t * 3 * inter * e, t * inter * e + d(h, inter) + t * h * e)
    logits = LOGIT_ROW_COPIES * rows * config.vocab_size * 4
    return 3 * t * h * e + max(attention, mlp, logits)


def _plan(name: str, config: ModelConfig, source: dict[str, Any], *, quantization, bits, group_size, gpus,
          kv_cache_dtype, max_model_len, tensor_parallel_size, max_num_seqs, max_num_batched_tokens,
          gpu_memory_utilization, dtype, enforce_eager, block_size) -> MemoryPlan:
    """One plan, without suggestions."""
    _check_request(kv_cache_dtype, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, dtype, block_size)
    cards = parse_gpus(gpus)
    fmt = parse_format(quantization, bits, group_size, config, source)
    check_gguf_rows(config, fmt)
    tp = cards.count if tensor_parallel_size is None else tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or tp > cards.count:
        raise ConfigError(f"tensor_parallel_size={tp} needs 1..{cards.count} GPUs ({cards} given)")
    problem = tp_problem(config, fmt, tp)
    if problem is not None:
        works = [t for t in TP_SIZES if tp_problem(config, fmt, t) is None]
        raise ConfigError(f"{name} ({fmt.describe()}) cannot run at tensor_parallel_size={tp}: {problem}; "
                          f"sizes that would: {', '.join(map(str, works)) or 'none'}")
    length = config.max_position_embeddings if max_model_len is None else max_model_len
    if not isinstance(length, int) or not 1 <= length <= config.max_position_embeddings:
        raise ConfigError(f"max_model_len={length} must be between 1 and the model's max_position_embeddings="
                          f"{config.max_position_embeddings}")
    e = 4 if str(dtype).removeprefix("torch.") in ("float32", "float") else 2
    s = shard(config, tp)
    weights = weight_bytes(config, fmt, s, e)
    w8a8 = cards.caps is not None and PRESETS[cards.caps].fp8      # fp8 weights meet fp8 activations
    packed = fmt.kind != "gguf" and fmt.packed(config.hidden_size)
    quantized = packed and (fmt.kind != "fp8" or not w8a8)
    peak = activation_peak(config, s.q, s.kv, s.inter, max_num_batched_tokens,
                           min(max_num_batched_tokens, max_num_seqs), e, quantized)
    graphs = 0 if enforce_eager else GRAPH_MEMORY_MARGIN
    budget = int(cards.memory * gpu_memory_utilization)
    per_token = kv_bytes_per_token(config, s.kv_heads, kv_cache_dtype, e)
    runtime = RUNTIME_OVERHEAD + (NCCL_OVERHEAD if tp > 1 else 0)
    kv_bytes = max(0, budget - weights.total - peak - graphs - runtime)
    blocks = kv_bytes // (per_token * block_size)
    seqs = blocks // cdiv(length, block_size)
    return MemoryPlan(
        model=name, quantization=fmt.describe(), gpus=str(cards), tensor_parallel_size=tp, gpu_memory=cards.memory,
        budget=budget, weights=weights, activation_peak=peak, cuda_graphs=graphs, runtime_overhead=runtime,
        kv_cache_dtype=kv_cache_dtype, kv_bytes_per_token=per_token, kv_cache_bytes=kv_bytes,
        kv_capacity_tokens=blocks * block_size, max_model_len=length, max_concurrent_seqs=min(seqs, max_num_seqs),
        fits=seqs >= 1, notes=tuple(_notes(config, fmt, cards, s, e)), load_peak=load_peak(config, fmt, s, e))


def _check_request(kv_cache_dtype, max_num_seqs, max_num_batched_tokens, utilization, dtype, block_size) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    for field, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                         ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field} must be a positive integer, got {value!r}")
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if str(dtype).removeprefix("torch.") not in ("auto", "float16", "half", "bfloat16", "float32", "float"):
        raise ConfigError(f"dtype {dtype!r} is not one of auto, float16, bfloat16, float32")


def _notes(config: ModelConfig, fmt: WeightFormat, cards: Gpus, s, e: int) -> list[str]:
    notes = []
    unpacked = sorted(t for t in set(fmt.gguf.types.values()) if GGML_TYPES_BY_NAME[t].affine is None) \
        if fmt.kind == "gguf" else []
    if unpacked:
        notes.append(f"GGUF types without an affine form ({', '.join(unpacked)}) "
                     f"are held dequantized ({8 * e}-bit) on CUDA; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 run packed")
    if fmt.name in ("fp32", "float32") and e == 2:
        notes.append("fp32 weights are held in the 16-bit compute dtype (dtype auto); dtype float32 keeps them")
    if fmt.kind == "affine" and not fmt.packed(config.hidden_size):
        notes.append(f"{fmt.describe()} has no packing kernel (4- or 8-bit, groups a multiple of 16): "
                     f"held dequantized at {8 * e} bits")
    if config.tie_word_embeddings:
        notes.append("tied embeddings: the engine loads the lm_head as a second copy of the table")
    if s.kv_heads * s.tp > config.num_key_value_heads:
        notes.append(f"{config.num_key_value_heads} KV heads over {s.tp} ranks: each rank holds a replica of one")
    if s.tp < cards.count:
        notes.append(f"tensor-parallel size {s.tp} uses {s.tp} of the {cards.count} GPUs")
    return notes


def _suggestions(name: str, config: ModelConfig, source: dict[str, Any], request: dict[str, Any],
                 current: MemoryPlan) -> list[Suggestion]:
    """Single changes that make the request fit, each checked by re-running the plan."""
    cards = parse_gpus(request["gpus"])
    tries: list[tuple[str, dict[str, Any]]] = []
    for q in SUGGESTED_FORMATS:
        tries.append((f"quantization {q}", dict(quantization=q, bits=None, group_size=None)))
    for tp in TP_SIZES:
        if tp > current.tensor_parallel_size:
            gpus = f"{max(tp, cards.count)}x{cards.name}"
            tries.append((f"{gpus} at tensor-parallel size {tp}", dict(gpus=gpus, tensor_parallel_size=tp)))
    if current.kv_capacity_tokens >= request["block_size"]:
        step = 1024 if current.kv_capacity_tokens >= 1024 else request["block_size"]
        length = min(current.kv_capacity_tokens // step * step, current.max_model_len - 1)
        tries.append((f"max_model_len {length}", dict(max_model_len=length)))
    if KV_CACHE_DTYPES[request["kv_cache_dtype"]] is None:
        tries.append(("kv_cache_dtype fp8", dict(kv_cache_dtype="fp8")))
    found, tp_found = [], False
    for what, change in tries:
        if "tensor_parallel_size" in change and tp_found:
            continue
        try:
            p = _plan(name, config, source, **{**request, **change})
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
    where = f"{p.model} ({p.quantization}) on {p.gpus} at tensor-parallel size {p.tensor_parallel_size}"
    if p.fits:
        return (f"fits: {where}: {p.weights.total / GIB:.2f} GiB of weights per GPU, KV cache for "
                f"{p.kv_capacity_tokens:,} tokens ({p.max_concurrent_seqs} sequences of {p.max_model_len:,} "
                f"tokens at once)")
    if p.kv_cache_bytes == 0:
        why = (f"{p.weights.total / GIB:.2f} GiB of weights per GPU and {(p.fixed_bytes - p.weights.total) / GIB:.2f}"
               f" GiB of activations, CUDA graphs and runtime leave nothing for the KV cache in the "
               f"{p.budget / GIB:.2f} GiB budget ({p.budget / p.gpu_memory:.2g} of {p.gpu_memory / GIB:.2f} GiB)")
    else:
        why = (f"the KV cache holds {p.kv_capacity_tokens:,} tokens, fewer than max_model_len="
               f"{p.max_model_len:,}")
    fixes = "; ".join(s.what for s in p.suggestions)
    return f"does not fit: {where}: {why}; " + (f"it would fit with {fixes}" if fixes else
                                                 "no single change of format, GPUs, context or KV dtype fits it")
