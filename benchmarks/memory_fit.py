"""Memory against the plan, on a GPU: what the engine holds while loading and after start-up beside what
`quanta plan` (the engine's own start-up plan, `LLM.core.plan`) predicted, then decode speed.

    python benchmarks/memory_fit.py 70b      # Llama-3-70B shape, W4 g128, FP8 KV cache, one 80 GB GPU
    python benchmarks/memory_fit.py t4       # Llama-3-8B shape, W4 g128, sm75 caps, capped at 15 GiB,
                                             # four concurrent 8k-token contexts
    python benchmarks/memory_fit.py 70b --weights gguf-q4_K_M --max-gpu-memory 79GiB   # other weights, a cap

Measured: the load's peak (torch's max allocated while building, over the weights' start), the weights,
the device memory in use after start-up (the driver's total - free, so the runtime's own share is in it)
against the plan's load peak, weights and budget; KV capacity (engine's blocks vs plan's). Then decode:
batch-1 tokens/s against the bandwidth roofline (70b), or the tokens/s of the four long contexts (t4).
JSON on the last line.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

CASES = {
    "70b": dict(model="synthetic:llama3-70b:w4g128", kv_cache_dtype="fp8", max_model_len=8192, max_num_seqs=16),
    "t4": dict(model="synthetic:llama3-8b:w4g128", kv_cache_dtype="fp8", max_model_len=8192, max_num_seqs=4,
               max_gpu_memory="15GiB", caps="sm75"),
}


def ratio(measured: int, planned: int) -> float:
    return round(measured / planned, 4)


def memory_against_plan(llm, torch) -> dict:
    core, p = llm.core, llm.core.plan
    free, total = torch.cuda.mem_get_info(llm.device)
    used = total - free
    mem = llm.memory()
    return {
        "plan_verdict_fits": p.fits,
        "load_peak_bytes": core.load_peak, "plan_load_peak_bytes": p.load_peak,
        "load_peak_vs_plan": ratio(core.load_peak, p.load_peak),
        "weights_bytes": core.weight_bytes, "plan_weights_bytes": p.weights.total,
        "weights_vs_plan": ratio(core.weight_bytes, p.weights.total),
        "activation_peak_bytes": mem["activation_peak"], "plan_activation_peak_bytes": p.activation_peak,
        "cuda_graphs_bytes": mem["cuda_graphs"], "kv_cache_bytes": mem["kv_cache"],
        "kv_capacity_tokens": core.num_kv_blocks * core.config.block_size,
        "plan_kv_capacity_tokens": p.kv_capacity_tokens,
        "kv_capacity_vs_plan": ratio(core.num_kv_blocks * core.config.block_size, p.kv_capacity_tokens),
        "device_used_after_startup_bytes": used, "plan_budget_bytes": p.budget,
        "used_vs_plan_budget": ratio(used, p.budget),
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def batch1_decode(llm, torch, SamplingParams, bandwidth: float, out_len: int = 128) -> dict:
    """Batch-1 greedy decode tokens/s against the roofline at `bandwidth` (copy_bandwidth measured before
    the engine started: its two 1 GiB buffers would stay in the engine's reserved memory and in its peak)."""
    from latency import weight_bytes_per_token
    prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(32)]}

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - start
    timed(8)
    prefill = statistics.median(timed(1) for _ in range(3))
    decode_s = (statistics.median(timed(out_len) for _ in range(3)) - prefill) / (out_len - 1)
    nbytes = weight_bytes_per_token(llm.model)
    roofline = bandwidth / nbytes
    return {"decode_tokens_per_s": round(1 / decode_s, 1), "weight_bytes_per_token": nbytes,
            "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "roofline_tokens_per_s": round(roofline, 1),
            "share_of_roofline": round(1 / decode_s / roofline, 3)}


def long_contexts(llm, torch, SamplingParams, seqs: int = 4, out_len: int = 128) -> dict:
    """`seqs` prompts that fill max_model_len less out_len, run together: time to the last first token, then
    the decode tokens/s of all of them together, and the peak allocated while they ran."""
    prompt_len = llm.core.max_model_len - out_len
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats(llm.device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for s in range(seqs):
        llm.add_request({"prompt_token_ids": [(31 * i + s) % 30000 + 10 for i in range(prompt_len)]}, params)
    produced, all_first, decoded_after = {}, None, 0
    while llm.has_unfinished():
        for out in llm.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if all_first is None and len(produced) == seqs and min(produced.values()) >= 1:
            torch.cuda.synchronize()
            all_first, decoded_after = time.perf_counter(), sum(produced.values())
    torch.cuda.synchronize()
    end = time.perf_counter()
    assert sorted(produced.values()) == [out_len] * seqs, produced
    return {"concurrent_contexts": seqs, "prompt_tokens_each": prompt_len, "output_tokens_each": out_len,
            "prefill_s": round(all_first - start, 2),
            "decode_tokens_per_s": round((seqs * out_len - decoded_after) / (end - all_first), 1),
            "peak_allocated_while_serving_bytes": torch.cuda.max_memory_allocated(llm.device)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--weights", help="the synthetic weights' format instead of w4g128 (e.g. gguf-q4_K_M)")
    ap.add_argument("--max-gpu-memory",
                    help="cap the engine's device memory (e.g. 79GiB: an 80 GB card's on a larger GPU)")
    args = ap.parse_args()
    case = dict(CASES[args.case])
    if args.weights:
        case["model"] = case["model"].rsplit(":", 1)[0] + ":" + args.weights
    if args.max_gpu_memory:
        case["max_gpu_memory"] = args.max_gpu_memory
    caps = case.pop("caps", None)
    if caps:
        os.environ["QUANTA_DEVICE_CAPS"] = caps
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    from bench_io import emit
    from quanta.engine import LLM, SamplingParams
    from quanta.planner.memory_plan import format_verdict
    from latency import copy_bandwidth
    bandwidth = copy_bandwidth(torch.device("cuda"))
    torch.cuda.empty_cache()
    llm = LLM(enable_prefix_caching=False, quiet=True, **case)
    result = {"benchmark": "memory_fit", "case": args.case, **case, "caps": caps or "device",
              "device": torch.cuda.get_device_name(), "dtype": str(llm.dtype).removeprefix("torch."),
              "date": time.strftime("%Y-%m-%d"), "plan": format_verdict(llm.core.plan)}
    result |= memory_against_plan(llm, torch)
    if args.case == "70b":
        result |= batch1_decode(llm, torch, SamplingParams, bandwidth)
    else:
        result |= long_contexts(llm, torch, SamplingParams)
        cap = llm.core.config.max_gpu_memory
        result |= {"cap_bytes": cap, "peak_allocated_under_cap": result["peak_allocated_while_serving_bytes"] <= cap}
    # At the end: the allocator's peak reservation since start-up's reset plus what the process holds outside
    # it (CUDA context, cuBLAS workspaces, Triton modules): the most of the card the run used.
    free, total = torch.cuda.mem_get_info(llm.device)
    outside = total - free - torch.cuda.memory_reserved(llm.device)
    result["peak_device_use_bytes"] = torch.cuda.max_memory_reserved(llm.device) + outside
    result["peak_use_vs_plan_budget"] = ratio(result["peak_device_use_bytes"], llm.core.plan.budget)
    emit(result, args.out)


if __name__ == "__main__":
    main()
