"""The peers `quanta bench` runs beside quanta, each at its best: transformers fp16 `generate` and transformers
with bitsandbytes NF4, their batch size doubled until memory runs out or throughput stops rising, and
llama.cpp (llama-cpp-python) on the GGUF variants. A peer that is not installed is reported as such."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from quanta.toolkit.bench.measure import Row, Settings, prompt, release
from quanta.toolkit.bench.names import PEERS

GAIN = 1.03                 # a doubling of the batch must add 3% throughput to go on
MAX_BATCH = {"cuda": 4096, "cpu": 16}  # the largest batch tried: bounds a small model's sweep (memory ends a big one)


def parse_peers(spec: str | list[str] | None) -> list[str]:
    """Peer names from a comma list ("none" or empty: no peers)."""
    from quanta.quant.errors import ConfigError
    names = [] if spec is None else spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip() and n.strip() != "none"]
    for n in names:
        if n not in PEERS:
            raise ConfigError(f"peer {n!r} is not one of {', '.join(PEERS)}")
    return names


def missing(peer: str) -> str | None:
    """Why `peer` cannot run here (a package not installed), or None."""
    need = {"transformers": "transformers", "transformers-bnb": "bitsandbytes", "llama.cpp": "llama_cpp"}[peer]
    return None if importlib.util.find_spec(need) else f"{need} is not installed"


def peer_dtype(device: torch.device) -> torch.dtype:
    """What transformers runs in: float16 on a GPU, float32 on the CPU (where its float16 matmuls are slow)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def transformers_model(source: str, device: torch.device, bnb: bool):
    """A transformers model of `source` in peer_dtype: random weights at a published shape, or an HF checkpoint
    directory; with `bnb`, its decoder linears in bitsandbytes NF4 (the lm_head kept, as transformers keeps it)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    dtype = peer_dtype(device)
    if Path(source).exists():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    else:
        from quanta.loaders.shapes import known_config
        cfg = known_config(source).to_hf_dict()
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    if bnb:
        to_nf4(model, device)
    return model.to(device).eval()


def to_nf4(model: torch.nn.Module, device: torch.device) -> None:
    """Every nn.Linear but the lm_head becomes a bitsandbytes Linear4bit (NF4, float16 compute), quantized as it
    moves to `device`, as transformers' load_in_4bit builds it."""
    import bitsandbytes as bnb
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for name, lin in linears:
        parent, _, child = name.rpartition(".")
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=lin.weight.dtype, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(lin.weight.data.to(device), requires_grad=False, quant_type="nf4")
        if lin.bias is not None:
            q.bias = torch.nn.Parameter(lin.bias.data.to(device), requires_grad=False)
        setattr(model.get_submodule(parent), child, q.to(device))


@torch.inference_mode()
def sweep(model, s: Settings, vocab: int, device: torch.device, max_batch: int) -> tuple[dict[int, float], str]:
    """Output tok/s of `generate` at batch 1, 2, 4, ... (throughput_input in, throughput_output out), until
    memory runs out, the batch reaches max_batch or doubling it adds less than GAIN; and why it ended."""
    results: dict[int, float] = {}
    batch = 1
    while batch <= max_batch:
        ids = torch.tensor([prompt(s.throughput_input, vocab, 3000 + i) for i in range(batch)], device=device)
        try:
            model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=2,
                           min_new_tokens=2, do_sample=False, pad_token_id=0)      # warm-up at this batch
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.throughput_output,
                           min_new_tokens=s.throughput_output, do_sample=False, pad_token_id=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            release()
            return results, f"out of memory at batch {batch}"
        results[batch] = round(batch * s.throughput_output / (time.perf_counter() - start), 1)
        if batch > 1 and results[batch] < GAIN * results[batch // 2]:
            return results, f"batch {batch} added under {GAIN - 1:.0%}"
        batch *= 2
    return results, f"the cap of batch {max_batch}"


def run_transformers(model: str, source: str, s: Settings, bnb: bool) -> Row:
    """transformers fp16 (or bitsandbytes NF4) `generate` at its best batch: decode tok/s at batch 1, the best
    throughput and its batch, the weights' bytes."""
    device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = str(peer_dtype(device)).removeprefix("torch.")
    row = Row(model, "nf4 (bitsandbytes)" if bnb else dtype, engine="transformers")
    try:
        hf = transformers_model(source, device, bnb)
        row.weights_bytes = sum(t.numel() * t.element_size() for t in (*hf.parameters(), *hf.buffers()))
        results, row.sweep_end = sweep(hf, s, hf.config.vocab_size, device, MAX_BATCH.get(device.type, 16))
        row.sweep = results
        row.decode_tok_s = results.get(1)
        row.best_batch = max(results, key=results.get) if results else None
        row.throughput_tok_s = results.get(row.best_batch)
        del hf
    except (ImportError, RuntimeError, ValueError, OSError) as e:
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'not supported'}"
    finally:
        release()
    return row


def run_llama_cpp(model: str, fmt: str, path: str, s: Settings) -> Row:
    """llama.cpp on one GGUF file: batch-1 decode tok/s (its own timings), all layers on the GPU when there is
    one, every core's thread otherwise."""
    import os

    from llama_cpp import Llama
    row = Row(model, fmt, engine="llama.cpp", weights_bytes=Path(path).stat().st_size)
    try:
        llm = Llama(model_path=path, n_ctx=s.max_model_len, n_gpu_layers=-1 if torch.cuda.is_available() else 0,
                    n_threads=os.cpu_count(), verbose=False, seed=0)
        ids = prompt(s.decode_input, llm.n_vocab(), 1)
        times = []
        for _ in range(s.runs + 1):
            llm.reset()
            start = time.perf_counter()
            llm.eval(ids)
            first = time.perf_counter()
            for _ in range(s.decode_output - 1):
                llm.eval([llm.sample(temp=0.0)])
            times.append((time.perf_counter() - first, first - start))
        decode = sorted(t for t, _ in times[1:])[len(times[1:]) // 2]
        row.decode_tok_s = round((s.decode_output - 1) / decode, 1)
        del llm
    except (RuntimeError, ValueError, OSError) as e:
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row
