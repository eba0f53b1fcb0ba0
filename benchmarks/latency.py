"""Batch-1 decode latency: ms per output token and tokens/s of greedy generation, against the
bandwidth roofline (bytes read per token over the measured device copy bandwidth).

    python benchmarks/latency.py --model synthetic:llama3-8b:w4g128 --input-len 128 --output-len 256

Bytes per token = every tensor the linear layers' kernels hold (packed weights, scales, ...) plus
the norms; the embedding table is not counted (one row is read). JSON on the last line.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from bench_io import emit
from decode_profile import decode_profile, print_profile

from quanta.engine import LLM, SamplingParams
from quanta.engine.layers import QuantLinear, RMSNorm


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x) for x in obj.values())
    return sum(tensor_bytes(v) for v in vars(obj).values()) if hasattr(obj, "__dict__") else 0


def weight_bytes_per_token(model) -> int:
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += tensor_bytes(module.state) + tensor_bytes(module.bias)
        elif isinstance(module, RMSNorm):
            total += tensor_bytes(module.weight)
    return total


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-8b:w4g128")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="wait for every step's tokens before launching the next (the default on CUDA overlaps)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                    help="afterwards, profile a generation of TOKENS tokens: GPU time per kernel per token "
                         "(decode_profile.py)")
    ap.add_argument("--by-grid", action="store_true", help="with --profile, a row per kernel and launch grid")
    args = ap.parse_args()
    llm = LLM(model=args.model, kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
              async_scheduling=not args.no_async_scheduling,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=16, enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(args.input_len)]}
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)

    def timed(n: int) -> float:
        sync()
        start = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        sync()
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - start
    timed(8)                                                  # warm-up (JIT, graphs)
    prefill = statistics.median(timed(1) for _ in range(args.runs))
    totals = [timed(args.output_len) for _ in range(args.runs)]
    decode_s = (statistics.median(totals) - prefill) / (args.output_len - 1)
    result = {"benchmark": "latency", "model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
              "graphs": not args.enforce_eager, "async_scheduling": not args.no_async_scheduling, "input_len": args.input_len, "output_len": args.output_len,
              "prefill_ms": round(prefill * 1e3, 2), "decode_ms_per_token": round(decode_s * 1e3, 3),
              "decode_tokens_per_s": round(1 / decode_s, 1), "date": time.strftime("%Y-%m-%d"),
              "kernels": sorted({f"{k['scheme']} -> {k['kernel']}" for k in llm.kernels()})}
    if llm.device.type == "cuda":
        nbytes, bandwidth = weight_bytes_per_token(llm.model), copy_bandwidth(llm.device)
        roofline = bandwidth / nbytes
        result |= {"device": torch.cuda.get_device_name(), "weight_bytes_per_token": nbytes,
                   "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "roofline_tokens_per_s": round(roofline, 1),
                   "share_of_roofline": round(result["decode_tokens_per_s"] / roofline, 3)}
    if args.profile:
        print_profile(decode_profile(llm, args.profile, top=30 if args.by_grid else 24, by_grid=args.by_grid))
    emit(result, args.out)


if __name__ == "__main__":
    main()
