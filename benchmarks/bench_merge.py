"""Merge `quanta bench` runs made in several GPU calls (each call is time-limited) into one table and one set of
charts: the rows of every bench.json in order, quanta's first and the peers after, and the runs' facts.

    python benchmarks/bench_merge.py out/bench-a/bench.json out/bench-b/bench.json --out out/bench
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from quanta.toolkit.bench.measure import Row
from quanta.toolkit.bench.report import charts, markdown, write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="bench.json files")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    metas, rows = [], []
    for f in args.runs:
        data = json.loads(Path(f).read_text())
        metas.append(data["meta"])
        rows += [Row(**r) for r in data["rows"]]
    rows.sort(key=lambda r: r.engine != "quanta")               # stable: each engine's rows keep their order
    meta = dict(metas[0])
    meta["command"] = " ; ".join(m["command"] for m in metas)
    meta["copy_bandwidth_GBps"] = [m["copy_bandwidth_GBps"] for m in metas]
    budgets = tuple(metas[0]["settings"]["budgets"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", rows, meta)
    table = markdown(rows, budgets, meta)
    (out / "bench.md").write_text(table)
    charts(rows, out)
    print(table)


if __name__ == "__main__":
    main()
