"""Offline throughput, in the manner of vLLM's benchmark_throughput: N requests of given (or sampled)
input / output lengths, ignore_eos, one LLM.generate call; requests/s and tokens/s as JSON.

    python benchmarks/throughput.py --model synthetic:llama3-8b:w4g128 --num-prompts 1000 \
        --input-len 512 --output-len 128 --kv-cache-dtype auto fp8 --hf-baseline --out result.json

Prompts are random token ids (no tokenizer needed). --kv-cache-dtype takes several values: the engine
is rebuilt for each and the KV capacity (tokens) is reported with the throughput. --hf-baseline first
measures transformers fp16 `generate` (same shapes, random weights for synthetic models) at batch sizes
up to --hf-max-batch on a subset of the requests, and reports our output tokens/s over its best. --profile N
then runs N other prompts under torch.profiler: GPU ms per kernel over the batch, to find where a format loses.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from pathlib import Path

import torch
from bench_io import emit


def make_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def length(mean: int) -> torch.Tensor:
        low, high = max(1, int(mean * (1 - range_ratio))), int(mean * (1 + range_ratio)) + 1
        return torch.randint(low, high, (n,), generator=g)
    ins, outs = length(input_len), length(output_len)
    prompts = [torch.randint(10, vocab - 10, (int(i),), generator=g).tolist() for i in ins]
    return prompts, outs.tolist()


def model_shape(model: str):
    from quanta.loaders.synthetic import SHAPES, is_synthetic, parse
    if is_synthetic(model):
        return SHAPES[parse(model)[0]]
    from quanta.loaders import load
    cfg = load(model).config
    return {f: getattr(cfg, f) for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}


@torch.inference_mode()
def hf_baseline(model: str, prompts, output_len: int, batch_sizes: list[int]) -> dict:
    """transformers fp16 generate tokens/s at each batch size (one batch each, after a warm-up)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from quanta.loaders.synthetic import is_synthetic
    if is_synthetic(model):
        shape = model_shape(model)
        config = LlamaConfig(**shape)
        torch.set_default_dtype(torch.float16)
        try:
            with torch.device("cuda"):
                hf = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)
        for p in hf.parameters():
            p.data.normal_(0, 0.02)
    else:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float16).cuda()
    hf.eval()
    input_len = len(prompts[0])
    results = {}
    for bs in [1] + batch_sizes:                           # bs 1 doubles as the warm-up
        ids = torch.tensor([p[:input_len] for p in prompts[:bs]], device="cuda")
        n = output_len if bs > 1 else 8
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        if bs > 1:
            results[bs] = round(bs * n / (time.perf_counter() - start), 1)
        print(f"transformers fp16 batch {bs}: {results.get(bs)} output tok/s", flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    best = max(results, key=results.get)
    return {"output_tokens_per_s_by_batch": results, "best_batch": best, "best_output_tokens_per_s": results[best]}


def triton_cache_entries() -> set[str]:
    """The kernels in Triton's on-disk cache, as 'entry/kernel' names: what appears during the timed run
    was compiled inside it (a JIT cost the engine's start-up should have paid)."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return {f"{d.name}/{f.stem}" for d in root.glob("*") if d.is_dir() for f in d.glob("*.json")
            if not f.name.startswith("__grp__")}


def run_engine(args, kv_dtype: str, prompts, output_lens) -> dict:
    from quanta.engine import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(model=args.model, kv_cache_dtype=kv_dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              enable_prefix_caching=not args.no_prefix_caching)
    init_s = time.perf_counter() - start
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0) for n in output_lens]
    # untimed, on other prompts of the same lengths: Triton compiles the batch shapes it meets, and the timed
    # prompts find nothing of theirs in the prefix cache
    warm = args.warmup_prompts
    others, other_lens = make_requests(warm, args.input_len, args.output_len, args.range_ratio, args.vocab,
                                       args.seed + 1)
    llm.generate([{"prompt_token_ids": p} for p in others],
                 [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0) for n in other_lens], use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    cached = triton_cache_entries()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    late = sorted(e.split("/")[1] for e in triton_cache_entries() - cached)
    profiled = profile_batch(llm, args) if args.profile else None
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert llm.pool.num_free == llm.pool.num_blocks, "KV blocks leaked"
    result = {"kv_cache_dtype": kv_dtype, "elapsed_s": round(elapsed, 2), "init_s": round(init_s, 1),
              "requests_per_s": round(len(prompts) / elapsed, 2),
              "total_tokens_per_s": round((n_in + n_out) / elapsed, 1),
              "output_tokens_per_s": round(n_out / elapsed, 1),
              "kv_blocks": llm.num_kv_blocks, "kv_capacity_tokens": llm.num_kv_blocks * llm.config.block_size,
              "preemptions": llm.scheduler.num_preemptions, "compiled_during_run": late,
              "kernels": sorted({f"{k['scheme']} -> {k['kernel']}" for k in llm.kernels()})}
    if profiled:
        result["profile"] = profiled
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def profile_batch(llm, args) -> dict:
    """Where an offline batch's GPU time goes: --profile other prompts of the run's lengths under torch.profiler,
    ms of each kernel over the batch (all and exclusive: decode_profile.py's rule), printed and returned."""
    from decode_profile import kernel_intervals, kernel_table
    from torch.profiler import ProfilerActivity, profile

    from quanta.engine import SamplingParams
    prompts, lens = make_requests(args.profile, args.input_len, args.output_len, args.range_ratio, args.vocab,
                                  args.seed + 2)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0) for n in lens]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    total, busy, rows = kernel_table(kernel_intervals(prof), 1, 25)
    rows = [[name, round(us / 1e3, 1), round(excl / 1e3, 1), int(calls)] for name, us, excl, calls in rows]
    print(f"profile of {args.profile} prompts: wall {wall * 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, kernels' "
          f"durations {total / 1e3:.1f} ms\n{'ms':>9} {'excl ms':>9} {'calls':>7}  kernel")
    for name, ms, excl, calls in rows:
        print(f"{ms:9.1f} {excl:9.1f} {calls:7d}  {name}")
    return {"prompts": args.profile, "wall_ms": round(wall * 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "top_ms_excl_ms_calls": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-8b:w4g128")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0, help="sample lengths in mean*(1 +- ratio)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--hf-batch-sizes", default="16,32,64")
    ap.add_argument("--warmup-prompts", type=int, default=8,
                    help="requests run untimed first, other prompts of the same lengths; as many as the timed run "
                         "meet its batch shapes before timing (the engine's start-up compiles their kernels too)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, metavar="PROMPTS",
                    help="afterwards, profile a batch of PROMPTS other prompts: GPU ms per kernel")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args()
    shape = model_shape(args.model)
    args.vocab = shape["vocab_size"]
    prompts, output_lens = make_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                         shape["vocab_size"], args.seed)
    result = {"benchmark": "throughput", "model": args.model, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "range_ratio": args.range_ratio,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
              "date": time.strftime("%Y-%m-%d"), "runs": []}
    if args.hf_baseline:
        if args.range_ratio:
            raise SystemExit("--hf-baseline needs fixed lengths (--range-ratio 0)")
        result["transformers_fp16"] = hf_baseline(args.model, prompts, args.output_len,
                                                  [int(b) for b in args.hf_batch_sizes.split(",")])
    for kv in args.kv_cache_dtype:
        run = run_engine(args, kv, prompts, output_lens)
        if "transformers_fp16" in result:
            run["speedup_vs_transformers"] = round(
                run["output_tokens_per_s"] / result["transformers_fp16"]["best_output_tokens_per_s"], 2)
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    if len(result["runs"]) > 1:
        base = result["runs"][0]
        for run in result["runs"][1:]:
            run["capacity_vs_first"] = round(run["kv_capacity_tokens"] / base["kv_capacity_tokens"], 2)
            run["throughput_vs_first"] = round(run["output_tokens_per_s"] / base["output_tokens_per_s"], 3)
    emit(result, args.out)


if __name__ == "__main__":
    main()
