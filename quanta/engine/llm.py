"""LLM: the offline API and the incremental engine loop.

    llm = LLM(model=..., kv_cache_dtype="fp8")
    llm.generate(prompts, SamplingParams(...))            # -> RequestOutputs, in prompt order
    rid = llm.add_request(prompt, params); llm.step() ... # the server's loop; llm.abort(rid)

Each step the scheduler picks sequences and token counts (continuous batching, chunked prefill,
preemption), the runner runs them as one flat batch over the paged KV cache and samples, and the
results are folded back into the sequences. `n > 1` samples share the prompt's blocks (fork after
the first sample's prefill).

Async scheduling (on by default on CUDA): in steady decode, the next step is launched before this
step's tokens reach the host, its input ids read on the device from this step's samples, so the host's
bookkeeping (stop rules, detokenizing, scheduling) overlaps the GPU instead of idling it. It applies only
where the synchronous schedule would pick the same step (see Scheduler.schedule_lookahead) and every
sequence samples without penalties, seeds or logprobs; a sequence that the pending token ends (EOS, a
stop) has its extra token dropped. Outputs are those of the synchronous loop.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from quanta.engine.block_pool import BlockPool
from quanta.engine.config import EngineConfig
from quanta.engine.kv_cache import PagedKVCache, bytes_per_block, checkpoint_kv_scales
from quanta.engine.model_loader import build_model, kernel_table
from quanta.engine.outputs import Logprob, RequestOutput
from quanta.engine.runner import LaunchedStep, ModelRunner
from quanta.engine.sampler import is_plain, top_logprobs
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.scheduler import ScheduledSeq, Scheduler
from quanta.engine.sequence import Sequence
from quanta.engine.synthetic import is_synthetic, load_synthetic
from quanta.kernels.device_caps import use_triton
from quanta.loaders import detect, load
from quanta.quant.errors import ConfigError, QuantaError

log = logging.getLogger(__name__)
PromptType = str | list[int] | dict[str, Any]
CPU_KV_CACHE_BYTES = 1 << 30
GRAPH_MEMORY_MARGIN = 512 << 20


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.finished for s in self.seqs)


class LLM:
    def __init__(self, model: str, **kwargs):
        self.config = cfg = EngineConfig.from_kwargs(str(model), **kwargs)
        self.device = torch.device(cfg.device)
        self.checkpoint = self._load(cfg)
        mc = self.checkpoint.config
        self.tokenizer = self.checkpoint.tokenizer
        self.dtype = cfg.compute_dtype(mc.torch_dtype)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                              f"max_position_embeddings={mc.max_position_embeddings}")
        kv_scales = self._checkpoint_kv_scales()
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.triton = use_triton(self.device, self.dtype)
        self.model = build_model(self.checkpoint, self.device, self.dtype, triton=self.triton, force_kernel=cfg.kernel,
                                 lm_head_dtype=cfg.lm_head_dtype(self.dtype))
        self.eos_ids = sorted(set(mc.eos_token_ids) | ({getattr(self.tokenizer, "eos_token_id", None)} - {None}))
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.runner = ModelRunner(self.model, self.device, self.max_model_len, cfg.block_size, cfg.max_num_seqs,
                                  cfg.max_num_batched_tokens, self.generator)
        self.weight_bytes = torch.cuda.memory_allocated(self.device) - before if self.device.type == "cuda" else 0
        self.num_kv_blocks = self._plan_kv_blocks()
        self.kv_cache = self._make_cache(self.num_kv_blocks, kv_scales)
        self.runner.kv_cache = self.kv_cache
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self.runner.capture_graphs()
        self.pool = BlockPool(self.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._request_counter = itertools.count()
        self._in_flight: LaunchedStep | None = None   # launched ahead by async scheduling, not collected

    # --- public API ---------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...})."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        ids = [self.add_request(prompt, p) for prompt, p in zip(tokenized, params)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(ids) and self.has_unfinished():
                for out in self.step(stream=False):
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise QuantaError(f"{self.config.model}: the tokenizer has no chat template; use generate()")
        prompts = [{"prompt_token_ids": self._token_ids(self.tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs))}
            for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def add_request(self, prompt: PromptType | tuple[str | None, list[int]], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt; its outputs come from step(). Returns the request id."""
        text, ids = prompt if isinstance(prompt, tuple) else self._tokenize(prompt)
        p = params or SamplingParams()
        if not ids:
            raise ConfigError("prompt is empty: it must have at least one token")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(ids)} tokens leaves no room under max_model_len={self.max_model_len}")
        rid = str(next(self._request_counter)) if request_id is None else str(request_id)
        if rid in self.requests:
            raise ConfigError(f"request id {rid!r} is already running")
        req = self.requests[rid] = Request(rid, text, ids, p)
        self._new_seq(req, 0)
        return rid

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One iteration: schedule, run and sample, fold the tokens back. Returns the outputs of the
        requests that advanced (only the finished ones unless `stream`)."""
        current, self._in_flight = self._in_flight, None
        if current is not None and all(seq.finished for seq in current.seqs):
            current = None                   # launched ahead for sequences that have ended since
        if current is None:
            batch = self.scheduler.schedule()
            if not batch:
                return []
            current = self.runner.launch(batch)
        batch = [it for it in current.batch if not it.seq.finished]
        look_ahead = self.config.async_scheduling and all(
            it.num_tokens == 1 and it.samples and it.seq.output_ids and self._samples_plainly(it.seq)
            for it in batch)
        self.scheduler.update(batch)
        ahead = self.scheduler.schedule_lookahead(batch) if look_ahead else None
        if ahead:
            self._in_flight = self.runner.launch(ahead, after=current)
        touched = self._apply(*self.runner.collect(current))
        return [self._output(r) for r in touched if stream or r.finished]

    @staticmethod
    def _samples_plainly(seq: Sequence) -> bool:
        """Sampling that needs nothing from the host: no penalties, own seed or logprobs."""
        return is_plain(seq.params) and seq.generator is None and seq.logprobs is None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its output so far, finish_reason "abort"."""
        req = self.requests.get(str(request_id))
        if req is None:
            return None
        self.scheduler.abort(req.request_id)
        for seq in req.seqs:
            seq.finish_reason = seq.finish_reason or "abort"
        while len(req.seqs) < req.params.n:
            self._new_seq(req, len(req.seqs), queue=False).finish_reason = "abort"
        return self._output(req)

    def kernels(self) -> list[dict]:
        """Which kernel every linear layer runs, and why."""
        return kernel_table(self.model)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits [T, V] at every position of one token sequence."""
        seq = Sequence("prompt_logits", 0, list(token_ids), SamplingParams())
        if not self.pool.can_allocate(seq, reserve=False) or len(token_ids) > self.max_model_len:
            raise ConfigError(f"{len(token_ids)} tokens do not fit the KV cache / max_model_len")
        self.pool.allocate(seq, use_cache=False)
        try:
            fb, input_ids, positions, _, _ = self.runner.prepare([ScheduledSeq(seq, len(token_ids))])
            fb.calibrate, self.kv_cache.needs_calibration = self.kv_cache.needs_calibration, False
            return self.model.compute_logits(self.model(input_ids, positions, fb))
        finally:
            self.pool.free(seq)

    # --- internals ----------------------------------------------------------------------------
    def _load(self, cfg: EngineConfig):
        if is_synthetic(cfg.model):
            return load_synthetic(cfg.model, self.device)
        family = detect(cfg.model)
        if cfg.quantization not in ("auto", family):
            raise ConfigError(f"quantization={cfg.quantization!r} asked for, but {cfg.model} is {family!r}")
        ckpt = load(cfg.model)
        if cfg.tokenizer is not None:
            from transformers import AutoTokenizer
            ckpt.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        return ckpt

    def _checkpoint_kv_scales(self):
        """Calibrated k/v scales the checkpoint carries for an fp8 KV cache ([L, Hk] each), or None."""
        mc = self.checkpoint.config
        scales = dict(self.checkpoint.kv_cache_scales)
        return checkpoint_kv_scales(scales, mc.num_hidden_layers, mc.num_key_value_heads) if scales else None

    def _make_cache(self, num_blocks: int, scales=None) -> PagedKVCache:
        mc = self.checkpoint.config
        return PagedKVCache(mc.num_hidden_layers, num_blocks, self.config.block_size, mc.num_key_value_heads,
                            mc.head_dim, self.dtype, self.device, self.config.kv_cache_dtype, scales, self.triton)

    def _plan_kv_blocks(self) -> int:
        """KV blocks: the override, else CPU kv_cache_memory, else this engine's share of the GPU
        (gpu_memory_utilization x total, less memory used outside torch) minus its weights and the
        activation peak of a dry run."""
        cfg, mc = self.config, self.checkpoint.config
        per_block = bytes_per_block(mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads, mc.head_dim,
                                    self.dtype, cfg.kv_cache_dtype)
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        elif self.device.type != "cuda":
            blocks = (cfg.kv_cache_memory or CPU_KV_CACHE_BYTES) // per_block
        else:
            peak = self.runner.profile_peak_memory(self._make_cache)
            free, total = torch.cuda.mem_get_info(self.device)
            non_torch = total - free - torch.cuda.memory_reserved(self.device)
            margin = 0 if cfg.enforce_eager else GRAPH_MEMORY_MARGIN
            budget = total * cfg.gpu_memory_utilization - self.weight_bytes - peak - non_torch - margin
            blocks = int(budget) // per_block
            log.info("KV cache: %d blocks (%.2f GiB); weights %.2f GiB, activation peak %.2f GiB", blocks,
                     blocks * per_block / 2**30, self.weight_bytes / 2**30, peak / 2**30)
        if blocks * cfg.block_size < self.max_model_len:
            raise ConfigError(f"the KV cache holds {max(blocks, 0) * cfg.block_size} tokens ({max(blocks, 0)} blocks "
                              f"of {cfg.block_size}), less than max_model_len={self.max_model_len}: lower "
                              "max_model_len or give the cache more memory (gpu_memory_utilization, "
                              "kv_cache_memory, num_kv_blocks)")
        return blocks

    def _new_seq(self, req: Request, index: int, queue: bool = True) -> Sequence:
        p = req.params
        generator = torch.Generator(device=self.device).manual_seed(p.seed) if p.seed is not None else None
        if index and req.seqs:
            generator = req.seqs[0].generator
        seq = Sequence(req.request_id, index, req.prompt_ids, p, generator,
                       logprobs=[] if p.logprobs is not None else None,
                       max_len=self.max_model_len if p.max_tokens is None
                       else min(self.max_model_len, len(req.prompt_ids) + p.max_tokens))
        req.seqs.append(seq)
        if queue:
            self.scheduler.add(seq)
        return seq

    def _apply(self, seqs: list[Sequence], tokens: list[int], raw: torch.Tensor | None) -> list[Request]:
        """Fold sampled tokens into their sequences: logprobs, stop rules, n > 1 forks, finishing."""
        touched: dict[str, Request] = {}
        for row, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finished:                 # ended (stop, EOS, abort) while this step was in flight
                continue
            req = touched[seq.request_id] = self.requests[seq.request_id]
            if seq.logprobs is not None:
                chosen, top = top_logprobs(raw[row], token, seq.params.logprobs)
                seq.cumulative_logprob += chosen
                seq.logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t]) if self.tokenizer else None)
                                     for t, (lp, rank) in top.items()})
            seq.append(token, self.tokenizer, self.eos_ids)
            while not req.forked and len(req.seqs) < req.params.n:
                self.scheduler.fork(seq, self._new_seq(req, len(req.seqs), queue=False))
            req.forked = True
            if seq.finished:
                self.scheduler.finish(seq)
        return list(touched.values())

    def _output(self, req: Request) -> RequestOutput:
        done = req.finished or any(s.finish_reason == "abort" for s in req.seqs)
        if done:
            self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            if not seq.finished:
                seq.decode_text(self.tokenizer)
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [s.to_output() for s in req.seqs],
                             finished=done)

    @staticmethod
    def _token_ids(encoded) -> list[int]:
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(ids)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, tuple):
            return prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise QuantaError(f"{self.config.model}: no tokenizer; pass prompts as token ids or tokenizer=DIR")
            return prompt, self._token_ids(self.tokenizer(prompt)["input_ids"])
        return None, list(prompt)
