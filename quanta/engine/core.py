"""EngineCore: one model's KV cache, runner, block pool, scheduler and requests, built together in named
stages (open, check, load, size the pool, build) and never rewired; the loop every driver runs.

    core = EngineCore(EngineConfig(model=...))
    rid = core.add_request(prompt_ids, SamplingParams(...))
    while core.has_unfinished():
        outputs = core.step()            # RequestOutputs of the requests that advanced

Drivers: `LLM` (offline), the server's AsyncEngine / ProcessEngine (engine/drivers/) and, under tensor
parallelism, every rank (engine/parallel/): rank 0 schedules and broadcasts each step, the others run it.
"""
from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch

from quanta.engine import host_heap
from quanta.engine.block_pool import BlockPool
from quanta.engine.config import EngineConfig
from quanta.engine.kernel_report import kernel_report
from quanta.engine.kv_cache import PagedKVCache, bytes_per_block, checkpoint_kv_scales
from quanta.engine.memory_report import free_bytes, weight_memory
from quanta.engine.model_loader import build_model, open_checkpoint
from quanta.engine.outputs import RequestOutput
from quanta.engine.parallel.group import TensorParallel, check_world, kv_head_range, rank_config
from quanta.engine.parallel.group import start as start_group
from quanta.engine.parallel.step import send_stop
from quanta.engine.pool_size import (blocks_from_config, blocks_from_gpu_memory, check_capacity,
                                     use_expandable_segments)
from quanta.engine.requests import Requests
from quanta.engine.runner import LaunchedStep, ModelRunner, blocks_spanned, dummy_batch
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.scheduler import Scheduler
from quanta.engine.sequence import Sequence
from quanta.kernels.device_caps import use_triton
from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.formats import Source
from quanta.lora.request import LoRARequest
from quanta.lora.slots import LoRASlots
from quanta.planner.activation import activation_peak as plan_activation_peak
from quanta.planner.fit_check import check_fits, check_shardable, device_total, out_of_memory
from quanta.quant.errors import ConfigError, QuantaError

log = logging.getLogger(__name__)

# What close() lets go of: the weights, KV cache, runner (its buffers and CUDA graphs), pool, scheduler,
# requests and the checkpoint (its open files).
HELD = ("model", "kv_cache", "runner", "pool", "scheduler", "requests", "_in_flight", "checkpoint", "generator",
        "lora")


class EngineClosedError(QuantaError, RuntimeError):
    """An engine (or the LLM over it) was used after close()."""


class EngineCore:
    """`triton_ops`: whether the elementwise ops, the KV store and attention run as Triton kernels; None
    (the default) asks use_triton(device, dtype). Tests pass True to run the CUDA path under Triton's
    interpreter on the CPU. `checkpoint`: build from this opened checkpoint instead of opening
    config.model (a caller that has opened it already). `tp`: a spawned rank's group (rank 0 starts it)."""

    def __init__(self, config: EngineConfig, triton_ops: bool | None = None, checkpoint: Checkpoint | None = None,
                 tp: TensorParallel | None = None):
        self._open(config, checkpoint, tp)
        fixed_blocks = self._check()
        self._load(triton_ops)
        self._build(self._size_pool(fixed_blocks))
        if self.tp is not None and self.tp.torchrun and self.tp.is_worker:
            self.serve()                                   # torchrun's other ranks serve rank 0, then exit
            raise SystemExit(0)

    # --- construction, in order ---------------------------------------------------------------------
    def _open(self, config: EngineConfig, checkpoint: Checkpoint | None, tp: TensorParallel | None) -> None:
        """This rank's config and device; the checkpoint (config, tokenizer, tensors read lazily); the compute
        dtype, max_model_len and this rank's KV heads."""
        world, rank = (tp.world, tp.rank) if tp else (check_world(config), int(os.environ.get("RANK", "0")))
        self.world = world
        self.config = cfg = config if world == 1 else rank_config(config, rank, world)
        self.tp = tp                                       # given to a spawned worker; rank 0 starts it in _load
        self.device = torch.device(cfg.device)
        self.checkpoint = checkpoint if checkpoint is not None else open_checkpoint(cfg)
        mc = self.checkpoint.config
        self.tokenizer = self.checkpoint.tokenizer
        self.eos_ids = sorted(set(mc.eos_token_ids) | ({getattr(self.tokenizer, "eos_token_id", None)} - {None}))
        self.dtype = cfg.compute_dtype(mc.torch_dtype)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                              f"max_position_embeddings={mc.max_position_embeddings}")
        self.kv_heads = kv_head_range(mc.num_key_value_heads, rank, world)     # this rank's [start, stop)

    def _check(self) -> int | None:
        """Everything that can be refused before a weight is built: a pool the config fixes too small for
        max_model_len, a tensor-parallel split that cuts the model, and (on a GPU) quanta plan's verdict.
        Returns the block count the config fixes, if it does."""
        cfg, mc = self.config, self.checkpoint.config
        self.block_bytes = bytes_per_block(mc.num_hidden_layers, cfg.block_size, self.kv_heads[1] - self.kv_heads[0],
                                           mc.head_dim, self.dtype, cfg.kv_cache_dtype)
        blocks = blocks_from_config(cfg, self.block_bytes)
        if blocks is not None:
            check_capacity(blocks, cfg.block_size, self.max_model_len)
        source = Source.of(self.checkpoint)
        if self.world > 1:                                 # which sizes split, before any process starts
            check_shardable(mc, self.world, str(cfg.model))
        total = device_total(self.device)
        self.plan = None if total is None else check_fits(cfg, self.world, mc, source, total, str(cfg.model))
        return blocks

    def _load(self, triton_ops: bool | None) -> None:
        """Start the tensor-parallel group (rank 0), build the model (streamed, one module at a time) and
        measure what it holds; every rank agrees that it loaded, or all raise."""
        cfg = self.config
        self.triton = use_triton(self.device, self.dtype) if triton_ops is None else triton_ops
        if self.world > 1 and self.tp is None:
            self.tp = start_group(cfg, EngineCore)
        if self.device.type == "cuda":
            use_expandable_segments()
            torch.cuda.reset_peak_memory_stats(self.device)
        before = self._allocated()
        try:
            with out_of_memory("loading the weights", self.plan):
                self.model = build_model(self.checkpoint, self.device, self.dtype, triton=self.triton,
                                         force_kernel=cfg.kernel, quiet=cfg.quiet,
                                         lm_head_dtype=cfg.lm_head_dtype(self.dtype), tp=self.tp)
                self.lora = LoRASlots(self.model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras,
                                      max(cfg.max_num_batched_tokens, cfg.max_num_seqs), self.triton) \
                    if cfg.enable_lora else None
            self.weight_bytes = self._allocated() - before
            cfg.check_weights_under_cap(self.weight_bytes)
        except BaseException as e:
            if self.tp is not None:
                self.tp.fail(e)                            # every rank raises, rank 0 the failing rank's error
            raise
        # What the load itself held at its height (weights so far + one module's transient), measured.
        self.load_peak = (torch.cuda.max_memory_allocated(self.device) - before
                          if self.device.type == "cuda" else None)
        host_heap.trim()
        if self.tp is not None:
            self.tp.agree(None)
            if self.device.type == "cuda" and not cfg.disable_custom_all_reduce:
                self.tp.start_one_shot(self.dtype, self.checkpoint.config.hidden_size)

    def _size_pool(self, blocks: int | None) -> int:
        """The pool's block count: what the config fixed, or on a GPU what the budget leaves after a dry run
        of the largest step (the smallest over the ranks); checked to hold one max_model_len sequence."""
        self.activation_peak: int | None = None            # measured by the dry run, where one runs
        if blocks is not None:
            return blocks
        with out_of_memory("profiling the largest step", self.plan):
            self.activation_peak = self._activation_peak()
        blocks = blocks_from_gpu_memory(self.config, self.block_bytes, self.weight_bytes, self.activation_peak)
        if self.tp is not None:
            blocks = self.tp.min_int(blocks)               # rank 0 schedules for every rank's cache
        check_capacity(blocks, self.config.block_size, self.max_model_len)
        return blocks

    def _build(self, num_blocks: int) -> None:
        """The KV cache (with the checkpoint's fp8 scales), the runner (capturing CUDA graphs), the pool, the
        scheduler and the requests over them."""
        cfg, mc = self.config, self.checkpoint.config
        self.num_kv_blocks = num_blocks
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        scales = checkpoint_kv_scales(dict(self.checkpoint.kv_cache_scales), mc.num_hidden_layers,
                                      mc.num_key_value_heads)
        if scales is not None:
            scales = tuple(s[:, self.kv_heads[0]:self.kv_heads[1]] for s in scales)
        with out_of_memory(f"allocating the KV cache ({num_blocks} blocks)", self.plan):
            self.kv_cache = self._new_cache(num_blocks, scales)
        graphs = self.device.type == "cuda" and not cfg.enforce_eager
        reserved_before = torch.cuda.memory_reserved(self.device) if graphs else 0
        with out_of_memory("capturing CUDA graphs" if graphs else "building the runner", self.plan):
            self.runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, cfg.max_num_seqs,
                                      cfg.max_num_batched_tokens, self.generator, cuda_graphs=graphs,
                                      lora=self.lora)
        # The graphs' pool and the runner's static buffers, as the allocator grew for them.
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved_before if graphs else 0
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.async_scheduling,
                                   max_loras=cfg.max_loras if cfg.enable_lora else None,
                                   conservativeness=cfg.schedule_conservativeness)
        self.requests = Requests(self.scheduler, self.tokenizer, self.eos_ids, mc.vocab_size, self.max_model_len,
                                 self.device)
        self._in_flight: LaunchedStep | None = None    # launched ahead by async scheduling, not collected

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _new_cache(self, num_blocks: int, scales=None) -> PagedKVCache:
        mc = self.checkpoint.config
        return PagedKVCache(mc.num_hidden_layers, num_blocks, self.config.block_size,
                            self.kv_heads[1] - self.kv_heads[0], mc.head_dim, self.dtype, self.device,
                            self.config.kv_cache_dtype, scales, self.triton)

    def _activation_peak(self) -> int:
        """Peak activation bytes of the largest step, from a dry run on a scratch runner and cache; the runner then
        runs every eager step's shape once (compile_step_shapes), so that Triton compiles now, on that cache."""
        cfg = self.config
        blocks = blocks_spanned(dummy_batch(cfg.max_num_batched_tokens, self.max_model_len, cfg.block_size))
        scratch = ModelRunner(self.model, self._new_cache(blocks), self.max_model_len, cfg.max_num_seqs,
                              cfg.max_num_batched_tokens, lora=self.lora)
        peak = scratch.profile_peak_memory()
        scratch.compile_step_shapes()
        del scratch
        torch.cuda.empty_cache()
        return peak

    @property
    def tokenizer(self):
        """The model's tokenizer (None for a model without one); setting it sets the requests' too."""
        return self.__dict__.get("_tokenizer")

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        if "requests" in self.__dict__:
            self.requests.tokenizer = tokenizer

    # --- the loop -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt: str | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue one tokenized prompt (`prompt`: its text, echoed in the outputs) to run with `lora_request`'s
        adapter (read and checked now, when the engine has enable_lora) or none; returns the request id."""
        if lora_request is not None:
            if self.lora is None:
                raise ConfigError(f"a LoRA request ({lora_request.lora_name!r}) needs an engine started with "
                                  "enable_lora=True (quanta serve: --lora-modules or --enable-lora)")
            self.lora.check(lora_request)
        return self.requests.add(prompt_ids, params, request_id, prompt, lora_request)

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One iteration: launch, advance, maybe launch the next decode ahead, fold this step's tokens.
        Returns the outputs of the requests that advanced, or with `stream=False` of those that finished
        (unfinished ones then skip detokenizing); a finished request is forgotten once returned. A request
        whose own logits processor or text decoding raises finishes with "error" (RequestOutput.error)."""
        current = self._launch_next()
        if current is None:
            return []
        batch = [it for it in current.batch if not it.seq.finished]
        self.scheduler.update(batch)
        ahead = self.scheduler.schedule_ahead(batch)
        self._in_flight = self.runner.launch(ahead, after=current) if ahead else None
        touched = self.requests.fold(*self.runner.collect(current))
        return [self.requests.output(req) for req in touched if stream or req.finished]

    def has_unfinished(self) -> bool:
        """Whether any request still waits or runs."""
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its output so far, finish_reason "abort" (None if unknown)."""
        return self.requests.abort(request_id)

    def _launch_next(self) -> LaunchedStep | None:
        """The step launched ahead, unless every sequence in it has ended since; else a new one, if any."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None and not all(seq.finished for seq in launched.seqs):
            return launched
        batch = self.scheduler.schedule()
        return self.runner.launch(batch) if batch else None

    # --- one-off questions --------------------------------------------------------------------------
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits [T, V] at every position of one token sequence."""
        seq = Sequence("prompt_logits", 0, list(token_ids), SamplingParams())
        if len(token_ids) > self.max_model_len or not self.pool.can_allocate(seq, reserve=False):
            raise ConfigError(f"{len(token_ids)} tokens do not fit the KV cache / max_model_len")
        self.pool.allocate(seq, use_cache=False)
        try:
            return self.runner.prompt_logits(seq)
        finally:
            self.pool.free(seq)

    def kernels(self, m: tuple[int, ...] = (1, 16, 256)) -> list[dict]:
        """Per GEMM as it runs (merged q/k/v and gate/up, the lm_head), the kernel and its path at each M
        (kernel_report)."""
        return kernel_report(self.model, m)

    def memory(self) -> dict[str, Any]:
        """Bytes this engine holds (see LLM.memory)."""
        cfg, mc = self.config, self.checkpoint.config
        if self.activation_peak is not None:
            activation, activation_source = self.activation_peak, "profiled"
        elif self.plan is not None:
            activation, activation_source = self.plan.activation_peak, "plan estimate"
        else:
            e = torch.empty((), dtype=self.dtype).element_size()
            tokens = cfg.max_num_batched_tokens
            activation = plan_activation_peak(mc, mc.num_attention_heads * mc.head_dim,
                                              mc.num_key_value_heads * mc.head_dim, mc.intermediate_size, tokens,
                                              min(tokens, cfg.max_num_seqs), e, dequantized=self.device.type == "cuda")
            activation_source = "plan estimate"
        if self.device.type != "cuda":
            graphs, graphs_source = 0, "none (no CUDA graphs off the GPU)"
        elif cfg.enforce_eager:
            graphs, graphs_source = 0, "none (enforce_eager)"
        elif self.graph_bytes > 0:
            graphs, graphs_source = self.graph_bytes, "measured (reserved while capturing)"
        else:
            graphs, graphs_source = cfg.graph_margin, "margin (the capture reserved nothing new)"
        return {"device": str(self.device), "weights": weight_memory(self.model), "load_peak": self.load_peak,
                "kv_cache": self.kv_cache.nbytes, "lora_slots": self.lora.nbytes() if self.lora else 0,
                "kv_cache_blocks": self.num_kv_blocks, "activation_peak": activation,
                "activation_source": activation_source, "cuda_graphs": graphs, "cuda_graphs_source": graphs_source,
                "free": free_bytes(self.device)}

    def serve(self) -> None:
        """A tensor-parallel worker: run rank 0's steps until it closes, then close."""
        try:
            self.runner.serve()
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the weights, KV cache, runner buffers, CUDA graphs and requests (then, on CUDA,
        return the cached blocks to the driver); under tensor parallelism rank 0 first stops the other
        ranks, and every rank leaves the process group. Idempotent; any later use raises EngineClosedError."""
        if self.__dict__.get("_closed"):
            return
        self._closed = True
        tp = self.__dict__.get("tp")
        if tp is not None and not tp.closed and not tp.is_worker and "runner" in self.__dict__:
            send_stop(tp)
        for name in HELD:
            self.__dict__.pop(name, None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if tp is not None:          # after the CUDA graphs are gone: NCCL waits on work they captured
            tp.close()
        if self.device.type == "cuda":
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:    # torch keeps a cuBLAS workspace per stream the GEMMs ran on
                clear_workspaces()
            torch.cuda.empty_cache()

    def __getattr__(self, name: str):
        """Only reached for a missing attribute: after close(), what it let go of."""
        if self.__dict__.get("_closed"):
            raise EngineClosedError(f"{self.config.model}: the engine was closed (close(), a with block's end); "
                                    "create a new LLM to use the model again")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
