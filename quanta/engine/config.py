"""EngineConfig: the LLM(...) arguments, validated once (nano-vllm's Config); its memory fields are the
MemoryRequest that `quanta plan` shares."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quanta.planner.request import DTYPES, MemoryRequest
from quanta.quant.errors import ConfigError

# A step's tokens on a CPU: its GEMMs are as fast per token at 256 rows as at thousands, and a step of a long
# prompt's prefill lasts well under a second, so a request arriving meanwhile starts soon.
CPU_BATCHED_TOKENS = 256


@dataclass(slots=True)
class EngineConfig(MemoryRequest):
    """What LLM(model, **kwargs) runs. The memory fields (dtype, max_model_len, kv_cache_dtype, block_size,
    gpu_memory_utilization, max_num_batched_tokens, max_num_seqs, enforce_eager, max_gpu_memory) are
    MemoryRequest's, keyword-only."""
    model: str
    quantization: str = "auto"          # "auto" or the family detect() must find (gguf, awq, ...)
    device: str | None = None           # default: cuda if available, else cpu
    seed: int = 0
    tokenizer: str | None = None        # a tokenizer directory overriding the checkpoint's own
    kernel: str | None = None           # force one kernel (by NAME) for every quantized layer; "auto": choose
    quiet: bool = False                 # no progress bars (loading, generating) for scripts
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None   # launch the next decode step before this one's tokens are
                                           # known (default: on CUDA); only where schedule() would pick it
    num_kv_blocks: int | None = None    # fix the KV pool size (overrides the memory sizing)
    kv_cache_memory: int | None = None  # CPU: bytes of KV cache (default 1 GiB)
    tensor_parallel_size: int = 1       # ranks, one process and one GPU each (engine/parallel/); torchrun's
                                        # WORLD_SIZE when started by torchrun
    disable_custom_all_reduce: bool = False   # TP on GPUs: NCCL for every all-reduce, never the one-shot
                                              # kernel (engine/parallel/one_shot.py)
    allow_pickle: bool = False          # load an HF checkpoint's .bin/.pt weights (torch.load(weights_only=True));
                                        # off, they are refused: unpickling can run code
    max_cpu_loras: int | None = None    # adapters kept read on the host (default max_loras; at least that)
    schedule_conservativeness: float = 1.0   # room admission keeps for the running sequences' growth, scaled
                                             # (scheduler.py); 0 admits whatever fits now, preempting later

    def __post_init__(self):
        if self.kernel == "auto":
            self.kernel = None
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.max_num_batched_tokens is None and torch.device(self.device).type == "cpu":
            self.max_num_batched_tokens = CPU_BATCHED_TOKENS
        MemoryRequest.__post_init__(self)
        for name in ("num_kv_blocks", "kv_cache_memory", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        room = self.schedule_conservativeness
        if isinstance(room, bool) or not isinstance(room, (int, float)) or not 0 <= room < float("inf"):
            raise ConfigError(f"schedule_conservativeness must be a finite number >= 0, got {room!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, "
                              f"got {self.max_cpu_loras!r}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ConfigError("enable_lora with tensor_parallel_size > 1 is not supported: adapters run on one "
                              "GPU (tensor_parallel_size=1)")
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
