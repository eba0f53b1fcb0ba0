"""`quanta quantize` on one GPU at a published shape: a synthetic fp16 checkpoint of the shape (random weights, the
real model's tensors) is written to disk as HF safetensors with a tokenizer beside it, then each method runs as
`quanta quantize SRC --method M --device cuda --calibration TEXT --json` in its own process, timed whole (loading,
calibration, the searches, writing the output).

    python benchmarks/quantize_gpu.py --tokenizer DIR --calibration TEXT --out results/quantize-gpu.json \
        [--shape llama3-8b] [--methods awq,gptq] [--work /tmp/quantize-gpu] [--timeout 420] [--device cuda]

DIR holds tokenizer.json and tokenizer_config.json of a tokenizer whose ids fit the shape's vocabulary (`quanta
convert` of the default model to hf writes them); TEXT a calibration text of at least 32 x 512 tokens.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def source(shape: str, work: Path, tokenizer: Path) -> tuple[Path, float]:
    """The synthetic fp16 checkpoint of `shape` on disk with the tokenizer's files, and the seconds writing it took
    (0 when it was there already)."""
    from quanta.loaders import load, write
    src = work / f"{shape}-fp16"
    start = time.perf_counter()
    if not (src / "config.json").is_file():
        write(src, load(f"synthetic:{shape}:fp16"), "hf")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer / name, src / name)
    return src, time.perf_counter() - start


def quantize(src: Path, method: str, work: Path, calibration: Path, timeout: int, device: str,
             options: list[str]) -> dict:
    """One `quanta quantize` run in its own process: wall seconds, the summary, the output's size."""
    out = work / f"out-{method}"
    cmd = [sys.executable, "-m", "quanta.cli.main", "-q", "quantize", str(src), "--method", method, "--out",
           str(out), "--device", device, "--json", "--overwrite", *options]
    if method in ("awq", "gptq"):
        cmd += ["--calibration", str(calibration)]
    start = time.perf_counter()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"method": method, "wall_s": time.perf_counter() - start, "timed_out": timeout}
    wall = time.perf_counter() - start
    if run.returncode:
        return {"method": method, "wall_s": wall, "error": run.stderr[-2000:]}
    summary = json.loads(run.stdout)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    return {"method": method, "wall_s": wall, "bytes": size, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, help="required without --src")
    ap.add_argument("--calibration", required=True, type=Path)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--methods", default="awq,gptq")
    ap.add_argument("--work", default="/tmp/quantize-gpu", type=Path)
    ap.add_argument("--timeout", type=int, default=420, help="seconds a method may take")
    ap.add_argument("--device", default="cuda", help="cpu for a dry run on a small --src")
    ap.add_argument("--options", default="", help="more `quanta quantize` flags, e.g. '--group-size 64'")
    ap.add_argument("--src", type=Path, help="an existing checkpoint with a tokenizer instead of the synthetic shape")
    args = ap.parse_args()
    import torch
    args.work.mkdir(parents=True, exist_ok=True)
    src, write_s = (args.src, 0.0) if args.src else source(args.shape, args.work, args.tokenizer)
    print(f"{args.shape} fp16 written in {write_s:.0f} s", flush=True)
    runs = []
    for method in args.methods.split(","):
        runs.append(quantize(src, method, args.work, args.calibration, args.timeout, args.device,
                             args.options.split()))
        print(json.dumps({k: v for k, v in runs[-1].items() if k != "summary"}), flush=True)
    result = {"device": torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu", "shape": args.shape, "source_write_s": write_s, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\nmethod   wall s   output GiB   summary's bits/weight")
    for r in runs:
        s = r.get("summary", {})
        print(f"{r['method']:8s} {r['wall_s']:7.0f}   {r.get('bytes', 0) / 2**30:10.2f}   "
              f"{s.get('linear_bits_per_weight', float('nan')):.3f}  {r.get('error', '')[:200]}"
              f"{' timed out' if 'timed_out' in r else ''}")


if __name__ == "__main__":
    main()
