"""Resident memory of a model on the CPU against its file bytes: the default model as it is and converted to
NF4, FP8 and GGUF Q4_K_M (`quanta quantize`, in a scratch folder), each loaded in a fresh process.

    python benchmarks/cpu_memory.py [--model PATH] [--formats nf4,fp8,gguf:Q4_K_M] --out r.json

A process imports torch, quanta and the tokenizer libraries and reads its resident memory (/proc/self/status:
anonymous and file-backed pages); it then loads the model with a KV cache of 64 blocks, generates 16 tokens and
reads it again (after giving the C heap's free memory back). The model's share is the growth of anonymous memory less the KV cache's bytes, set against the
bytes of the checkpoint's weight files (.safetensors / .gguf); the growth of file-backed pages (the mapped
checkpoint, which the kernel may drop and read again) is reported beside it. The kernel of each layer kind and
the engine's own count of the weights' bytes come with it.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import emit  # noqa: E402


def file_bytes(path: str) -> int:
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.iterdir() if f.suffix in (".safetensors", ".gguf")]
    return sum(f.stat().st_size for f in files)


def resident() -> dict[str, int]:
    """This process' anonymous and file-backed resident bytes."""
    fields = dict(re.findall(r"(Rss\w+):\s+(\d+) kB", Path("/proc/self/status").read_text()))
    return {"anon": int(fields["RssAnon"]) << 10, "file": int(fields["RssFile"]) << 10}


def measure(path: str) -> dict:
    """In this process: resident memory before and after loading `path` and generating, and the engine's
    accounts."""
    import collections

    import tokenizers  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from quanta.engine import LLM, SamplingParams, host_heap
    torch.ones(4) @ torch.ones(4)
    before = resident()
    llm = LLM(path, device="cpu", num_kv_blocks=64, max_model_len=512, quiet=True)
    llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    host_heap.trim()                    # what is held, not what the C heap keeps free for reuse
    after = resident()
    mem = llm.memory()
    kernels = collections.Counter(f"{k['scheme']} -> {k['kernel']}" for k in llm.kernels())
    return {"anon_growth": after["anon"] - before["anon"], "file_growth": after["file"] - before["file"],
            "kv_cache": mem["kv_cache"], "weights_counted": mem["weights"]["total"], "kernels": dict(kernels)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default="nf4,fp8,gguf:Q4_K_M")
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    from quanta.cli.default_model import default_model_path
    from quanta.toolkit.bench.variants import parse_formats, variants
    model = args.model or str(default_model_path())
    rows = []
    with variants(model, parse_formats(args.formats), quiet=True) as each:
        for v in each:
            if v.error:
                rows.append({"format": v.format, "error": v.error})
                continue
            done = subprocess.run([sys.executable, __file__, "--measure", v.path], capture_output=True, text=True)
            if done.returncode:
                rows.append({"format": v.format, "error": done.stderr[-2000:]})
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            held = r["anon_growth"] - r["kv_cache"]
            rows.append({"format": v.format, "file_bytes": file_bytes(v.path), "model_rss_bytes": held,
                         "ratio": round(held / file_bytes(v.path), 3), **r})
    result = {"model": Path(model).name, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    emit(result, args.out)
    print(f"{'format':<24} {'file MB':>8} {'held MB':>8} {'ratio':>6} {'mapped MB':>9}  kernels")
    for r in rows:
        if "error" in r:
            print(f"{r['format']:<24} error: {r['error'][:100]}")
            continue
        print(f"{r['format']:<24} {r['file_bytes'] / 1e6:>8.1f} {r['model_rss_bytes'] / 1e6:>8.1f} {r['ratio']:>6.2f} "
              f"{r['file_growth'] / 1e6:>9.1f}  "
              f"{', '.join(f'{k} x{n}' for k, n in r['kernels'].items())}")


if __name__ == "__main__":
    main()
