"""`quanta.bench`: which format should I run? Every asked format of each model measured on one engine by the
same measurements, the peers at their best beside them, written as JSON, a Markdown table and charts.

    result = quanta.bench(["llama-3-8b"], formats="awq,gguf:Q4_K_M,fp16", peers="transformers", out="bench/")
    print(result.table)
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quanta.loaders.detection import detect
from quanta.quant.errors import ConfigError
from quanta.toolkit.bench import peers as peer_runs
from quanta.toolkit.bench.measure import Row, Settings, copy_bandwidth, measure
from quanta.toolkit.bench.report import charts, markdown, write_json
from quanta.toolkit.bench.variants import is_shape, parse_formats, variants


@dataclass
class BenchResult:
    """The rows (quanta's, then the peers'), the run's facts, the Markdown table and the files written."""
    rows: list[Row]
    meta: dict[str, Any]
    table: str
    files: list[Path] = field(default_factory=list)


def bench(models: list[str], formats: str | list[str] | None = None, peers: str | list[str] | None = None,
          settings: Settings | None = None, reference: str | None = None, out: str | Path | None = None,
          quiet: bool = False, command: str | None = None) -> BenchResult:
    """Measure `models` (known shape names, measured with synthetic weights in each format, or checkpoints,
    measured as they are and converted into each format) in `formats` (bench names: fp16, bf16, awq, gptq,
    gptq-act-order, w8, nf4, fp8, gguf:TYPE; default all of them) with `peers` (transformers,
    transformers-bnb, llama.cpp), and with `reference` (a checkpoint) the quality of each real model's variants
    against it. Writes bench.json, bench.md and the charts into `out` when given. Every ConfigError is raised
    before any model is loaded; a model that fails to load or run is a row with its error."""
    s = settings or Settings()
    names = parse_formats(formats)
    wanted = peer_runs.parse_peers(peers)
    for m in models:
        if not is_shape(m) and not Path(m).exists():
            raise ConfigError(f"bench: {m!r} is neither a checkpoint on disk nor a known shape")
    if reference is not None and not Path(reference).exists():
        raise ConfigError(f"bench: reference {reference} does not exist")
    out = Path(out) if out is not None else None
    if out is not None:
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("bench: the charts need matplotlib (pip install 'quanta[bench]'); or leave out --out")
        out.mkdir(parents=True, exist_ok=True)
    device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    meta = {"command": command or "quanta.bench", "device": _device_name(device), "date": time.strftime("%Y-%m-%d"),
            "torch": torch.__version__, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1) if bandwidth else None,
            "settings": {k: getattr(s, k) for k in s.__dataclass_fields__}}
    rows = _Rows(out / "bench.json" if out is not None else None, meta)
    from tqdm import tqdm
    bar = tqdm(total=len(models) * (len(names) + 1 + len(wanted)), desc="bench", disable=quiet)
    for model in models:
        ref = None if is_shape(model) else reference
        with variants(model, names, quiet=True) as each:
            for v in each:
                bar.set_description(f"bench {v.format}")
                if v.error is not None:
                    rows.append(Row(model, v.format, error=v.error))
                    bar.update()
                    continue
                rows.append(measure(model, v.format, v.path, s, bandwidth, ref))
                if "llama.cpp" in wanted and not v.path.startswith("synthetic:") and detect(v.path) == "gguf":
                    rows.append(_peer("llama.cpp", model, v.format,
                                      lambda: peer_runs.run_llama_cpp(model, v.format, v.path, s)))
                bar.update()
        if is_shape(model):
            bar.update()                                      # no "as is" row for a shape
        for peer in (p for p in wanted if p != "llama.cpp"):
            bar.set_description(f"bench {peer}")
            rows.append(_peer(peer, model, "nf4 (bitsandbytes)" if peer == "transformers-bnb" else "",
                              lambda: _transformers(model, s, bnb=peer == "transformers-bnb")))
            bar.update()
    bar.close()
    rows = list(rows)
    table = markdown(rows, s.budgets, meta)
    result = BenchResult(rows, meta, table)
    if out is not None:
        write_json(out / "bench.json", rows, meta)
        (out / "bench.md").write_text(table)
        result.files = [out / "bench.json", out / "bench.md", *charts(rows, out)]
    return result


class _Rows(list):
    """The rows so far, rewritten to bench.json as each one lands: a run cut short keeps what it measured."""

    def __init__(self, path: Path | None, meta: dict[str, Any]):
        super().__init__()
        self.path, self.meta = path, meta

    def append(self, row: Row) -> None:
        super().append(row)
        if self.path is not None:
            write_json(self.path, self, self.meta)


def _peer(peer: str, model: str, fmt: str, run) -> Row:
    """A peer's row, or one saying why it did not run (not installed)."""
    why = peer_runs.missing(peer)
    return run() if why is None else Row(model, fmt, engine=peer.removesuffix("-bnb"), error=why)


def _transformers(model: str, s: Settings, bnb: bool) -> Row:
    """transformers (with bitsandbytes NF4 when `bnb`) on `model`: a published shape as random float16 weights,
    a checkpoint as float16 (converted by quanta into a scratch folder unless it is a plain HF directory)."""
    if is_shape(model) or detect(model) == "hf":
        row = peer_runs.run_transformers(model, model, s, bnb)
        row.model = model
        return row
    scratch = Path(tempfile.mkdtemp(prefix="quanta-bench-hf-"))
    try:
        from quanta.toolkit.convert.pipeline import convert
        convert(model, "hf", scratch / "hf", dtype="float16", validate=False, quiet=True)
        row = peer_runs.run_transformers(model, str(scratch / "hf"), s, bnb)
        row.model = model
        return row
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
