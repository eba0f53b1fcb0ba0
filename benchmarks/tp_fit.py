"""A tensor-parallel model on capped GPUs: the tensor-parallel issue's figures for one layout.

    python benchmarks/tp_fit.py --model synthetic:llama3-70b:w4g128 --tp 4 --max-gpu-memory 22GiB
    python benchmarks/tp_fit.py --model synthetic:llama3-70b:w4g128act --tp 4 --max-gpu-memory 22GiB

One engine (FP8 KV cache, each rank capped at --max-gpu-memory, as a 24 GB card leaves after its driver) runs:
  decode       batch-1 greedy tokens/s against the roofline of the GPUs together: one rank's weight bytes
               per token over one GPU's measured copy bandwidth;
  throughput   --num-prompts requests of --input-len in / --output-len out, output tokens/s;
  long         --long-seqs prompts filling max_model_len less 128 tokens, served together, no OOM;
  profile      where a decode token's time goes on rank 0's GPU (decode_profile.py), after the others and
               after the memory sampling, so that the profiler neither slows them nor counts in the peak.
Memory: each GPU's use as the driver reports it (nvidia-smi, every rank's process, context included), sampled
through the whole run; its peak against the plan's per-GPU budget (`quanta plan` for the same configuration,
the engine's own start-up plan). JSON on the last line.
"""
from __future__ import annotations

import argparse
import subprocess
import threading
import time

import torch
from bench_io import emit
from decode_profile import decode_profile
from latency import copy_bandwidth
from memory_fit import batch1_decode, long_contexts, ratio

from quanta.engine import LLM, SamplingParams
from quanta.planner.memory_plan import format_verdict


class GpuMemorySampler:
    """Per-GPU peak of the driver's used memory (MiB), from `nvidia-smi -lms` running beside the benchmark."""

    def __init__(self, period_ms: int = 100):
        self.peak: dict[int, int] = {}
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                      f"--loop-ms={period_ms}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            index, used = (int(x) for x in line.split(","))
            self.peak[index] = max(self.peak.get(index, 0), used)

    def stop(self) -> dict[int, int]:
        time.sleep(0.5)
        self.proc.terminate()
        self.proc.wait()
        return dict(sorted(self.peak.items()))


def throughput(llm, n: int, input_len: int, output_len: int) -> dict:
    """Output tokens/s of n random prompts, all submitted at once (the offline benchmark's shape)."""
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 100000, (input_len,), generator=g).tolist()} for _ in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)                       # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == n * output_len
    return {"num_prompts": n, "input_len": input_len, "output_len": output_len, "elapsed_s": round(elapsed, 2),
            "output_tokens_per_s": round(produced / elapsed, 1), "preemptions": llm.scheduler.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="synthetic:llama3-70b:w4g128")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--max-gpu-memory", default="22GiB")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-seqs", type=int, default=16)
    ap.add_argument("--stages", default="decode,throughput,long,profile")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stages = args.stages.split(",")
    bandwidth = copy_bandwidth(torch.device("cuda"))      # before the engine: its buffers must not stay reserved
    torch.cuda.empty_cache()
    sampler = GpuMemorySampler()
    start = time.perf_counter()
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, kv_cache_dtype=args.kv_cache_dtype,
              max_gpu_memory=args.max_gpu_memory, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=False, dtype=args.dtype,
              disable_custom_all_reduce=args.disable_custom_all_reduce, quiet=True)
    plan, core = llm.core.plan, llm.core
    result = {"benchmark": "tp_fit", "model": args.model, "tp": args.tp, "max_gpu_memory": args.max_gpu_memory,
              "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len, "dtype": str(llm.core.dtype),
              "one_shot_all_reduce": llm.core.tp is not None and llm.core.tp.one_shot is not None,
              "device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
              "date": time.strftime("%Y-%m-%d"), "startup_s": round(time.perf_counter() - start, 1),
              "plan": format_verdict(plan), "plan_budget_bytes": plan.budget,
              "plan_weights_bytes": plan.weights.total, "weights_bytes_rank0": core.weight_bytes,
              "plan_load_peak_bytes": plan.load_peak, "load_peak_bytes_rank0": core.load_peak,
              "kv_capacity_tokens": core.num_kv_blocks * core.config.block_size,
              "plan_kv_capacity_tokens": plan.kv_capacity_tokens, "plan_activation_peak_bytes": plan.activation_peak}
    mem = llm.memory()
    result["engine_memory_rank0"] = {k: mem[k] for k in ("load_peak", "activation_peak", "cuda_graphs", "kv_cache")}
    result["engine_memory_rank0"]["weights"] = mem["weights"]["total"]
    free, total = torch.cuda.mem_get_info(llm.device)
    result["outside_torch_rank0_bytes"] = total - free - torch.cuda.memory_reserved(llm.device)
    print(f"started in {result['startup_s']} s; KV {result['kv_capacity_tokens']:,} tokens "
          f"(plan {plan.kv_capacity_tokens:,}); rank 0 {result['engine_memory_rank0']}, outside torch "
          f"{result['outside_torch_rank0_bytes']:,}", flush=True)
    if "decode" in stages:
        result["decode"] = batch1_decode(llm, torch, SamplingParams, bandwidth)
        print("decode", result["decode"], flush=True)
    if "throughput" in stages:
        result["throughput"] = throughput(llm, args.num_prompts, args.input_len, args.output_len)
        print("throughput", result["throughput"], flush=True)
    if "long" in stages:
        result["long"] = long_contexts(llm, torch, SamplingParams, seqs=args.long_seqs)
        print("long", result["long"], flush=True)
    peaks = sampler.stop()              # before the profile: the profiler's own buffers are not the engine's
    if "profile" in stages:
        result["profile"] = decode_profile(llm)
        print("profile", result["profile"], flush=True)
    llm.close()
    used = [peaks[i] * 2**20 for i in range(args.tp) if i in peaks]
    result["peak_used_per_gpu_bytes"] = used
    result["peak_used_vs_plan_budget"] = [ratio(u, plan.budget) for u in used]
    emit(result, args.out)


if __name__ == "__main__":
    main()
