"""EngineCore: one model's KV cache, runner, block pool and scheduler, built together by one constructor
and never rewired; the loop that every driver of the engine runs.

    core = EngineCore(EngineConfig(model=...))
    rid = core.add_request(prompt_ids, SamplingParams(...))
    while core.has_unfinished():
        outputs = core.step()            # RequestOutputs of the requests that advanced

The constructor works in this order: open the checkpoint (config, tokenizer, tensors read lazily);
settle the compute dtype and max_model_len; where the KV pool's size follows from the config alone
(num_kv_blocks, or kv_cache_memory on the CPU), refuse a pool that cannot hold one max_model_len
sequence, before any weight is built; on a GPU, refuse with `quanta plan`'s verdict a configuration
its memory plan says cannot fit (fit_check.check_fits; the budget capped at max_gpu_memory); decide
once whether the elementwise ops, the KV store and attention run as Triton kernels
(device_caps.use_triton); build the model (streamed, one module's tensors at a time), refusing weights
over max_gpu_memory; on a GPU, size the pool from a dry run on a scratch runner and cache of its own;
then build the cache, the runner (capturing CUDA graphs), the pool and the scheduler, each handed what
it works with. memory() says what they hold; close() lets go of all of it.

step() takes the step launched ahead, or schedules and launches one; advances its sequences; launches
the next decode step at once where the scheduler's async rule allows (Scheduler.schedule_ahead); then
waits for this step's tokens and folds them into their requests (stop rules, n > 1 forks, outputs).

The drivers are thin and never reach inside:
- `LLM` (llm.py), offline: tokenizes, adds every prompt, calls step() until all are done.
- The server (DESIGN: FastAPI + uvicorn, OpenAI routes): the core runs in its own process
  (core_process.py), which applies the server's batched adds and aborts between steps and sends one
  message of per-request deltas per step; the API process (process_engine.ProcessEngine) folds them into
  each request's state and streams them (SSE), so HTTP and JSON work never shares a GIL with the step.
  A client disconnect aborts its request, which frees its blocks. (async_engine.AsyncEngine is the same
  driver in one process, a thread stepping under the event loop.)
- Tensor parallelism (DESIGN: one process per rank, torch.distributed): every rank builds a core over
  its shard (column/row-parallel QuantLinear, vocab-parallel embedding and lm_head) and its KV heads,
  in the same constructor order; the pool's block count is the minimum over ranks. Rank 0's scheduler
  alone decides each step and broadcasts it (sequences, token counts, block tables); every rank's runner
  runs that step on its shard, and rank 0 samples and folds the tokens.
"""
from __future__ import annotations

import gc
import itertools
import logging
import operator
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from quanta.engine.block_pool import BlockPool
from quanta.engine.config import EngineConfig
from quanta.engine.kv_cache import PagedKVCache, bytes_per_block, checkpoint_kv_scales
from quanta.engine.fit_check import check_fits, device_total, out_of_memory, plan_source
from quanta.engine.kv_sizing import (
    GRAPH_MEMORY_MARGIN,
    blocks_from_config,
    blocks_from_gpu_memory,
    check_capacity,
    check_weights_under_cap,
    use_expandable_segments,
)
from quanta.engine.kernel_report import kernel_report
from quanta.engine.memory_plan import activation_peak as plan_activation_peak
from quanta.engine.memory_report import free_bytes, weight_memory
from quanta.engine.model_loader import build_model, open_checkpoint
from quanta.engine.outputs import Logprob, RequestOutput
from quanta.engine.parallel import TensorParallel, check_shardable, check_world, kv_head_range, rank_config
from quanta.engine.parallel import start as start_group
from quanta.engine.runner import LaunchedStep, ModelRunner, blocks_spanned, dummy_batch
from quanta.engine.sampler import top_logprobs
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.scheduler import Scheduler
from quanta.engine.tp_step import send_stop
from quanta.engine.sequence import Sequence
from quanta.kernels.device_caps import use_triton
from quanta.loaders.checkpoint import Checkpoint
from quanta.quant.errors import ConfigError, QuantaError

log = logging.getLogger(__name__)

# What close() lets go of: the weights, KV cache, runner (its buffers and CUDA graphs), pool, scheduler,
# requests and the checkpoint (its open files).
HELD = ("model", "kv_cache", "runner", "pool", "scheduler", "requests", "_in_flight", "checkpoint", "generator")


class EngineClosedError(QuantaError, RuntimeError):
    """An engine (or the LLM over it) was used after close()."""


class RequestFailedError(QuantaError, RuntimeError):
    """One request failed alone (its logits processor or its text decoding raised; RequestOutput.error
    says how); the engine and the other requests go on."""


@dataclass(eq=False)
class Request:
    """One prompt and its `params.n` samples (sample 0 first; the rest fork from it after its prefill)."""
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    error: str | None = None            # set when the request failed alone (EngineCore._fail)

    @property
    def finished(self) -> bool:
        """Whether every sample of the request exists and has finished."""
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)


class EngineCore:
    """`triton_ops`: whether the elementwise ops, the KV store and attention run as Triton kernels; None
    (the default) asks use_triton(device, dtype). Tests pass True to run the CUDA path under Triton's
    interpreter on the CPU. `checkpoint`: build from this opened checkpoint instead of opening
    config.model (a caller that has opened it already)."""

    def __init__(self, config: EngineConfig, triton_ops: bool | None = None, checkpoint: Checkpoint | None = None,
                 tp: TensorParallel | None = None):
        world, rank = (tp.world, tp.rank) if tp else (check_world(config), int(os.environ.get("RANK", "0")))
        self.config = cfg = config if world == 1 else rank_config(config, rank, world)
        self.tp = tp                                       # given to a spawned worker; rank 0 starts it below
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
        block_bytes = bytes_per_block(mc.num_hidden_layers, cfg.block_size, self.kv_heads[1] - self.kv_heads[0],
                                      mc.head_dim, self.dtype, cfg.kv_cache_dtype)
        num_blocks = blocks_from_config(cfg, block_bytes)
        if num_blocks is not None:
            check_capacity(num_blocks, cfg.block_size, self.max_model_len)     # before any weight is built
        if world > 1:                                     # which sizes split, before any process starts
            check_shardable(mc, plan_source(self.checkpoint), world, str(cfg.model))
        total = device_total(self.device)                  # on a GPU: quanta plan's verdict, before loading
        self.plan = None if total is None else check_fits(cfg, mc, plan_source(self.checkpoint), total)
        self.triton = use_triton(self.device, self.dtype) if triton_ops is None else triton_ops
        kv_scales = checkpoint_kv_scales(dict(self.checkpoint.kv_cache_scales), mc.num_hidden_layers,
                                         mc.num_key_value_heads)
        if kv_scales is not None:
            kv_scales = tuple(s[:, self.kv_heads[0]:self.kv_heads[1]] for s in kv_scales)
        if world > 1 and self.tp is None:
            self.tp = start_group(cfg)
        if self.device.type == "cuda":
            use_expandable_segments()
        allocated_before = self._allocated()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            with out_of_memory("loading the weights", self.plan):
                self.model = build_model(self.checkpoint, self.device, self.dtype, triton=self.triton,
                                         force_kernel=cfg.kernel, quiet=cfg.quiet,
                                         lm_head_dtype=cfg.lm_head_dtype(self.dtype), tp=self.tp)
            self.weight_bytes = self._allocated() - allocated_before
            check_weights_under_cap(cfg, self.weight_bytes)
        except BaseException as e:
            if self.tp is not None:
                self.tp.fail(e)                            # every rank raises, rank 0 the failing rank's error
            raise
        # What the load itself held at its height (weights so far + one module's transient), measured.
        self.load_peak = (torch.cuda.max_memory_allocated(self.device) - allocated_before
                          if self.device.type == "cuda" else None)
        if self.tp is not None:
            self.tp.agree(None)
            if self.device.type == "cuda" and not cfg.disable_custom_all_reduce:
                self.tp.start_one_shot(self.dtype, mc.hidden_size)
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.activation_peak: int | None = None           # measured by the dry run, where one runs
        if num_blocks is None:
            with out_of_memory("profiling the largest step", self.plan):
                self.activation_peak = self._activation_peak()
            num_blocks = blocks_from_gpu_memory(cfg, block_bytes, self.weight_bytes, self.activation_peak)
            if self.tp is not None:
                num_blocks = self.tp.min_int(num_blocks)  # rank 0 schedules for every rank's cache
            check_capacity(num_blocks, cfg.block_size, self.max_model_len)
        self.num_kv_blocks = num_blocks
        with out_of_memory(f"allocating the KV cache ({num_blocks} blocks)", self.plan):
            self.kv_cache = self._new_cache(num_blocks, kv_scales)
        graphs = self.device.type == "cuda" and not cfg.enforce_eager
        reserved_before = torch.cuda.memory_reserved(self.device) if graphs else 0
        with out_of_memory("capturing CUDA graphs" if graphs else "building the runner", self.plan):
            self.runner = ModelRunner(self.model, self.kv_cache, self.max_model_len, cfg.max_num_seqs,
                                      cfg.max_num_batched_tokens, self.generator, cuda_graphs=graphs)
        # The graphs' pool and the runner's static buffers, as the allocator grew for them.
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - reserved_before if graphs else 0
        self.pool = BlockPool(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.async_scheduling)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._in_flight: LaunchedStep | None = None    # launched ahead by async scheduling, not collected
        if self.tp is not None and self.tp.torchrun and self.tp.is_worker:
            self.serve()                                   # torchrun's other ranks serve rank 0, then exit
            raise SystemExit(0)

    # --- the loop -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt: str | None = None) -> str:
        """Queue one tokenized prompt (`prompt`: its text, echoed in the outputs); returns the request id."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ConfigError("prompt is empty: it must have at least one token")
        vocab = self.checkpoint.config.vocab_size
        try:
            prompt_ids = [operator.index(t) for t in prompt_ids]
        except TypeError:
            prompt_ids = None
        if prompt_ids is None or not all(0 <= t < vocab for t in prompt_ids):
            # An id off the embedding table would fail the whole batch's step (on a GPU, the context).
            raise ConfigError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(prompt_ids)} tokens leaves no room under "
                              f"max_model_len={self.max_model_len}")
        rid = str(next(self._request_counter)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ConfigError(f"request id {rid!r} is already running")
        req = self.requests[rid] = Request(rid, prompt, list(prompt_ids), params)
        self.scheduler.add(self._new_seq(req))
        return rid

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
        touched = self._fold(*self.runner.collect(current))
        return [self._output(req) for req in touched if stream or req.finished]

    def has_unfinished(self) -> bool:
        """Whether any request still waits or runs."""
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its output so far, finish_reason "abort" (None if unknown)."""
        req = self.requests.get(str(request_id))
        if req is None:
            return None
        self.scheduler.abort(req.request_id)
        for seq in req.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        while len(req.seqs) < req.params.n:
            self._new_seq(req).finish_reason = "abort"
        return self._output(req)

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
            activation = plan_activation_peak(mc, mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim,
                                         mc.intermediate_size, tokens, min(tokens, cfg.max_num_seqs), e,
                                         dequantized=self.device.type == "cuda")
            activation_source = "plan estimate"
        if self.device.type != "cuda":
            graphs, graphs_source = 0, "none (no CUDA graphs off the GPU)"
        elif cfg.enforce_eager:
            graphs, graphs_source = 0, "none (enforce_eager)"
        elif self.graph_bytes > 0:
            graphs, graphs_source = self.graph_bytes, "measured (reserved while capturing)"
        else:
            graphs, graphs_source = GRAPH_MEMORY_MARGIN, "margin (the capture reserved nothing new)"
        return {"device": str(self.device), "weights": weight_memory(self.model), "load_peak": self.load_peak,
                "kv_cache": self.kv_cache.nbytes,
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
            torch.cuda.empty_cache()

    def __getattr__(self, name: str):
        """Only reached for a missing attribute: after close(), what it let go of."""
        if self.__dict__.get("_closed"):
            raise EngineClosedError(f"{self.config.model}: the engine was closed (close(), a with block's end); "
                                    "create a new LLM to use the model again")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # --- construction -------------------------------------------------------------------------------
    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def _new_cache(self, num_blocks: int, scales=None) -> PagedKVCache:
        mc = self.checkpoint.config
        return PagedKVCache(mc.num_hidden_layers, num_blocks, self.config.block_size,
                            self.kv_heads[1] - self.kv_heads[0], mc.head_dim, self.dtype, self.device, self.config.kv_cache_dtype, scales, self.triton)

    def _activation_peak(self) -> int:
        """Peak activation bytes of the largest step, from a dry run on a scratch runner and cache."""
        cfg = self.config
        blocks = blocks_spanned(dummy_batch(cfg.max_num_batched_tokens, self.max_model_len, cfg.block_size))
        scratch = ModelRunner(self.model, self._new_cache(blocks), self.max_model_len, cfg.max_num_seqs,
                              cfg.max_num_batched_tokens)
        peak = scratch.profile_peak_memory()
        del scratch
        torch.cuda.empty_cache()
        return peak

    # --- requests -------------------------------------------------------------------------------
    def _launch_next(self) -> LaunchedStep | None:
        """The step launched ahead, unless every sequence in it has ended since; else a new one, if any."""
        launched, self._in_flight = self._in_flight, None
        if launched is not None and not all(seq.finished for seq in launched.seqs):
            return launched
        batch = self.scheduler.schedule()
        return self.runner.launch(batch) if batch else None

    def _new_seq(self, req: Request) -> Sequence:
        """The request's next sample (its own generator when seeded; samples share sample 0's)."""
        p = req.params
        generator = torch.Generator(device=self.device).manual_seed(p.seed) if p.seed is not None else None
        if req.seqs:
            generator = req.seqs[0].generator
        seq = Sequence(req.request_id, len(req.seqs), req.prompt_ids, p, generator,
                       logprobs=[] if p.logprobs is not None else None,
                       max_len=self.max_model_len if p.max_tokens is None
                       else min(self.max_model_len, len(req.prompt_ids) + p.max_tokens))
        req.seqs.append(seq)
        return seq

    def _fold(self, seqs: list[Sequence], tokens: list[int], raw: torch.Tensor | None,
              errors: dict[int, Exception]) -> list[Request]:
        """Fold sampled tokens into their sequences: logprobs, stop rules, n > 1 forks, finishing. A row
        whose sampling failed (`errors`: its logits processor) or whose folding raises (its tokenizer
        decode) fails its request alone (_fail); the other rows fold as usual."""
        touched: dict[str, Request] = {}
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:                 # ended (stop, EOS, abort, error) while this step was in flight
                continue
            req = touched[seq.request_id] = self.requests[seq.request_id]
            error = errors.get(row)
            if error is None:
                try:
                    self._fold_one(req, seq, token, None if raw is None else raw[row])
                except Exception as e:
                    error = e
            if error is not None:
                self._fail(req, seq, error)
        return list(touched.values())

    def _fold_one(self, req: Request, seq: Sequence, token: int, raw: torch.Tensor | None) -> None:
        if seq.logprobs is not None:
            chosen, top = top_logprobs(raw, token, seq.params.logprobs)
            seq.cumulative_logprob += chosen
            seq.logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t]) if self.tokenizer else None)
                                 for t, (lp, rank) in top.items()})
        seq.append(token, self.tokenizer, self.eos_ids)
        while not req.forked and len(req.seqs) < req.params.n:
            self.scheduler.fork(seq, self._new_seq(req))
        req.forked = True
        if seq.finished:
            self.scheduler.finish(seq)

    def _fail(self, req: Request, seq: Sequence | None, error: Exception) -> None:
        """End `req` with finish_reason "error" on its unfinished samples (and on `seq`, the one that
        failed) and free its blocks: a failure of the request's own code or text, which the rest of the
        batch never sees. The reason is kept as `error` for its last RequestOutput."""
        log.warning("request %s failed alone: %s: %s", req.request_id, type(error).__name__, error)
        req.error = f"{type(error).__name__}: {error}"
        for dropped in self.scheduler.abort(req.request_id):
            dropped.finish_reason = "error"
        if seq is not None:
            seq.finish_reason = "error"
        while len(req.seqs) < req.params.n:
            self._new_seq(req).finish_reason = "error"

    def _output(self, req: Request) -> RequestOutput:
        for seq in req.seqs:
            if not seq.finished:
                try:
                    seq.sync_text(self.tokenizer)     # incremental: O(1) per new token
                except Exception as e:
                    self._fail(req, None, e)
                    break
        done = req.finished or any(s.finish_reason in ("abort", "error") for s in req.seqs)
        if done:
            self.requests.pop(req.request_id, None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [s.to_output() for s in req.seqs],
                             finished=done, error=req.error)
