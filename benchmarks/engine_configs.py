"""Batch-1 decode tok/s with module attributes patched: what a launch config does inside the engine's chain of
kernels (programmatic dependent launch, the SwiGLU and rotary epilogues), which a kernel's sweep alone misses.
Each variant runs benchmarks/latency.py in a process of its own; the variants alternate, round after round.

    python benchmarks/engine_configs.py --model synthetic:llama3-8b:w8g128 --rounds 2 --variant "" \\
        --variant "quanta.kernels.affine.gemv:GEMV_CONFIGS_PDL_W8=band(GEMV_CONFIGS_PDL_W8, 100_000_000,
                   200_000_000, GemvConfig(512, 8, 8, 16.0, 1, tile_sums=True))"
    python benchmarks/engine_configs.py --model synthetic:llama3-8b:gguf-q4_K_M --variant "" \\
        --variant "quanta.kernels.ggml.gemv_cols:PACKED_HALF=ColsConfig(256, 2, 32.0, 1, 2)"

A variant is ';'-separated MODULE:NAME=EXPR assignments, EXPR evaluated in the module's namespace with band()
added; "" runs the build as it is. `--bench throughput` runs throughput.py instead (offline output tok/s over
--num-prompts). Flags this script does not know go to the bench script as they are (--max-num-seqs 1024). JSON on
the last line (--out: also to a file).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_io import emit

HERE = Path(__file__).resolve().parent
SCRIPTS = {"latency": HERE / "latency.py", "throughput": HERE / "throughput.py"}


def band(table: tuple, lo: int, hi: int, config) -> tuple:
    """A (top, config) table by weight count, with `config` for the weights above lo up to hi: the bands that
    straddle lo or hi are split, the others keep their configs."""
    edges = sorted({top for top, _ in table} | {lo, hi})
    return tuple((top, config if lo < top <= hi else next(c for t, c in table if top <= t)) for top in edges)


def _runner(variant: str, script: Path, script_args: list[str]) -> str:
    """The Python source of one run: the variant's assignments, then `script` with script_args."""
    lines = ["import importlib, runpy, sys", f"sys.path.insert(0, {str(HERE)!r})",
             "from engine_configs import band"]
    for assignment in filter(None, (a.strip() for a in variant.split(";"))):
        target, expr = assignment.split("=", 1)
        module, name = target.strip().split(":")
        lines += [f"m = importlib.import_module({module!r})",
                  f"assert hasattr(m, {name!r}), 'no {name} in {module}: the patch would change nothing'",
                  f"setattr(m, {name!r}, eval({expr!r}, {{**vars(m), 'band': band}}))"]
    lines += [f"sys.argv = {[str(script), *script_args]!r}", f"runpy.run_path({str(script)!r}, run_name='__main__')"]
    return "\n".join(lines)


def run_variant(variant: str, script_args: list[str], timeout: float, bench: str = "latency") -> dict:
    """The bench script's JSON (latency.py's or throughput.py's) for one run of the variant."""
    out = subprocess.run([sys.executable, "-c", _runner(variant, SCRIPTS[bench], script_args)], capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"variant {variant!r} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", action="append", required=True, help="MODULE:NAME=EXPR[; ...], or \"\"")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run")
    ap.add_argument("--bench", choices=tuple(SCRIPTS), default="latency",
                    help="batch-1 decode tok/s (latency.py) or offline output tok/s (throughput.py)")
    ap.add_argument("--num-prompts", type=int, default=1000, help="with --bench throughput")
    ap.add_argument("--out", default=None)
    args, passed = ap.parse_known_args()     # unknown flags (--max-num-seqs 1024, ...) go to the bench script
    script_args = ["--model", args.model, "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    script_args += (["--runs", str(args.runs)] if args.bench == "latency"
                    else ["--num-prompts", str(args.num_prompts), "--quiet"]) + passed
    tok_s: dict[str, list[float]] = {v: [] for v in args.variant}
    for _ in range(args.rounds):
        for variant in args.variant:
            result = run_variant(variant, script_args, args.timeout, args.bench)
            value = (result["decode_tokens_per_s"] if args.bench == "latency"
                     else result["runs"][0]["output_tokens_per_s"])
            tok_s[variant].append(value)
            print(f"{value:>9.1f} tok/s  {variant or '(as built)'}", flush=True)
    emit({"benchmark": "engine_configs", "bench": args.bench, "model": args.model,
          "device": result.get("device", "cpu"), "date": result["date"], "script_args": script_args,
          "weight_bytes_per_token": result.get("weight_bytes_per_token"), "tokens_per_s": tok_s}, args.out)


if __name__ == "__main__":
    main()
