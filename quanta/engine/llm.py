"""LLM: the offline API. `LLM(model=...).generate(prompts, SamplingParams(...))` -> RequestOutputs.

This first engine runs one sequence at a time over a contiguous KV cache; the paged,
continuously batched engine replaces `_run_request` and keeps this API.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm import tqdm

from quanta.engine.attention import ContiguousKVCache
from quanta.engine.config import EngineConfig
from quanta.engine.model_loader import build_model, kernel_table
from quanta.engine.outputs import Logprob, RequestOutput
from quanta.engine.sampler import apply_penalties, sample_row, top_logprobs
from quanta.engine.sampling_params import SamplingParams
from quanta.engine.sequence import Sequence
from quanta.loaders import detect, load
from quanta.quant.errors import ConfigError, QuantaError

PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs):
        self.config = cfg = EngineConfig.from_kwargs(str(model), **kwargs)
        family = detect(cfg.model)
        if cfg.quantization not in ("auto", family):
            raise ConfigError(f"quantization={cfg.quantization!r} asked for, but {cfg.model} is {family!r}")
        self.checkpoint = load(cfg.model)
        if cfg.tokenizer is not None:
            from transformers import AutoTokenizer
            self.checkpoint.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
        self.tokenizer = self.checkpoint.tokenizer
        if self.tokenizer is None:
            raise QuantaError(f"{cfg.model}: no tokenizer found; pass tokenizer=DIR")
        mc = self.checkpoint.config
        self.device = torch.device(cfg.device)
        self.dtype = cfg.compute_dtype(mc.torch_dtype)
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                              f"max_position_embeddings={mc.max_position_embeddings}")
        self.model = build_model(self.checkpoint, self.device, self.dtype, force_kernel=cfg.kernel)
        self.eos_ids = sorted(set(mc.eos_token_ids) | ({self.tokenizer.eos_token_id} - {None}))
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self._request_counter = itertools.count()

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
        outputs = []
        for prompt, p in tqdm(list(zip(prompts, params)), desc="generating", disable=not use_tqdm):
            text, ids = self._tokenize(prompt)
            outputs.append(self._run_request(str(next(self._request_counter)), text, ids, p))
        return outputs

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

    def kernels(self) -> list[dict]:
        """Which kernel every linear layer runs, and why."""
        return kernel_table(self.model)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits [T, V] at every position of one token sequence."""
        cache = self._new_cache(len(token_ids))
        return self._forward(token_ids, 0, cache, all_logits=True)

    # --- internals ----------------------------------------------------------------------------
    @staticmethod
    def _token_ids(encoded) -> list[int]:
        ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
        return list(ids)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self._token_ids(self.tokenizer(prompt)["input_ids"])
        return None, list(prompt)

    def _new_cache(self, length: int) -> ContiguousKVCache:
        mc = self.checkpoint.config
        return ContiguousKVCache(mc.num_hidden_layers, length, mc.num_key_value_heads, mc.head_dim,
                                 self.dtype, self.device, mc.sliding_window)

    def _forward(self, ids: list[int], start: int, cache: ContiguousKVCache, all_logits: bool = False):
        input_ids = torch.tensor(ids, device=self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        cache.begin_step(positions)
        hidden = self.model(input_ids, positions, cache)
        return self.model.compute_logits(hidden if all_logits else hidden[-1:])

    @torch.inference_mode()
    def _run_request(self, request_id: str, text: str | None, ids: list[int], p: SamplingParams) -> RequestOutput:
        if not ids:
            raise ConfigError("prompt is empty: it must have at least one token")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt of {len(ids)} tokens leaves no room under max_model_len={self.max_model_len}")
        budget = self.max_model_len if p.max_tokens is None else min(self.max_model_len, len(ids) + p.max_tokens)
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else self.generator
        prefill_cache = self._new_cache(budget)
        prefill_logits = self._forward(ids, 0, prefill_cache)[0]
        seqs = []
        for index in range(p.n):
            seq = Sequence(request_id, index, ids, p, generator, logprobs=[] if p.logprobs is not None else None)
            cache = prefill_cache if index == p.n - 1 else prefill_cache.fork()
            logits = prefill_logits
            while True:
                token = self._sample(logits.clone(), seq)
                seq.append(token, self.tokenizer, self.eos_ids, budget)
                if seq.finished:
                    break
                logits = self._forward([token], seq.num_tokens - 1, cache)[0]
            seqs.append(seq)
        return RequestOutput(request_id, text, ids, [s.to_output() for s in seqs], finished=True)

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        raw = logits.clone() if p.logprobs is not None else None
        token = sample_row(apply_penalties(logits, seq.prompt_ids, seq.output_ids, p), p, seq.generator)
        if raw is not None:
            chosen, top = top_logprobs(raw, token, p.logprobs)
            seq.cumulative_logprob += chosen
            seq.logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t])) for t, (lp, rank) in top.items()})
        return token

