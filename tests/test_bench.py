"""`quanta bench` on the CPU: the default model as it is and converted, measured by the one engine, quality against
the original, the table, JSON and charts written (a smoke test of the whole command, sized to run in a minute).
The figures themselves are measurements; what is asserted is what must hold whatever the machine."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from quanta.cli.main import main
from quanta.quant.errors import ConfigError
from quanta.toolkit.bench.measure import Row
from quanta.toolkit.bench.pipeline import bench
from quanta.toolkit.bench.report import markdown
from quanta.toolkit.bench.variants import parse_formats, recipe

SMALL = ["--decode-input", "16", "--decode-output", "8", "--ttft-input", "32", "--num-prompts", "2",
         "--throughput-input", "16", "--throughput-output", "4", "--runs", "1", "--windows", "1", "--ctx", "128"]


def test_bench_command_writes_the_table_json_and_charts(default_model_path, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["-q", "bench", str(default_model_path), "--formats", "gguf:Q8_0", "--reference",
                 str(default_model_path), "--out", str(out), "--device", "cpu", *SMALL]) == 0
    table = capsys.readouterr().out
    assert "| as is (gguf) |" in table and "| gguf:Q8_0 |" in table and "perplexity" in table
    data = json.loads((out / "bench.json").read_text())
    rows = {r["format"]: r for r in data["rows"]}
    assert set(rows) == {"as is (gguf)", "gguf:Q8_0"} and all(r["error"] is None for r in rows.values())
    as_is, q8 = rows["as is (gguf)"], rows["gguf:Q8_0"]
    assert as_is["kl"] == 0 and as_is["top1"] == 1          # the reference against itself
    assert q8["kl"] > 0 and q8["perplexity"] > 0 and q8["decode_tok_s"] > 0 and q8["throughput_tok_s"] > 0
    assert as_is["kv_tokens"]["24GiB"] > as_is["kv_tokens"]["16GiB"] > 0
    assert data["meta"]["settings"]["runs"] == 1 and (out / "bench.md").read_text() in table
    for chart in ("memory", "decode", "throughput", "memory_vs_decode"):
        png = out / f"{chart}.png"
        assert png.stat().st_size < 200_000 and Image.open(png).size[0] > 300


def test_formats_and_peers_are_checked_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="bench format 'int3'"):
        bench(["llama-3-8b"], formats="awq,int3")
    with pytest.raises(ConfigError, match="peer 'vllm'"):
        bench(["llama-3-8b"], formats="awq", peers="vllm")
    with pytest.raises(ConfigError, match="neither a checkpoint on disk nor a known shape"):
        bench([str(tmp_path / "nothing")], formats="awq")
    assert not list(tmp_path.iterdir())


def test_every_format_has_a_synthetic_model_and_a_recipe():
    names = parse_formats(None)
    assert "gguf:Q4_K_M" in names and "gptq-act-order" in names
    assert recipe("gguf:Q4_K_M", 128).synthetic == "gguf-q4_k_m" and recipe("gguf:q6_k", 128).synthetic == "gguf-q6_K"
    assert recipe("awq", 64).quantize == dict(method="rtn", bits=4, group_size=64, symmetric=False, format="awq")
    assert recipe("gptq-act-order", 128).synthetic == "w4g128act"


def test_a_failed_row_keeps_its_place_in_the_table():
    rows = [Row("m", "awq", weights_bytes=2**30, decode_tok_s=10.0, kv_tokens={"24GiB": 1000}),
            Row("m", "", engine="llama.cpp", error="llama_cpp is not installed")]
    table = markdown(rows, ("24GiB",), {"command": "quanta bench m", "device": "cpu"})
    assert "| m | awq | 1.00 | 1,000 | 10.0 |" in table and "| m | llama.cpp  |" in table
    assert "llama_cpp is not installed" in table


def test_a_format_that_cannot_hold_the_model_is_a_row_with_its_reason(default_model_path, monkeypatch):
    """The default model's rows of 576 are not whole 256-wide Q6_K blocks: quantize refuses, and that format's
    row says so while the others are measured."""
    from quanta.toolkit.bench import pipeline
    monkeypatch.setattr(pipeline, "measure", lambda model, fmt, *a, **k: Row(model, fmt, decode_tok_s=1.0))
    rows = bench([str(default_model_path)], formats="gguf:Q6_K", quiet=True).rows
    assert [r.format for r in rows] == ["as is (gguf)", "gguf:Q6_K"]
    assert rows[0].error is None and "Q6_K blocks do not tile" in rows[1].error


class _Clocked:
    """A stand-in for a transformers model whose `generate` takes `seconds[batch]` (timed runs only) or runs out of
    memory at the batches in `oom`."""

    def __init__(self, seconds: dict[int, float], oom: tuple[int, ...] = ()):
        self.seconds, self.oom, self.now = seconds, oom, 0.0

    def generate(self, ids, max_new_tokens, **kw):
        import torch
        if ids.shape[0] in self.oom:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        if max_new_tokens > 2:                  # the warm-up call takes no time
            self.now += self.seconds[ids.shape[0]]


@pytest.mark.parametrize("seconds, oom, best, end", [
    ({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.9}, (), 8, "the cap of batch 8"),
    ({1: 1.0, 2: 1.0, 4: 3.95}, (), 2, "batch 4 added under 3%"),
    ({1: 1.0, 2: 1.0}, (4,), 2, "out of memory at batch 4")])
def test_the_peer_sweep_doubles_until_memory_the_cap_or_no_gain(monkeypatch, seconds, oom, best, end):
    """Each batch's output tok/s is batch × tokens / its time; the sweep says why it stopped and keeps every
    batch it measured, so a bench JSON shows the peer was run at its best."""
    import torch

    from quanta.toolkit.bench import peers
    from quanta.toolkit.bench.measure import Settings
    model = _Clocked(seconds, oom)
    monkeypatch.setattr(peers.time, "perf_counter", lambda: model.now)
    s = Settings.small(throughput_input=8, throughput_output=4)
    results, why = peers.sweep(model, s, vocab=100, device=torch.device("cpu"), max_batch=8)
    assert why == end and max(results, key=results.get) == best
    assert results == {b: round(b * 4 / seconds[b], 1) for b in results} and set(results) <= set(seconds)
