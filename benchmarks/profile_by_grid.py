"""Per (kernel, grid) exclusive GPU time per decode token of a model, from a chrome trace of a 32-token greedy
decode (decode_profile groups by kernel name only; this tells the shapes of one kernel apart).
   usage: python3 benchmarks/profile_by_grid.py MODEL TRACE.json
"""
import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, "benchmarks")
from decode_profile import _exclusive_us
from quanta.engine import LLM, SamplingParams
model, out = sys.argv[1], sys.argv[2]
llm = LLM(model=model, gpu_memory_utilization=0.5, max_num_seqs=16, enable_prefix_caching=False)
prompt = {"prompt_token_ids": [(7 * i) % 1000 + 10 for i in range(32)]}
tokens = 32
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
llm.generate(prompt, params, use_tqdm=False)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(prompt, params, use_tqdm=False)
    torch.cuda.synchronize()
prof.export_chrome_trace(out)
ev = [e for e in json.load(open(out))["traceEvents"] if e.get("cat") == "kernel"]
iv = [(e["ts"], e["ts"] + e["dur"], f'{e["name"][:40]} grid={e["args"].get("grid")} block={e["args"].get("block")}') for e in ev]
excl = _exclusive_us(iv)
cnt, dur = collections.Counter(), collections.defaultdict(float)
for s, e, k in iv:
    cnt[k] += 1; dur[k] += e - s
print("busy us/token", round(sum(excl.values()) / tokens, 1))
for k in sorted(excl, key=lambda k: -excl[k])[:30]:
    print(f"{excl[k]/tokens:8.1f} excl  {dur[k]/max(cnt[k],1):7.1f} us/call  {cnt[k]/tokens:6.2f} calls  {k}")
ks = collections.Counter(f"{k['scheme']} -> {k['kernel']} {k['shape']}" for k in llm.kernels())
for k, v in sorted(ks.items()): print(v, k)
