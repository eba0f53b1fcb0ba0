"""EngineConfig: the LLM(...) arguments, validated once (nano-vllm's Config)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quanta.engine.gpus import parse_size
from quanta.engine.kv_cache import kv_format
from quanta.quant.errors import ConfigError

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True)
class EngineConfig:
    model: str
    quantization: str = "auto"          # "auto" or the family detect() must find (gguf, awq, ...)
    dtype: str | torch.dtype = "auto"   # compute dtype; auto: float32 on CPU, the checkpoint's on GPU
    device: str | None = None           # default: cuda if available, else cpu
    max_model_len: int | None = None    # default: the model's max_position_embeddings
    seed: int = 0
    tokenizer: str | None = None        # a tokenizer directory overriding the checkpoint's own
    kernel: str | None = None           # force one kernel (by NAME) for every quantized layer
    quiet: bool = False                 # no progress bars (loading, generating) for scripts
    # Paged engine.
    kv_cache_dtype: str = "auto"        # a kv_cache.KV_CACHE_DTYPES name: auto (model dtype) or an fp8 format
    block_size: int = 16                # tokens per KV block
    gpu_memory_utilization: float = 0.9   # share of GPU memory for weights + activations + KV cache
    max_num_batched_tokens: int = 8192  # token budget of one step (chunked prefill beyond it)
    max_num_seqs: int = 256             # sequences in one step
    enable_prefix_caching: bool = True
    enforce_eager: bool = False         # no CUDA graphs
    async_scheduling: bool | None = None   # launch the next decode step before this one's tokens are
                                           # known (default: on CUDA); only where schedule() would pick it
    num_kv_blocks: int | None = None    # fix the KV pool size (overrides the memory sizing)
    kv_cache_memory: int | None = None  # CPU: bytes of KV cache (default 1 GiB)
    max_gpu_memory: int | str | None = None   # cap on this process's GPU memory: bytes, "15GiB" or a card
                                              # name ("t4"); held as bytes once validated; per rank under TP
    tensor_parallel_size: int = 1       # ranks, one process and one GPU each (engine/parallel.py); torchrun's
                                        # WORLD_SIZE when started by torchrun
    disable_custom_all_reduce: bool = False   # TP on GPUs: NCCL for every all-reduce, never the one-shot
                                              # kernel (engine/one_shot_all_reduce.py)
    allow_pickle: bool = False          # load an HF checkpoint's .bin/.pt weights (torch.load(weights_only=True));
                                        # off, they are refused: unpickling can run code

    def __post_init__(self):
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        kv_format(self.kv_cache_dtype)      # a ConfigError naming the known values
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "kv_cache_memory",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_gpu_memory is not None:
            self.max_gpu_memory = parse_size(self.max_gpu_memory, "max_gpu_memory")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.async_scheduling is None:
            self.async_scheduling = torch.device(self.device).type == "cuda"
        if torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for but no CUDA GPU is available")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        """Build from LLM(**kwargs), rejecting unknown names instead of ignoring them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"LLM: unknown argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def lm_head_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """What the lm_head computes in: the compute dtype, except with dtype="auto" on the CPU, where
        a float32 lm_head would cost a third of a small model's decode step; the tokens that can be a
        row's largest are then recomputed in float32 (LlamaForCausalLM.compute_logits), so greedy picks
        see float32 logits, not bfloat16 ties."""
        if self.dtype == "auto" and torch.device(self.device).type == "cpu":
            return torch.bfloat16
        return compute_dtype

    def compute_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        """What the model's activations are in, for a checkpoint stored in `checkpoint_dtype`. On a GPU
        without bfloat16 arithmetic (sm75, or QUANTA_DEVICE_CAPS=sm75) auto means float16, and asking
        for bfloat16 is an error."""
        chosen = self._chosen_dtype(checkpoint_dtype)
        if chosen == torch.bfloat16 and torch.device(self.device).type == "cuda":
            from quanta.kernels.device_caps import device_caps
            caps = device_caps(self.device)
            if not caps.bf16:
                if self.dtype != "auto":
                    raise ConfigError(f"dtype bfloat16 asked for, but a {caps.name} GPU has no bfloat16 "
                                      "arithmetic: use float16")
                return torch.float16
        return chosen

    def _chosen_dtype(self, checkpoint_dtype: torch.dtype) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if torch.device(self.device).type == "cpu":
            # float32 activations; 4-bit GEMMs still run torch's int4 kernel (bf16 at its input only).
            # All-bf16 keeps too little of the residual stream: SmolLM2's greedy answer flips.
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.float16
