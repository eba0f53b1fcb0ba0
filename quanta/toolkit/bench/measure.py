"""What `quanta bench` measures of one model on one engine: the weights it holds, the KV capacity the memory plan
gives it under each budget (and, on a GPU, the plan's capacity against the engine's own), batch-1 decode tok/s
and its share of the bandwidth roofline, the time to the first token of a long prompt, offline throughput, and
the quality `quanta validate` finds against a reference."""
from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from quanta.quant.errors import QuantaError


@dataclass(frozen=True)
class Settings:
    """How a bench run measures (every model the same way)."""
    device: str | None = None
    budgets: tuple[str, ...] = ("24GiB", "16GiB")
    decode_input: int = 128         # batch-1 decode: a prompt of this many tokens, then decode_output tokens
    decode_output: int = 128
    ttft_input: int = 512           # time to the first token of a prompt this long
    num_prompts: int = 200          # offline throughput: this many requests of throughput_input / _output
    throughput_input: int = 512
    throughput_output: int = 128
    runs: int = 3                   # timed repetitions of decode and TTFT (median)
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    windows: int = 4                # quality: windows of ctx tokens of WikiText-2 against the reference
    ctx: int = 512

    @classmethod
    def small(cls, **kw: Any) -> Settings:
        """Sizes for a CPU (or a quick look): short prompts, few requests, two runs, two short windows."""
        return cls(**{**dict(decode_input=32, decode_output=24, ttft_input=128, num_prompts=16, throughput_input=64,
                             throughput_output=16, runs=2, windows=1, ctx=256), **kw})

    @property
    def max_model_len(self) -> int:
        return max(self.decode_input + self.decode_output, self.ttft_input + 1,
                   self.throughput_input + self.throughput_output, self.ctx) + 16


@dataclass
class Row:
    """One model's figures (None where not measured); `error` says why a model could not be measured."""
    model: str
    format: str
    engine: str = "quanta"
    weights_bytes: int | None = None
    kv_tokens: dict[str, int | None] = field(default_factory=dict)      # budget -> plan's KV capacity, tokens
    kv_engine_over_plan: float | None = None                             # GPU: the engine's capacity / the plan's
    decode_tok_s: float | None = None
    roofline_share: float | None = None
    ttft_ms: float | None = None
    throughput_tok_s: float | None = None
    best_batch: int | None = None                                        # peers: the batch of their best throughput
    sweep: dict[int, float] = field(default_factory=dict)               # peers: output tok/s at each batch tried
    sweep_end: str | None = None                                         # peers: why the sweep stopped there
    perplexity: float | None = None
    kl: float | None = None
    top1: float | None = None
    kernels: list[str] = field(default_factory=list)
    error: str | None = None


def measure(model: str, fmt: str, path: str, s: Settings, bandwidth: float | None,
            reference: str | None = None) -> Row:
    """The Row of the model at `path` (a checkpoint or synthetic spec), measured by one engine."""
    from quanta.engine import LLM

    row = Row(model, fmt)
    try:
        row.kv_tokens = {b: plan_capacity(path, b, s) for b in s.budgets}
        with LLM(path, device=s.device, max_model_len=s.max_model_len, kv_cache_dtype=s.kv_cache_dtype,
                 gpu_memory_utilization=s.gpu_memory_utilization, enable_prefix_caching=False, quiet=True) as llm:
            weights = llm.memory()["weights"]
            row.weights_bytes = weights["total"]
            row.kernels = sorted({f"{k['scheme']} -> {k['kernel']}" for k in llm.kernels(m=(1,))})
            if llm.core.plan is not None:
                engine = llm.num_kv_blocks * llm.config.block_size
                row.kv_engine_over_plan = round(engine / max(1, llm.core.plan.kv_capacity_tokens), 3)
            row.decode_tok_s, row.ttft_ms = decode_and_ttft(llm, s)
            if bandwidth is not None:
                read = sum(e["bytes"] for k, e in weights.items() if k != "total" and not k.startswith("embedding"))
                row.roofline_share = round(row.decode_tok_s / (bandwidth / read), 3)
            row.throughput_tok_s = throughput(llm, s)
        if reference is not None:
            row.perplexity, row.kl, row.top1 = quality(path, reference, s)
    except (QuantaError, torch.cuda.OutOfMemoryError, RuntimeError) as e:
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        release()
    return row


def plan_capacity(path: str, budget: str, s: Settings) -> int | None:
    """The memory plan's KV capacity (tokens) of the model on one GPU of `budget`; None where it does not fit or
    the plan cannot model the checkpoint."""
    from quanta.planner.memory_plan import plan
    try:
        p = plan(path, gpus=f"1x{budget}", max_model_len=s.max_model_len, kv_cache_dtype=s.kv_cache_dtype,
                 gpu_memory_utilization=s.gpu_memory_utilization)
    except QuantaError:
        return None
    return p.kv_capacity_tokens if p.fits else 0


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n random token ids (never the first and last ten: specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, max(11, vocab - 10), (n,), generator=g).tolist()


def _sync(llm) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def _timed(llm, prompts: list[list[int]], tokens: int) -> float:
    from quanta.engine import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    _sync(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync(llm)
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return time.perf_counter() - start


def decode_and_ttft(llm, s: Settings) -> tuple[float, float]:
    """(batch-1 decode tok/s, ms to the first token of a ttft_input-token prompt), medians of `runs` after a
    warm-up. Decode: (a decode_output-token generation - its prompt's first token) / (decode_output - 1)."""
    vocab = llm.checkpoint.config.vocab_size
    short, long = prompt(s.decode_input, vocab, 1), prompt(s.ttft_input, vocab, 2)
    _timed(llm, [short], 4)
    _timed(llm, [long], 1)
    first = statistics.median(_timed(llm, [short], 1) for _ in range(s.runs))
    total = statistics.median(_timed(llm, [short], s.decode_output) for _ in range(s.runs))
    ttft = statistics.median(_timed(llm, [long], 1) for _ in range(s.runs))
    return round((s.decode_output - 1) / max(total - first, 1e-9), 1), round(ttft * 1e3, 1)


def throughput(llm, s: Settings) -> float:
    """Output tok/s of num_prompts requests at once (after a warm-up on other prompts of the same lengths)."""
    vocab = llm.checkpoint.config.vocab_size
    warm = max(1, min(s.num_prompts, 16))
    _timed(llm, [prompt(s.throughput_input, vocab, 1000 + i) for i in range(warm)], s.throughput_output)
    prompts = [prompt(s.throughput_input, vocab, 2000 + i) for i in range(s.num_prompts)]
    return round(s.num_prompts * s.throughput_output / _timed(llm, prompts, s.throughput_output), 1)


def quality(path: str, reference: str, s: Settings) -> tuple[float, float | None, float | None]:
    """(perplexity, mean KL, top-1 agreement) of the model against `reference` on WikiText-2 (quanta validate)."""
    from quanta.eval import validate
    options: dict[str, Any] = {"device": s.device, "quiet": True}
    r = validate(path, reference=reference, ctx=s.ctx, n_windows=s.windows, model_options=options,
                 layer_errors=False, progress=False)
    kl = r.kl
    return (round(r.perplexity, 4), None if kl is None else round(kl.mean, 5),
            None if kl is None else round(kl.top1_agreement, 4))


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 10: the roofline's denominator."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best


def release() -> None:
    """Let an engine's memory go before the next model loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
