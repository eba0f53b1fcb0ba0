"""Versions of the GEMV module (affine_gemv.py: the working tree's, and saved ones given by path, named by their file
names) at M = 1 on the Llama shapes, W4A16 g128 (or --bits, --group), each timed --reps times interleaved, with the
share of the copy bandwidth on the bytes moved (issue 4, the M = 1 lines).

    python benchmarks/probes/gemv_variants.py --before path[,path] --out results/gemv-variants.json [--reps 3] \
        [--unchecked name,...]   (diagnostic versions whose sums are wrong on purpose: timed, not checked)
        [--bits 8 --group -1]    (W8A16 per-channel) [--layers "8b qkv,8b o"]
"""
from __future__ import annotations

import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (checked_bench, load_versions, m1_cases, parse_layers, start_run,  # noqa: E402
                     variants_parser, write_run)

from quanta.kernels import affine_gemv  # noqa: E402

LAYERS = (("8b", "down"), ("8b", "gate_up"), ("70b", "o"), ("70b", "qkv"), ("8b", "qkv"))


def main() -> None:
    ap = variants_parser(__doc__, reps=2)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128, help="-1: one scale per output channel")
    ap.add_argument("--layers", default=",".join(" ".join(x) for x in LAYERS))
    args = ap.parse_args()
    t0, meta = start_run(before=args.before, bits=args.bits, group=args.group)
    versions = load_versions(affine_gemv, args.before)
    unchecked = set(args.unchecked.split(","))
    results = []
    for model, layer, n, k, w, sts, xs, ref in m1_cases(parse_layers(args.layers), args.bits, args.group):
        rec = {"model": model, "layer": layer, "n": n, "k": k, "bytes": w.nbytes}
        for _ in range(args.reps):
            for name, mod in versions.items():
                rec.setdefault(name, []).append(checked_bench(mod.gemv, xs, sts, w.nbytes, ref, name,
                                                              name not in unchecked))
                if name in unchecked:       # a diagnostic leaves the shared split-K workspace dirty
                    for buf in affine_gemv.workspace(xs[0].device, n, 1):
                        buf.zero_()
        moved = w.nbytes + 2 * (n + k)                  # the weight as stored, x and y
        rec["pct_copy"] = {name: [round(100 * moved / us / 1e3 / meta["copy_GBps"], 1) for us in rec[name]]
                           for name in versions}
        results.append(rec)
        print(f"{model} {layer:8s} " + " | ".join(f"{name} {'/'.join(map(str, rec[name]))}" for name in versions),
              flush=True)
    write_run(args.out, meta, t0, results=results)

if __name__ == "__main__":
    main()
