"""GGUF quantizing speed on the CPU: `quanta quantize --method gguf` against llama.cpp's `llama_model_quantize`
(llama-cpp-python's bundled libllama, two threads), both from the same float32 GGUF of the default model to the
same type, each run in a fresh process of its own, alternating, median of the runs.

    python benchmarks/quantize_speed.py [--types Q4_K_M,Q8_0] [--runs 3] [--out results/quantize-speed.json]

A run's time is the whole call in its process (reading, quantizing, writing), after the interpreter and the
libraries are imported. The outputs' tensors are compared byte for byte too, so a fast wrong quantizer cannot pass.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FTYPES = {"Q4_0": 2, "Q5_1": 9, "Q8_0": 7, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17,   # llama.h's
          "IQ4_NL": 25, "IQ4_XS": 30}                                                              # llama_ftype

CHILD = r"""
import sys, time
engine, src, dst, name, ftype = sys.argv[1:6]
if engine == "llama.cpp":
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = int(ftype), 2
    t0 = time.perf_counter()
    assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params) == 0
else:
    import quanta
    quantize = quanta.quantize          # imports torch and the toolkit, as `import llama_cpp` loads libllama
    t0 = time.perf_counter()
    quantize(src, dst, "gguf", type=name, quiet=True)
print(time.perf_counter() - t0)
"""


def timed(engine: str, src: Path, dst: Path, name: str) -> float:
    """Seconds of one quantizing call in a fresh process."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    run = subprocess.run([sys.executable, "-c", CHILD, engine, str(src), str(dst), name, str(FTYPES[name])],
                         capture_output=True, text=True, env=env)
    if run.returncode:
        raise SystemExit(f"{engine} {name} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return float(run.stdout.strip().splitlines()[-1])


def same_tensors(a: Path, b: Path) -> bool:
    from gguf import GGUFReader
    import numpy as np
    ta = {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in GGUFReader(a).tensors}
    tb = {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in GGUFReader(b).tensors}
    return ta == tb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K_M")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import quanta
    from quanta.cli.default_model import default_model_path
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f32.gguf"
        quanta.convert(default_model_path(), "gguf:F32", src, validate=False, quiet=True)
        for name in args.types.split(","):
            times = {"llama.cpp": [], "quanta": []}
            out = {engine: Path(tmp) / f"{engine}-{name}-0.gguf" for engine in times}
            for i in range(args.runs):
                for engine in times:
                    times[engine].append(timed(engine, src, Path(tmp) / f"{engine}-{name}-{i}.gguf", name))
            row = {"type": name, "llama_cpp_s": statistics.median(times["llama.cpp"]),
                   "quanta_s": statistics.median(times["quanta"]), "runs": times,
                   "byte_identical": same_tensors(out["llama.cpp"], out["quanta"])}
            row["ratio"] = row["quanta_s"] / row["llama_cpp_s"]
            rows.append(row)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "model": Path(default_model_path()).name, "source": "float32 GGUF", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("| type | llama.cpp s | quanta s | quanta / llama.cpp | bytes identical |")
    for r in rows:
        print(f"| {r['type']} | {r['llama_cpp_s']:.2f} | {r['quanta_s']:.2f} | {r['ratio']:.2f} "
              f"| {r['byte_identical']} |")


if __name__ == "__main__":
    main()
