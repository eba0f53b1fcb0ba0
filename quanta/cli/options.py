"""The command line's shared options: engine (what LLM(...) takes), sampling, and output control.

Every value is checked when the command line is parsed, before a model is loaded: a bad sampling
flag fails in milliseconds, not after the weights are in memory.
"""
from __future__ import annotations

import argparse
import re

from quanta.quant.errors import ConfigError
from quanta.sizes import parse_bytes

def byte_size(text: str) -> int:
    """`4GiB`, `512MiB`, `2GB` or a plain number of bytes, as bytes."""
    value = parse_bytes(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4GiB, 512MiB, 2GB, 1048576)")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return int(value)


def token_ids(text: str) -> list[int]:
    """`1,2,3` or `1 2 3` as a list of token ids."""
    try:
        ids = [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integer token ids (e.g. 1,2,3)") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: token ids must be a non-empty list of integers >= 0")
    return ids


def quiet_parent() -> argparse.ArgumentParser:
    """`-q` accepted after the sub-command as well as before it (SUPPRESS keeps the earlier value)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                        help="no progress bars or info logs")
    return parent


# (flag, LLM keyword, argparse keywords): the engine options, passed on only when given.
ENGINE_OPTIONS: list[tuple[str, str, dict]] = [
    ("--tokenizer", "tokenizer", dict(help="tokenizer directory overriding the checkpoint's own")),
    ("--quantization", "quantization", dict(help="expected checkpoint family (gguf, awq, gptq, ...); "
                                                 "default auto")),
    ("--dtype", "dtype", dict(help="compute dtype: auto, float32, bfloat16, float16")),
    ("--device", "device", dict(help="cpu or cuda (default: cuda when available)")),
    ("--kernel", "kernel", dict(help="force one kernel by name for every quantized layer (default auto: quanta "
                                     "chooses per layer; `quanta inspect` lists the choices)")),
    ("--max-model-len", "max_model_len", dict(type=int, help="context length (default: the model's)")),
    ("--kv-cache-dtype", "kv_cache_dtype", dict(help="auto, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2")),
    ("--block-size", "block_size", dict(type=int, help="tokens per KV-cache block")),
    ("--gpu-memory-utilization", "gpu_memory_utilization",
     dict(type=float, help="share of GPU memory for weights, activations and KV cache (0..1]")),
    ("--kv-cache-memory", "kv_cache_memory", dict(type=byte_size, help="CPU: KV-cache size, e.g. 2GiB")),
    ("--max-gpu-memory", "max_gpu_memory", dict(help="cap this process's GPU memory, e.g. 15GiB or a card name "
                                                     "(t4): one large GPU stands for a smaller card")),
    ("--num-kv-blocks", "num_kv_blocks", dict(type=int, help="fix the number of KV-cache blocks")),
    ("--max-num-seqs", "max_num_seqs", dict(type=int, help="most sequences in one step")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", dict(type=int, help="token budget of one step")),
    ("--schedule-conservativeness", "schedule_conservativeness",
     dict(type=float, help="room kept for running requests' growth when admitting new ones (default 1; 0: admit "
                           "whatever fits now and preempt later)")),
    ("--tensor-parallel-size", "tensor_parallel_size", dict(type=int, help="ranks (one process and GPU each) "
                                                                           "to split the model over")),
    ("--max-loras", "max_loras", dict(type=int, help="LoRA adapters resident at once (default 1; serve: the "
                                                     "number of --lora-modules)")),
    ("--max-lora-rank", "max_lora_rank", dict(type=int, help="the largest LoRA rank the slots hold (default 16)")),
    ("--max-cpu-loras", "max_cpu_loras", dict(type=int, help="LoRA adapters kept read on the host (default "
                                                             "--max-loras)")),
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and every LLM(...) option as flags."""
    p.add_argument("--model", help="checkpoint: GGUF file, HF directory or synthetic:SHAPE:FORMAT "
                                   "(default: the embedded SmolLM2-135M Q4_1)")
    for flag, dest, kwargs in ENGINE_OPTIONS:
        p.add_argument(flag, dest=dest, default=None, **kwargs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument("--disable-custom-all-reduce", action="store_true", default=None,
                   help="tensor parallelism: NCCL for every all-reduce, not the one-shot kernel for small ones")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters over the base (implied by serve's --lora-modules)")
    p.add_argument("--allow-pickle", action="store_true", default=None,
                   help="load an HF checkpoint's pickle weights (.bin/.pt) with torch.load(weights_only=True); "
                        "without it they are refused, since unpickling a file can run code")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM(...) keywords the user gave (the rest keep the engine's defaults)."""
    names = [dest for _, dest, _ in ENGINE_OPTIONS] + ["enforce_eager", "enable_prefix_caching", "allow_pickle",
                                                    "disable_custom_all_reduce", "enable_lora"]
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    kwargs["seed"] = args.seed
    if getattr(args, "quiet", False):
        kwargs["quiet"] = True
    return kwargs


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stats", action="store_true",
                   help="print prompt size, time to first token and tokens/s to stderr")


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the flags; raises ConfigError naming the bad value."""
    from quanta.engine.sampling_params import SamplingParams
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    except ConfigError as e:
        message = str(e).removeprefix("SamplingParams: ")
        for field in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                      "presence_penalty", "frequency_penalty", "stop"):
            message = re.sub(rf"\b{field}\b", "--" + field.replace("_", "-"), message)
        raise ConfigError(message) from None
