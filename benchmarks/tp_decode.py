"""Tensor-parallel decode: batch-1 tokens/s and batched throughput at a TP size, with TP = 1 on the same
GPUs as the baseline (each in its own engine, one after the other).

    python benchmarks/tp_decode.py --model synthetic:llama3-8b:w4g128 --tp 2
    python benchmarks/tp_decode.py --model synthetic:llama3-8b:w4g128 --tp 2 --enforce-eager --no-baseline

Batch 1: greedy decode of --output-len tokens after a --input-len prompt, prefill time subtracted.
Throughput: --batch prompts of --input-len tokens, --output-len tokens each, output tokens over wall time.
Both also check that the TP engine's greedy tokens equal the baseline's (when it runs). JSON on the last line.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_io import emit

from quanta.engine import LLM, SamplingParams


def measure(args, tp: int) -> dict:
    llm = LLM(model=args.model, tensor_parallel_size=tp, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(16, args.batch),
              enable_prefix_caching=False, max_model_len=args.input_len + args.output_len + 16, quiet=True)
    prompt = [(7 * i) % 1000 + 10 for i in range(args.input_len)]

    def timed(prompts: list[list[int]], n: int) -> tuple[float, list]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]
    timed([prompt], 8)                                              # warm-up (JIT, graphs)
    prefill = statistics.median(timed([prompt], 1)[0] for _ in range(args.runs))
    totals = [timed([prompt], args.output_len) for _ in range(args.runs)]
    decode_s = (statistics.median(t for t, _ in totals) - prefill) / (args.output_len - 1)
    batch = [[(p + 13 * b) % 1000 + 10 for p in prompt] for b in range(args.batch)]
    wall, batch_tokens = timed(batch, args.output_len)
    result = {"tp": tp, "prefill_ms": round(prefill * 1e3, 2), "decode_ms_per_token": round(decode_s * 1e3, 3),
              "decode_tokens_per_s": round(1 / decode_s, 1),
              "throughput_tokens_per_s": round(args.batch * args.output_len / wall, 1),
              "weights_per_gpu_GiB": round(llm.memory()["weights"]["total"] / 2**30, 2),
              "kv_cache_blocks": llm.num_kv_blocks, "tokens": totals[0][1][:16], "batch_tokens": batch_tokens}
    llm.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-8b:w4g128")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="skip the TP = 1 run")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [] if args.no_baseline else [measure(args, 1)]
    runs.append(measure(args, args.tp))
    for r in runs:
        print(f"TP={r['tp']}: batch 1 {r['decode_tokens_per_s']} tok/s ({r['decode_ms_per_token']} ms/token), "
              f"batch {args.batch} {r['throughput_tokens_per_s']} tok/s, {r['weights_per_gpu_GiB']} GiB weights/GPU")
    same = None if args.no_baseline else (runs[0]["tokens"] == runs[1]["tokens"],
                                          runs[0]["batch_tokens"] == runs[1]["batch_tokens"])
    if same is not None:
        print(f"greedy tokens equal to TP=1: batch 1 {same[0]}, batch {args.batch} {same[1]}")
    for r in runs:
        r.pop("batch_tokens")
    result = {"benchmark": "tp_decode", "model": args.model, "graphs": not args.enforce_eager,
              "input_len": args.input_len, "output_len": args.output_len, "batch": args.batch,
              "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "runs": runs,
              "greedy_equal": same}
    emit(result, args.out)


if __name__ == "__main__":
    main()
