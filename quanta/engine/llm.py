"""LLM: the offline API, a thin driver of one EngineCore (vLLM's names).

    llm = LLM(model=..., kv_cache_dtype="fp8")
    llm.generate(prompts, SamplingParams(...))            # -> RequestOutputs, in prompt order
    llm.chat(messages, SamplingParams(...))               # the tokenizer's chat template, then generate
    LLM(model=..., enable_lora=True, max_loras=4).generate(prompts, params, lora_request=LoRARequest(...))
    rid = llm.add_request(prompt, params); llm.step() ... # incremental; llm.abort(rid)
    llm.memory()                                          # bytes held: weights by kernel, KV cache, ...
    with LLM(model=...) as llm: ...                       # close() at the end: weights and cache let go

LLM only turns prompts into token ids and loops: the rest is the core's (core.py). The core's parts
(model, tokenizer, pool, scheduler, runner, kv_cache, ...) read through as `llm.<part>`.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch
from tqdm import tqdm

from quanta.engine.chat_template import chat_token_ids, token_ids
from quanta.engine.config import EngineConfig
from quanta.engine.core import EngineCore
from quanta.engine.outputs import RequestOutput
from quanta.engine.sampling_params import SamplingParams
from quanta.lora.request import LoRARequest
from quanta.quant.errors import ConfigError, QuantaError

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """`LLM(model, **kwargs)`: kwargs are EngineConfig's fields; unknown names are refused."""

    def __init__(self, model: str, **kwargs):
        self.core = EngineCore(EngineConfig.from_kwargs(str(model), **kwargs))

    @classmethod
    def from_core(cls, core: EngineCore) -> LLM:
        """The offline API over a core built elsewhere (e.g. with EngineCore's triton_ops); the LLM owns
        it from then on: closing or deleting the LLM closes the core."""
        llm = cls.__new__(cls)
        llm.core = core
        return llm

    def __getattr__(self, name: str):
        """The core's parts and settings (config, tokenizer, model, device, dtype, pool, ...)."""
        if name == "core":               # not set yet: no recursion while unpickling or half-built
            raise AttributeError(name)
        return getattr(self.core, name)

    # --- memory -------------------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        """Bytes held, by part: "weights" ({"total", "<scheme> -> <kernel>": {"bytes", "stored_bytes",
        "layers"}, "embedding ...", "norms"}; the dequantized fallback's entries add "expanded_by", held
        over stored), "load_peak" (on a GPU, the most the load held at once: weights so far plus one
        module's transient; None elsewhere), "kv_cache" (and "kv_cache_blocks"), "activation_peak" (the dry run's on a GPU that
        profiled, else the plan's estimate; "activation_source" says which), "cuda_graphs" (measured
        where the capture grew the allocator, else the plan's margin; "cuda_graphs_source") and "free"
        (on the device; the host's available memory on the CPU)."""
        return self.core.memory()

    def close(self) -> None:
        """Free the weights, KV cache, runner buffers and CUDA graphs (on CUDA the cached blocks go back
        to the driver). Idempotent; using the LLM afterwards raises EngineClosedError. Also run on
        leaving a `with` block and when the LLM is deleted."""
        core = self.__dict__.get("core")
        if core is not None:
            core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    # --- offline ------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}).
        `use_tqdm`: a progress bar (default: unless the engine is quiet). `lora_request`: the adapter of every
        prompt, or a list of one per prompt (None for the base model); needs enable_lora."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                  and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ConfigError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        tokenized = [self._tokenize(prompt) for prompt in prompts]
        ids = [self.add_request(prompt, p, lora_request=lora) for prompt, p, lora in zip(tokenized, params, loras)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not self._progress(use_tqdm)) as bar:
            while len(done) < len(ids) and self.core.has_unfinished():
                for out in self.core.step(stream=False):
                    done[out.request_id] = out
                    bar.update(1)
        return [done[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | None = None, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate (with
        `lora_request` as generate takes it)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.core.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise QuantaError(f"{self.core.config.model}: the tokenizer has no chat template; use generate()")
        prompts = [{"prompt_token_ids": chat_token_ids(tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                                       **template_kwargs)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # --- incremental --------------------------------------------------------------------------
    def add_request(self, prompt: PromptType | tuple[str | None, list[int]], params: SamplingParams | None = None,
                    request_id: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Queue one prompt (with `lora_request`'s adapter, or none); its outputs come from step(). Returns the
        request id."""
        text, ids = self._tokenize(prompt)
        return self.core.add_request(ids, params, request_id, prompt=text, lora_request=lora_request)

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """One engine iteration; the outputs of the requests that advanced (only the finished ones
        unless `stream`)."""
        return self.core.step(stream)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; its output so far, finish_reason "abort"."""
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request still waits or runs."""
        return self.core.has_unfinished()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 next-token logits [T, V] at every position of one token sequence."""
        return self.core.prompt_logits(token_ids)

    def kernels(self, m: tuple[int, ...] = (1, 16, 256)) -> list[dict]:
        """Per GEMM as it runs (merged q/k/v and gate/up, the lm_head with its own dtype): name, shape,
        scheme, dtype, compute_dtype, kernel, reason, and paths {M: (path, reason)} at each M."""
        return self.core.kernels(m)

    # --- prompts ------------------------------------------------------------------------------
    def _progress(self, use_tqdm: bool | None) -> bool:
        """Whether to show a progress bar: as asked, else unless the engine is quiet."""
        return use_tqdm if use_tqdm is not None else not self.core.config.quiet

    def _tokenize(self, prompt: PromptType | tuple[str | None, list[int]]) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text, token ids, or a vLLM prompt dict."""
        if isinstance(prompt, tuple):
            return prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.core.tokenizer is None:
                raise QuantaError(f"{self.core.config.model}: no tokenizer; pass prompts as token ids or tokenizer=DIR")
            return prompt, token_ids(self.core.tokenizer(prompt)["input_ids"])
        return None, list(prompt)
