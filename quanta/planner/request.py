"""What a run's memory depends on besides the model, validated once: `MemoryRequest`, the fields that `quanta
plan` (PlanRequest) and the engine (EngineConfig) share, and the budget and cap rule both apply."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.kernels.paged_kv import KvFormat
from quanta.planner.gpus import Gpus, parse_size
from quanta.quant.errors import ConfigError

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}
BLOCK_SIZES = (8, 16, 32, 64, 128)
GPU_BATCHED_TOKENS = 8192          # a step's tokens on a GPU: prefill fills its GEMMs well before this
GRAPH_MEMORY_MARGIN = 512 << 20     # the CUDA graphs' pool and the sampler's buffers, which a dry run does not see


@dataclass(slots=True, kw_only=True)
class MemoryRequest:
    """The memory-shaping settings of a run, validated in __post_init__ (a ConfigError names the field)."""
    dtype: str | torch.dtype = "auto"   # compute dtype; auto: float32 on CPU, the checkpoint's on GPU
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    kv_cache_dtype: str | KvFormat = "auto"   # a paged_kv.KV_CACHE_DTYPES name; held as its KvFormat
    block_size: int = 16                # tokens per KV block
    gpu_memory_utilization: float = 0.9   # share of GPU memory for weights + activations + KV cache
    max_num_batched_tokens: int | None = None   # token budget of one step (chunked prefill beyond it);
                                                # default GPU_BATCHED_TOKENS (the engine: CPU_BATCHED_TOKENS on a CPU)
    max_num_seqs: int = 256             # sequences in one step
    enforce_eager: bool = False         # no CUDA graphs
    max_gpu_memory: int | str | None = None   # cap on one process's GPU memory: bytes, "15GiB" or a card name
                                              # ("t4"); held as bytes; per rank under tensor parallelism
    enable_lora: bool = False           # serve LoRA adapters over the base (quanta.lora)
    max_loras: int = 1                  # adapters resident at once (slots), and so at most in one step
    max_lora_rank: int = 16             # the largest adapter rank the slots hold

    def __post_init__(self):
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.max_model_len is not None and (not _positive_int(self.max_model_len)):
            raise ConfigError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        self.kv_cache_dtype = KvFormat.parse(self.kv_cache_dtype)
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError(f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = GPU_BATCHED_TOKENS
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_gpu_memory is not None:
            self.max_gpu_memory = parse_size(self.max_gpu_memory, "max_gpu_memory")
        for name in ("max_loras", "max_lora_rank"):
            if not _positive_int(getattr(self, name)):
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)!r}")

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element: 4 for float32 compute, else 2 (auto on a GPU is 16-bit)."""
        return 4 if DTYPES.get(str(self.dtype).removeprefix("torch.")) == torch.float32 else 2

    def budget(self, total: int) -> int:
        """This run's share of a GPU of `total` bytes: gpu_memory_utilization x total, capped at
        max_gpu_memory (so one large GPU can stand for a smaller card)."""
        budget = int(total * self.gpu_memory_utilization)
        return budget if self.max_gpu_memory is None else min(budget, self.max_gpu_memory)

    @property
    def graph_margin(self) -> int:
        """Head-room kept for the CUDA graphs (none under enforce_eager)."""
        return 0 if self.enforce_eager else GRAPH_MEMORY_MARGIN

    def kv_cache_bytes(self, total: int, *held: int) -> int:
        """What the budget on a GPU of `total` bytes leaves for the KV cache after everything else it holds
        (`held`: weights, the activation peak, the graphs' margin, memory outside torch's tensors): the one
        sizing rule of `quanta plan` and the engine's pool."""
        return max(0, self.budget(total) - sum(held))

    def check_weights_under_cap(self, weight_bytes: int) -> None:
        """ConfigError when the weights alone exceed max_gpu_memory."""
        if self.max_gpu_memory is not None and weight_bytes > self.max_gpu_memory:
            raise ConfigError(f"the weights take {weight_bytes / 2**30:.2f} GiB, more than max_gpu_memory="
                              f"{self.max_gpu_memory / 2**30:.2f} GiB")


@dataclass(slots=True, kw_only=True)
class PlanRequest(MemoryRequest):
    """`quanta plan`'s question: a weight format on some GPUs, with the engine's memory settings.

    quantization: auto (the checkpoint's own; fp16 for a shape name), fp16 | bf16 | fp32, awq | gptq
    (4-bit, groups of 128 unless bits / group_size say otherwise; group_size -1: per channel), nf4, fp8,
    or gguf:TYPE. gpus: NxSIZE, [Nx]NAME or a Gpus. tensor_parallel_size: default the number of GPUs."""
    quantization: str = "auto"
    bits: int | None = None
    group_size: int | None = None
    gpus: str | Gpus = "1x80GiB"
    tensor_parallel_size: int | None = None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
