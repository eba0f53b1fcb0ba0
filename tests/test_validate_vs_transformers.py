"""`quanta validate` on the default model (SmolLM2-135M Q4_1 GGUF) through the exact path (dequantized
kernel, float32) reproduces transformers' float32 perplexity on the same WikiText-2 windows, computed
here independently: transformers' own GGUF tokenizer and model, windows cut by hand, second half scored.

The full figure (40 windows of 512 tokens; transformers: 22.3746) runs only when asked for with
`-m slow`, as it takes minutes on two cores; the default suite checks 4 windows of 128 tokens.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import quanta  # noqa: E402
from quanta.engine import LLM  # noqa: E402
from quanta.eval.windows import DEFAULT_TEXT  # noqa: E402

EXACT = {"device": "cpu", "dtype": "float32", "kernel": "dequantized", "quiet": True}


@pytest.fixture(scope="module")
def text() -> str:
    if not DEFAULT_TEXT.is_file():
        pytest.skip(f"{DEFAULT_TEXT} missing")
    return DEFAULT_TEXT.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def head(text, tmp_path_factory):
    """The start of the text, enough for the short check's windows (tokenizing all of it costs seconds)."""
    path = tmp_path_factory.mktemp("text") / "head.txt"
    path.write_text(text[:8000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def theirs(default_model_path):
    """(transformers tokenizer, float32 transformers model) of the GGUF file. The tokenizer is the one
    transformers converts from this GGUF file, saved once by tests/tiny_models.py (the conversion is slow)."""
    from tiny_models import tokenizer_dir
    path = default_model_path
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def ours(default_model_path):
    return LLM(str(default_model_path), **EXACT)


def transformers_perplexity(theirs, text: str, ctx: int, windows: int) -> float:
    """Non-overlapping windows of `ctx` tokens of the whole text (SmolLM2 adds no BOS), tokens ctx/2 ..
    ctx-1 of each scored, float64 log-softmax."""
    tok, model = theirs
    assert tok("a")["input_ids"] == tok("a", add_special_tokens=False)["input_ids"]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    nll, count = 0.0, 0
    for i in range(windows):
        w = torch.tensor([ids[i * ctx:(i + 1) * ctx]])
        with torch.no_grad():
            lp = model(w).logits[0].double().log_softmax(-1)
        nll -= lp[ctx // 2 - 1:ctx - 1].gather(1, w[0, ctx // 2:, None]).sum().item()
        count += ctx - ctx // 2
    return math.exp(nll / count)


def test_perplexity_matches_transformers(ours, theirs, head):
    want = transformers_perplexity(theirs, head.read_text(encoding="utf-8"), ctx=128, windows=4)
    got = quanta.validate(ours, text=head, ctx=128, n_windows=4, progress=False)
    assert (got.windows, got.scored_tokens, got.bos_token_id) == (4, 256, None)
    assert got.engine == {"device": "cpu", "dtype": "float32", "kernel": "dequantized"}
    assert got.perplexity == pytest.approx(want, rel=1e-4)


@pytest.mark.slow
def test_perplexity_40_windows_of_512_matches_transformers(ours, theirs, text):
    want = transformers_perplexity(theirs, text, ctx=512, windows=40)
    assert want == pytest.approx(22.3746, abs=1e-4)
    got = quanta.validate(ours, ctx=512, n_windows=40, progress=False)
    assert got.scored_tokens == 40 * 256
    assert got.perplexity == pytest.approx(want, rel=1e-4)


def test_cli_json(default_model_path, capsys):
    """`quanta validate --windows 2 --json` on the default model prints the result as JSON."""
    from quanta.cli.main import main
    assert main(["-q", "validate", "--windows", "2", "--ctx", "128", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == str(default_model_path)
    assert (data["windows"], data["ctx"], data["stride"], data["score"], data["scored_tokens"]) == \
        (2, 128, 128, "second-half", 128)
    assert 1 < data["perplexity"] < 1000 and data["perplexity_stderr"] > 0
    assert data["engine"]["device"] == "cpu"
    assert data["reference"] is None and data["kl"] is None and data["layers"] is None


def test_weight_error_of_identical_gguf_is_zero(default_model_path):
    """Every matrix of the GGUF dequantized twice."""
    from quanta.eval.layer_error import weight_errors
    from quanta.loaders import load
    errors, unmatched = weight_errors(load(default_model_path), load(default_model_path))
    assert len(errors) == 1 + 30 * 7 and not unmatched            # the (tied) embedding and 7 per layer
    assert all(e.rel_frobenius == 0 and e.max_abs == 0 for e in errors)
    assert any("q4_1" in e.scheme for e in errors)


@pytest.mark.slow
def test_40_windows_against_a_lossless_conversion_in_bounded_memory(default_model_path, tmp_path):
    """`quanta validate --windows 40 --exact` of the default model converted to float32 HF against the GGUF: KL 0
    and perplexity equal, and the command's peak host memory (two models, one at a time, and the per-layer weight
    error) about the same with 40 windows as with 4, and within issue 44's 2 GB."""
    import re
    import subprocess
    import sys
    out = tmp_path / "hf"
    report = quanta.convert(default_model_path, "hf", out, dtype="float32", validate=False, quiet=True)
    assert report.lossless
    # the command in a child that reports its own peak resident set as it exits: VmHWM, its address space's
    # high-water mark (ru_maxrss would carry the forking test process's, which can be larger)
    child = ("import sys\nfrom quanta.cli.main import main\nrc = main(sys.argv[1:])\n"
             "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr)\n"
             "sys.exit(rc)")

    def run(windows: int) -> tuple[dict, int]:
        cmd = [sys.executable, "-c", child, "-q", "validate", str(out), "--reference", str(default_model_path),
               "--windows", str(windows), "--exact", "--json", "--device", "cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout), int(re.search(r"VmHWM:\s+(\d+) kB", done.stderr).group(1)) * 1024

    data, peak = run(40)
    assert data["windows"] == 40 and data["scored_tokens"] == 40 * 256
    assert data["perplexity"] == data["reference_perplexity"]
    assert data["kl"]["mean"] == 0 and data["kl"]["top1_agreement"] == 1.0
    _, peak_4 = run(4)
    # growth with the windows (each window's KV blocks or reference logits kept) would add tens of MB a window
    assert peak <= peak_4 + 300e6 and peak <= 2e9, f"peak RSS {peak / 1e9:.2f} GB, {peak_4 / 1e9:.2f} GB at 4 windows"
