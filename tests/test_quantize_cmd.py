"""`quanta quantize` / quanta.quantize end to end on a tiny llama (hidden 64, 2 layers).

Oracles: the float weights of transformers' own model (the source), hand-derived error bounds of each
scheme (RTN: at most half a quantization step per weight), the `gguf` package's dequantizer for GGUF
outputs, transformers' logits for the engine run on the output, and bits per weight computed by hand
from the formats' layouts. The error cases prove no work started by making the quantizers and the
writers raise if reached; the interrupt test sends a real SIGTERM / SIGINT to a real process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_tiny_hf  # noqa: E402

import quanta  # noqa: E402
from quanta.loaders import load  # noqa: E402
from quanta.quant import QTensor  # noqa: E402
from quanta.quant.calibration import DEFAULT_TEXT  # noqa: E402
from quanta.quant.errors import ConfigError, UnsupportedError  # noqa: E402
from quanta.cli.main import main  # noqa: E402

pytestmark = pytest.mark.skipif(not DEFAULT_TEXT.is_file(), reason="calibration text missing")
CALIB = dict(n_samples=4, seqlen=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, model = build_tiny_hf("llama", tmp_path_factory.mktemp("tiny") / "m")
    tokens = torch.tensor([[1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]])
    with torch.no_grad():
        logits = model(tokens).logits[0]
    weights = {n: p.detach().float().clone() for n, p in model.state_dict().items()}
    return path, weights, tokens, logits


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread (on a loaded 2-core machine a second one only waits)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _linears(ckpt):
    return {n: t for n, t in ckpt.tensors.items() if n.startswith("model.layers.") and n.endswith("_proj.weight")}


# method, options, expected loaded kind, bound on ||W - Ŵ|| / ||W|| per linear, bound on the logits' relative
# error. Weight bounds: int4 g32 of Gaussian weights ~0.09, int8 per channel ~0.006, FP8 e4m3 ~0.02,
# Q8_0 ~0.005 (a step of absmax/127 over 32 weights). The logits of a random tiny model are sensitive:
# their bound is a sanity check that the engine runs the right weights (a wrong layout gives ~1.0).
CASES = {
    "rtn-awq": ("rtn", dict(group_size=32), "affine", 0.12, 0.3),
    "rtn-gptq-sym": ("rtn", dict(group_size=32, symmetric=True), "affine", 0.15, 0.3),
    "rtn-ct-8bit": ("rtn", dict(bits=8, group_size=-1, format="compressed-tensors"), "affine", 0.01, 0.03),
    "awq": ("awq", dict(group_size=32, **CALIB), "affine", None, 0.3),     # weights re-scaled: logits only
    "gptq-act-order": ("gptq", dict(group_size=32, act_order=True, **CALIB), "affine", 0.2, 0.3),
    "fp8": ("fp8", {}, "fp8", 0.04, 0.08),
    "nf4": ("nf4", {}, "codebook", 0.12, 0.3),
    "gguf-q8_0": ("gguf", dict(type="Q8_0"), "gguf", 0.008, 0.03),
    "gguf-q4_k_m-imatrix": ("gguf", dict(type="Q4_K_M", imatrix=True, **CALIB), "gguf", 0.1, 0.3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_output_loads_dequantizes_close_and_runs(case, tiny, tmp_path):
    from quanta.engine.llm import LLM

    path, weights, tokens, ref_logits = tiny
    method, options, kind, werr, lerr = CASES[case]
    out = tmp_path / ("out.gguf" if method == "gguf" else "out")
    summary = quanta.quantize(path, out, method, quiet=True, **options)
    assert Path(summary.out) == out and out.exists()
    ckpt = load(out)
    linears = _linears(ckpt)
    assert len(linears) == 14 and all(isinstance(t, QTensor) and t.kind == kind for t in linears.values())
    for name, t in linears.items():
        w = weights[name]
        assert werr is None or float((t.dequantize() - w).norm() / w.norm()) < werr, name
    if method != "gguf":                 # tokenizer, chat template and generation config carried
        assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert ckpt.chat_template is not None
    if method == "gguf":
        _check_with_gguf_package(out, linears)
    llm = LLM(model=str(out), dtype=torch.float32, device="cpu", kernel="dequantized", quiet=True)
    logits = llm.prompt_logits(tokens[0].tolist()).float()
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < lerr


def test_the_collected_imatrix_is_saved_as_llama_imatrix_writes_it(tiny, tmp_path):
    """--save-imatrix: per linear `<name>.in_sum2` (sums of x^2 per input column) and `<name>.counts` (the rows),
    F32, read with the gguf package; q/k/v share one input, so one set of sums; read back as llama-quantize does."""
    import gguf
    import numpy as np
    from quanta.loaders.gguf.imatrix import read_imatrix
    path, weights, _, _ = tiny
    saved = tmp_path / "imatrix.gguf"
    quanta.quantize(path, tmp_path / "q.gguf", "gguf", type="Q8_0", imatrix=True, save_imatrix=saved, quiet=True,
                    **CALIB)
    reader = gguf.GGUFReader(saved)
    data = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert len(data) == 2 * 2 * 7 and {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    rows = CALIB["n_samples"] * CALIB["seqlen"]
    assert all(data[n].tolist() == [float(rows)] for n in data if n.endswith(".counts"))
    k_down = weights["model.layers.1.mlp.down_proj.weight"].shape[1]
    assert data["blk.1.attn_q.weight.in_sum2"].shape == (64,)
    assert data["blk.1.ffn_down.weight.in_sum2"].shape == (k_down,)
    assert np.array_equal(data["blk.1.attn_q.weight.in_sum2"], data["blk.1.attn_v.weight.in_sum2"])
    assert (data["blk.1.attn_q.weight.in_sum2"] > 0).all()
    fields = reader.fields
    assert fields["imatrix.chunk_count"].parts[-1][0] == CALIB["n_samples"]
    assert fields["imatrix.chunk_size"].parts[-1][0] == CALIB["seqlen"]
    assert torch.equal(read_imatrix(saved)["blk.0.ffn_up.weight"],
                       torch.from_numpy(data["blk.0.ffn_up.weight.in_sum2"] / np.float32(rows)))
    with pytest.raises(ConfigError, match="save_imatrix writes the importance matrix collected"):
        quanta.quantize(path, tmp_path / "r.gguf", "gguf", type="Q8_0", save_imatrix=tmp_path / "x", quiet=True)
    assert not (tmp_path / "r.gguf").exists() and not (tmp_path / "x").exists()
    # the models say what importance matrix made them, as llama-quantize's quantize.imatrix.* entries (uint32 counts)
    collected = _imatrix_fields(tmp_path / "q.gguf")
    from quanta.quant.calibration import DEFAULT_TEXT
    assert collected == {"quantize.imatrix.dataset": DEFAULT_TEXT.name, "quantize.imatrix.entries_count": 14,
                         "quantize.imatrix.chunks_count": CALIB["n_samples"]}
    quanta.quantize(path, tmp_path / "f.gguf", "gguf", type="Q8_0", imatrix=saved, quiet=True)
    assert _imatrix_fields(tmp_path / "f.gguf") == {"quantize.imatrix.file": str(saved)} | collected
    quanta.quantize(path, tmp_path / "n.gguf", "gguf", type="Q8_0", quiet=True)
    assert _imatrix_fields(tmp_path / "n.gguf") == {}


def _imatrix_fields(path) -> dict:
    """The file's quantize.imatrix.* entries read with the gguf package (strings, and counts that must be UINT32)."""
    import gguf
    out = {}
    for name, field in gguf.GGUFReader(path).fields.items():
        if name.startswith("quantize.imatrix."):
            kind = field.types[0]
            assert kind in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32), (name, kind)
            value = field.parts[-1]
            out[name] = bytes(value).decode() if kind == gguf.GGUFValueType.STRING else int(value[0])
    return out


def test_rtn_error_is_at_most_half_a_step(tiny, tmp_path):
    """AWQ-convention RTN: every weight within half its group's step (max - min) / 15 of the source
    (plus the float16 rounding of the stored scale)."""
    path, weights, _, _ = tiny
    quanta.quantize(path, tmp_path / "o", "rtn", group_size=32, quiet=True)
    for name, t in _linears(load(tmp_path / "o")).items():
        w = weights[name].reshape(t.shape[0], -1, 32)
        step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / 15
        err = (t.dequantize().reshape(w.shape) - w).abs()
        assert bool((err <= step * 0.5 * 1.01 + 1e-6).all()), name


def test_rtn_with_the_lm_head_writes_it_quantized_in_the_gptq_format(tiny, tmp_path):
    """--lm-head: the lm_head RTN-quantized in the decoders' scheme (within half a step of the source, as they
    are), the GPTQ config's `lm_head` true, and the checkpoint loads and generates."""
    path, weights, _, _ = tiny
    summary = quanta.quantize(path, tmp_path / "o", "rtn", group_size=32, symmetric=True, format="gptq",
                              lm_head=True, quiet=True)
    assert summary.format == "gptq" and "lm_head" in summary.scheme
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["lm_head"] is True
    head = load(tmp_path / "o").tensors["lm_head.weight"]
    assert isinstance(head, QTensor)
    w = weights["lm_head.weight"].reshape(head.shape[0], -1, 32)
    step = 2 * w.abs().amax(-1, keepdim=True) / 15              # symmetric: max |w| over half of 16 levels
    err = (head.dequantize().reshape(w.shape) - w).abs()
    assert bool((err <= step * 0.5 * 1.01 + 1e-6).all())
    assert main(["-q", "generate", "--model", str(tmp_path / "o"), "--device", "cpu", "--max-tokens", "2", "hi"]) \
        in (0, None)


def _check_with_gguf_package(out: Path, ours: dict):
    """The GGUF written decodes, by gguf-py's own dequantizer, to what quanta's reader gives (v, o and the
    MLP: q and k rows are stored permuted for ggml's rotary)."""
    import gguf
    from gguf.quants import dequantize

    roles = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    checked = 0
    for t in gguf.GGUFReader(out).tensors:
        _, layer, role, _ = t.name.split(".") if t.name.startswith("blk.") else ("", "", "", "")
        if role in roles:
            theirs = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            mine = ours[f"model.layers.{layer}.{roles[role]}.weight"]
            assert t.tensor_type.name.lower() == mine.type.name.lower()
            torch.testing.assert_close(mine.dequantize(), theirs, rtol=0, atol=0)
            checked += 1
    assert checked == 10


def test_cli_json_summary(tiny, tmp_path, capsys):
    """bits per weight by hand: AWQ int4 g32 = 4 (codes) + 4/32 (packed zeros) + 16/32 (fp16 scales)."""
    path, _, _, _ = tiny
    out = tmp_path / "o"
    assert main(["quantize", str(path), "--method", "rtn", "--group-size", "32", "--out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["out"] == str(out) and s["format"] == "awq" and s["method"] == "rtn"
    assert s["linear_bits_per_weight"] == pytest.approx(4 + 4 / 32 + 16 / 32)
    assert s["bytes_on_disk"] == sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    assert len(s["layers"]) == 14 and all(0 < r["weight_error"] < 0.12 for r in s["layers"])
    assert main(["quantize", str(path), "--method", "rtn", "--group-size", "32", "--out", str(out),
                 "--overwrite", "--worst", "3"]) == 0
    text = capsys.readouterr().out
    assert "bits per weight  4.625" in text and str(out) in text
    assert text.count("weight 0.") == 3


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if any quantizer or writer is reached."""
    import quanta.loaders.gguf.writer as gguf_write
    import quanta.quant.quantize_model as qm
    import quanta.toolkit.quantize.gguf_stream as gs

    def boom(*a, **k):
        raise AssertionError("work started before the check")
    monkeypatch.setattr(qm, "quantize_checkpoint", boom)
    monkeypatch.setattr(gs.GgufStream, "__iter__", boom)
    monkeypatch.setattr(gguf_write, "write_gguf", boom)
    monkeypatch.setattr("quanta.loaders.write", boom)
    monkeypatch.setattr("quanta.quant.calibration.load_calibration", boom)


BAD = [
    ("rtn", dict(group_size=48), ConfigError, "in_features 64 is not divisible by group_size 48"),
    ("gguf", dict(type="Q4_K"), ConfigError, "Q4_K blocks do not tile the rows of blk.0.attn_q.weight (K=64)"),
    ("gguf", dict(type="Q9_9"), ConfigError, "not a GGUF weight type or mix"),
    ("gptq", dict(group_size=32, act_order=True, format="awq"), UnsupportedError, "act-order g_idx"),
    ("gptq", dict(group_size=32, act_order=True, format="compressed-tensors"), UnsupportedError, "act-order"),
    ("awq", dict(bits=3, group_size=32, format="awq"), UnsupportedError, "packs only 4-bit"),
    ("awq", dict(group_size=32, calibration="/nonexistent/calib.txt"), ConfigError, "does not exist"),
    ("fp8", dict(format="awq"), ConfigError, "this method writes compressed-tensors"),
    ("rtn", dict(act_order=True), ConfigError, "act_order is a GPTQ option"),
    ("nf4", dict(bits=3), ConfigError, "bit width is fixed"),
    ("awq", dict(group_size=32, device="tpu"), ConfigError, "device must be auto, cpu or cuda[:N], got 'tpu'"),
    ("rtn", dict(group_size=32, device="mps"), ConfigError, "device must be auto, cpu or cuda[:N], got 'mps'"),
    ("gptq", dict(group_size=32, device="cuda:63"), ConfigError, "device 'cuda:63' is not available"),
    ("gguf", dict(type="Q8_0", device="cuda"), ConfigError, "--method gguf runs on the CPU"),
    ("rtn", dict(group_size=32, lm_head=True, format="awq"), ConfigError, "the awq format keeps the lm_head in float"),
    ("fp8", dict(lm_head=True), ConfigError, "lm_head quantization is for the integer schemes"),
]


@pytest.mark.parametrize("method,options,error,message", BAD)
def test_impossible_requests_fail_before_any_work(method, options, error, message, tiny, tmp_path, no_work):
    path = tiny[0]
    out = tmp_path / "o"
    with pytest.raises(error, match=_re(message)):
        quanta.quantize(path, out, method, quiet=True, **options)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_too_little_calibration_text_fails_before_quantizing(tiny, tmp_path, monkeypatch):
    import quanta.quant.quantize_model as qm
    monkeypatch.setattr(qm, "quantize_checkpoint", lambda *a, **k: pytest.fail("quantized"))
    text = tmp_path / "short.txt"
    text.write_text("just a few words of calibration text")
    with pytest.raises(ConfigError, match="fewer than n_samples"):
        quanta.quantize(tiny[0], tmp_path / "o", "gptq", group_size=32, calibration=text, quiet=True)
    assert not (tmp_path / "o").exists()


def test_existing_destination_and_stale_temp_dirs(tiny, tmp_path, no_work):
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(ConfigError, match="already exists"):
        quanta.quantize(tiny[0], out, "rtn", group_size=32, quiet=True)
    with pytest.raises(ConfigError, match="exists as a directory"):
        quanta.quantize(tiny[0], out, "gguf", type="Q8_0", overwrite=True, quiet=True)
    assert main(["quantize", str(tiny[0]), "--method", "rtn", "--out", str(out)]) == 2


def test_stale_temp_dir_is_not_output(tiny, tmp_path):
    """A temporary folder left by a killed run is neither taken for the output nor in the way."""
    stale = tmp_path / ".o.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    summary = quanta.quantize(tiny[0], tmp_path / "o", "rtn", group_size=32, quiet=True)
    assert load(tmp_path / "o").format == "awq" and Path(summary.out).name == "o"
    assert summary.bytes_on_disk < sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())


def _re(text: str) -> str:
    import re
    return re.escape(text)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_interrupted_run_leaves_nothing(sig, tmp_path):
    """A real `quanta quantize` process signalled while it writes: nothing at --out, no temporary folder."""
    path, _ = build_tiny_hf("llama", tmp_path / "m", num_hidden_layers=6)
    out = tmp_path / "o"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    # A terminal's Ctrl-C reaches a process whose SIGINT is at its default; a test run started in the background
    # (`pytest &`) would otherwise hand the child an ignored SIGINT, which Python then keeps ignoring.
    proc = subprocess.Popen([sys.executable, "-m", "quanta.cli.main", "-q", "quantize", str(path), "--method", "awq",
                             "--group-size", "32", "--samples", "32", "--seqlen", "128", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".o.tmp-*")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the writer never started"
        time.sleep(0.02)
    time.sleep(0.3)                      # well into the layers
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    assert "nothing was written" in err
    assert not out.exists() and not list(tmp_path.glob(".o.*"))


def test_gguf_to_gguf_never_builds_the_tokenizer_and_keeps_its_entries(default_model_path, tmp_path, monkeypatch):
    """Requantizing a GGUF without calibration copies the vocabulary and chat template from the source's metadata;
    building the transformers tokenizer (seconds) would be wasted, so it is not done."""
    from gguf import GGUFReader
    from quanta.loaders.gguf import reader

    def refuse(_path):
        raise AssertionError("the tokenizer was built")
    monkeypatch.setattr(reader, "load_tokenizer", refuse)
    out = tmp_path / "q8.gguf"
    quanta.quantize(default_model_path, out, "gguf", type="Q8_0", quiet=True)
    source, written = GGUFReader(default_model_path).fields, GGUFReader(out).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "tokenizer.ggml.model"):
        assert key in written and written[key].contents() == source[key].contents(), key
