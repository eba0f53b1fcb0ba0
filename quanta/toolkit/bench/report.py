"""`quanta bench`'s outputs: the rows as JSON, a Markdown table, and PNG charts (memory, batch-1 decode and
throughput per format with the peers, and memory against decode speed)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from quanta.toolkit.bench.measure import Row

GIB = 2**30
CHARTS = ("memory", "decode", "throughput", "memory_vs_decode")


def label(r: Row) -> str:
    """How a row is named in tables and charts: the format, and the engine where it is not quanta."""
    return r.format if r.engine == "quanta" else f"{r.engine} {r.format}"


def _num(value: Any, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def short(model: str) -> str:
    """A model as the table names it: a checkpoint's file or folder name, a shape as given."""
    return Path(model).name or model


def markdown(rows: list[Row], budgets: tuple[str, ...], meta: dict[str, Any]) -> str:
    """The table: weights held, KV capacity per budget (the plan), batch-1 decode and its share of the roofline,
    TTFT, throughput (and the peers' best batch), and the quality columns where a reference was given."""
    quality = any(r.perplexity is not None for r in rows)
    head = ["model", "format", "weights GiB", *[f"KV tokens @{b}" for b in budgets], "decode tok/s", "roofline",
            "TTFT ms", "throughput tok/s"] + (["perplexity", "KL", "top-1"] if quality else [])
    lines = [f"`{meta.get('command', 'quanta bench')}` on {meta.get('device', '?')}, {meta.get('date', '')}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"| {short(r.model)} | {label(r)} | " + " | ".join(["–"] * (len(head) - 3))
                         + f" | {r.error} |")
            continue
        through = _num(r.throughput_tok_s) + (f" (batch {r.best_batch})" if r.best_batch else "")
        cells = [short(r.model), label(r), _num(r.weights_bytes / GIB if r.weights_bytes else None, 2),
                 *[_num(r.kv_tokens.get(b), 0) for b in budgets], _num(r.decode_tok_s),
                 "–" if r.roofline_share is None else f"{r.roofline_share:.0%}", _num(r.ttft_ms), through]
        if quality:
            cells += [_num(r.perplexity, 3), _num(r.kl, 4),
                      "–" if r.top1 is None else f"{r.top1:.1%}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def write_json(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1) + "\n")


def colour(r: Row) -> str:
    return "#4c72b0" if r.engine == "quanta" else "#c44e52"


def legend(ax) -> None:
    """quanta's rows in blue, the peers' in red."""
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="#4c72b0", label="quanta"), Patch(color="#c44e52", label="peers")],
              fontsize=7, loc="lower right")


def charts(rows: list[Row], out: Path) -> list[Path]:
    """The four PNG charts in `out` (matplotlib, no display needed); each model's rows in one figure series."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.error is None]
    written = []

    def bars(name: str, value, unit: str, title: str) -> None:
        have = [r for r in ok if value(r) is not None]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(have) + 1.2), dpi=90)
        names = [f"{short(r.model)} · {label(r)}" if len({x.model for x in ok}) > 1 else label(r) for r in have]
        ax.barh(names, [value(r) for r in have], color=[colour(r) for r in have])
        for i, r in enumerate(have):
            ax.annotate(f" {value(r):,.3g}", (value(r), i), va="center", fontsize=7)
        ax.invert_yaxis()
        legend(ax)
        ax.set_xlabel(unit)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        written.append(out / f"{name}.png")

    bars("memory", lambda r: r.weights_bytes / GIB if r.weights_bytes else None, "GiB", "weights held")
    bars("decode", lambda r: r.decode_tok_s, "tokens/s", "batch-1 decode")
    bars("throughput", lambda r: r.throughput_tok_s, "output tokens/s", "offline throughput (best batch)")
    fig, ax = plt.subplots(figsize=(7, 5), dpi=90)
    for r in ok:
        if r.weights_bytes and r.decode_tok_s:
            ax.scatter(r.weights_bytes / GIB, r.decode_tok_s, color=colour(r))
            ax.annotate(label(r), (r.weights_bytes / GIB, r.decode_tok_s), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("weights held, GiB")
    ax.set_ylabel("batch-1 decode, tokens/s")
    ax.set_title("memory against decode speed")
    legend(ax)
    fig.tight_layout()
    fig.savefig(out / "memory_vs_decode.png")
    plt.close(fig)
    written.append(out / "memory_vs_decode.png")
    return written
