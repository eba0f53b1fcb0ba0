"""quanta.validate on tiny random models: perplexity, KL divergence and top-1 agreement against direct
torch computations on transformers' logits of the same windows; the stored top-k reference; the
per-layer weight error against safetensors read directly and against AutoAWQ's own dequantization
(tests/fixtures/awq); and the errors bad input gets before any model is built."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import quanta  # noqa: E402
from quanta.engine import LLM  # noqa: E402
from quanta.eval.layer_error import weight_errors  # noqa: E402
from quanta.eval.windows import DEFAULT_TEXT, WindowSpec, tokenize  # noqa: E402
from quanta.loaders import load  # noqa: E402
from quanta.quant.errors import ConfigError, CorruptFileError  # noqa: E402

CTX, WINDOWS = 64, 6
FIXTURES = Path(__file__).parent / "fixtures"
CPU32 = {"device": "cpu", "dtype": "float32", "quiet": True}


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """The start of WikiText-2 (enough for a few windows of CTX tokens)."""
    if not DEFAULT_TEXT.is_file():
        pytest.skip(f"{DEFAULT_TEXT} missing")
    path = tmp_path_factory.mktemp("text") / "wiki.txt"
    path.write_text(DEFAULT_TEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny llama (the reference) and a copy with every weight matrix perturbed (the tested model):
    (reference path, tested path, reference transformers model, tested transformers model)."""
    from tiny_models import build_tiny_hf
    root = tmp_path_factory.mktemp("pair")
    ref_path, ref_model = build_tiny_hf("llama", root / "ref")
    test_model = transformers.AutoModelForCausalLM.from_pretrained(str(ref_path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in test_model.named_parameters():
            if p.dim() == 2:
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    test_path = root / "test"
    test_model.save_pretrained(test_path)
    for f in ref_path.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, test_path / f.name)
    return ref_path, test_path, ref_model, test_model


def oracle(pair, text: Path) -> dict:
    """The figures computed here from transformers' logits: windows cut by hand from the tokenizer's ids
    (SmolLM2's tokenizer adds no BOS), second half scored, float64 log-softmax."""
    ref_path, _, ref_model, test_model = pair
    tok = transformers.AutoTokenizer.from_pretrained(str(ref_path))
    ids = tok(text.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert tok("a")["input_ids"] == tok("a", add_special_tokens=False)["input_ids"]   # no BOS added
    kl, nll, ref_nll, same = [], [], [], []
    for i in range(WINDOWS):
        w = torch.tensor([ids[i * CTX:(i + 1) * CTX]])
        with torch.no_grad():
            lt = test_model(w).logits[0].double().log_softmax(-1)[CTX // 2 - 1:CTX - 1]
            lr = ref_model(w).logits[0].double().log_softmax(-1)[CTX // 2 - 1:CTX - 1]
        target = w[0, CTX // 2:, None]
        kl.append(torch.nn.functional.kl_div(lt, lr, log_target=True, reduction="none").sum(-1))
        nll.append(-lt.gather(1, target)[:, 0])
        ref_nll.append(-lr.gather(1, target)[:, 0])
        same.append((lt.argmax(-1) == lr.argmax(-1)).double())
    kl, nll, ref_nll, same = (torch.cat(x) for x in (kl, nll, ref_nll, same))
    return {"kl": kl, "ppl": math.exp(nll.mean().item()), "ref_ppl": math.exp(ref_nll.mean().item()),
            "same": same.mean().item(), "n": len(kl)}


@pytest.fixture(scope="module")
def llms(pair):
    """The reference and the tested model, built once: (reference LLM, tested LLM)."""
    return LLM(str(pair[0]), **CPU32), LLM(str(pair[1]), **CPU32)


@pytest.fixture(scope="module")
def live(pair, text):
    """quanta.validate(tested, reference=reference), both models loaded."""
    ref_path, test_path, _, _ = pair
    return quanta.validate(str(test_path), str(ref_path), text=text, ctx=CTX, n_windows=WINDOWS,
                           model_options=CPU32)


def test_kl_and_perplexity_match_transformers(pair, text, live):
    want = oracle(pair, text)
    assert live.scored_tokens == want["n"] == WINDOWS * CTX // 2
    assert live.kl.mean > 1e-3                                  # the perturbation is visible
    assert live.kl.mean == pytest.approx(want["kl"].mean().item(), rel=1e-3)
    assert live.kl.max == pytest.approx(want["kl"].max().item(), rel=1e-3)
    assert live.kl.median == pytest.approx(want["kl"].median().item(), rel=2e-2)
    assert live.perplexity == pytest.approx(want["ppl"], rel=1e-5)
    assert live.reference_perplexity == pytest.approx(want["ref_ppl"], rel=1e-5)
    assert live.kl.ln_ppl_ratio == pytest.approx(math.log(want["ppl"] / want["ref_ppl"]), abs=1e-5)
    assert abs(live.kl.top1_agreement - want["same"]) <= 1.5 / want["n"]     # a near-tie may flip once
    assert live.kl.top_k is None


def test_per_layer_error_against_safetensors(pair, live):
    """Each matrix's relative Frobenius and max-abs error, as computed here from the two files."""
    from safetensors.torch import load_file
    ref_path, test_path, _, _ = pair
    ref, test = load_file(ref_path / "model.safetensors"), load_file(test_path / "model.safetensors")
    got = {e.name: e for e in live.layers}
    matrices = {n for n, t in ref.items() if t.dim() == 2}
    assert set(got) == matrices and not live.unmatched_tensors
    for name in matrices:
        diff = (test[name] - ref[name]).double()
        assert got[name].rel_frobenius == pytest.approx((diff.norm() / ref[name].double().norm()).item(), rel=1e-6)
        assert got[name].max_abs == pytest.approx(diff.abs().max().item(), rel=1e-6)


def test_model_against_itself(llms, text):
    """KL 0, top-1 100%, equal perplexities, every weight error 0."""
    ref = llms[0]
    r = quanta.validate(ref, ref, text=text, ctx=CTX, n_windows=2)
    assert r.kl.mean == 0 and r.kl.max == 0 and r.kl.top1_agreement == 1.0
    assert r.perplexity == r.reference_perplexity and r.kl.ln_ppl_ratio == 0
    assert r.layers and all(e.rel_frobenius == 0 and e.max_abs == 0 for e in r.layers)


@pytest.fixture(scope="module")
def lossless_pair(pair, tmp_path_factory):
    """The tiny reference quantized to GGUF Q4_1, and that GGUF converted to float32 HF (exact: every value the
    GGUF decodes to): (GGUF path, HF path)."""
    root = tmp_path_factory.mktemp("lossless")
    quanta.convert(pair[0], "gguf:Q4_1", root / "q4_1.gguf", validate=False, quiet=True)
    report = quanta.convert(root / "q4_1.gguf", "hf", root / "hf", dtype="float32", validate=False, quiet=True)
    assert report.lossless
    return root / "q4_1.gguf", root / "hf"


def test_exact_validation_of_a_lossless_conversion_gives_kl_zero(lossless_pair, text):
    """On the float32 reference path the converted model computes its source's logits exactly: KL 0, top-1 100%,
    equal perplexities. On the default path the GGUF runs torch's int4 kernel (bf16 inputs) and the two differ."""
    gguf, hf = lossless_pair
    r = quanta.validate(str(hf), str(gguf), text=text, ctx=CTX, n_windows=2, exact=True, layer_errors=False,
                        model_options={"quiet": True})
    assert r.kl.mean == 0 and r.kl.max == 0 and r.kl.top1_agreement == 1.0
    assert r.perplexity == r.reference_perplexity
    assert r.engine == {"device": "cpu", "dtype": "float32", "kernel": "dequantized"}
    loose = quanta.validate(str(hf), str(gguf), text=text, ctx=CTX, n_windows=2, layer_errors=False,
                            model_options={"quiet": True, "device": "cpu"})
    assert loose.kl.mean > 0


def test_convert_validates_a_lossless_output_exactly(lossless_pair, text, tmp_path):
    """convert's own check of a lossless output runs on the float32 path and reports KL 0; asked for another
    dtype it runs that."""
    gguf, _ = lossless_pair
    report = quanta.convert(gguf, "hf", tmp_path / "hf", dtype="float32", quiet=True, windows=1, ctx=CTX, text=text)
    assert report.lossless and report.validation["kl_mean"] == 0
    assert report.validation["engine"]["kernel"] == "dequantized"
    report = quanta.convert(gguf, "hf", tmp_path / "hf2", dtype="float32", quiet=True, windows=1, ctx=CTX, text=text,
                            validate_options={"dtype": "bfloat16", "device": "cpu"})
    assert report.validation["engine"] == {"device": "cpu", "dtype": "bfloat16", "kernel": "auto"}
    assert report.validation["kl_mean"] > 0


def test_exact_refuses_a_built_model_or_another_kernel(llms, pair, text, no_model_built):
    with pytest.raises(ConfigError, match="give a checkpoint path"):
        quanta.validate(llms[0], str(pair[0]), text=text, ctx=CTX, n_windows=1, exact=True)
    with pytest.raises(ConfigError, match="kernel='dequantized', not 'cpu_int4'"):
        quanta.validate(str(pair[1]), str(pair[0]), text=text, ctx=CTX, n_windows=1, exact=True,
                        model_options={"kernel": "cpu_int4"})


def test_stored_reference(llms, text, live, tmp_path):
    """The reference's top-k log-probabilities stored, then compared: with k = the vocabulary the figures
    are the live ones; with a small k, KL is a lower bound of the live KL; other windows are refused."""
    ref, test = llms
    vocab = ref.checkpoint.config.vocab_size
    full, small = tmp_path / "full.ref", tmp_path / "small.ref"
    alone = quanta.validate(ref, text=text, ctx=CTX, n_windows=WINDOWS, save_reference=full, top_k=vocab + 100)
    assert alone.reference is None and alone.perplexity == pytest.approx(live.reference_perplexity, rel=1e-12)
    quanta.validate(ref, text=text, ctx=CTX, n_windows=WINDOWS, save_reference=small, top_k=8)
    stored = quanta.validate(test, full, text=text, ctx=CTX, n_windows=WINDOWS)
    assert stored.kl.top_k == vocab and stored.layers is None
    assert stored.kl.mean == pytest.approx(live.kl.mean, rel=1e-5)
    assert stored.kl.top1_agreement == live.kl.top1_agreement
    assert stored.reference_perplexity == pytest.approx(live.reference_perplexity, rel=1e-12)
    assert stored.perplexity == pytest.approx(live.perplexity, rel=1e-12)
    few = quanta.validate(test, small, text=text, ctx=CTX, n_windows=WINDOWS - 2)
    live_first = quanta.validate(test, ref, text=text, ctx=CTX, n_windows=WINDOWS - 2, layer_errors=False)
    assert few.kl.top_k == 8 and 0 < few.kl.mean <= live_first.kl.mean + 1e-9
    assert few.kl.top1_agreement == live_first.kl.top1_agreement
    with pytest.raises(ConfigError, match="ctx"):
        quanta.validate(test, full, text=text, ctx=CTX // 2)
    other = tmp_path / "other.txt"
    other.write_text(text.read_text()[::-1])
    with pytest.raises(ConfigError, match="window 0 holds other tokens"):
        quanta.validate(test, full, text=other, ctx=CTX, n_windows=2)
    bad = tmp_path / "bad.ref"
    bad.write_bytes(full.read_bytes()[:-10])
    with pytest.raises(CorruptFileError, match="truncated"):
        quanta.validate(test, bad, text=text, ctx=CTX, n_windows=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.ref", "full.ref", "other.txt", "small.ref"]


def test_weight_error_against_autoawq_dequantization(tmp_path):
    """An AWQ checkpoint against a dense one holding AutoAWQ's dequantized weights plus known noise:
    the errors are those of the noise, computed here from the tool's dequantization."""
    from safetensors.torch import load_file, save_file
    src = FIXTURES / "awq" / "gemm_g32"
    reference = load_file(src / "reference.safetensors")             # awq.utils.packing_utils.dequantize_gemm
    state = {k: v for k, v in load_file(src / "model.safetensors").items()
             if not k.endswith((".qweight", ".qzeros", ".scales"))}
    gen = torch.Generator().manual_seed(0)
    noise = {name: 1e-3 * torch.randn(w.shape, generator=gen) for name, w in reference.items()}
    state |= {name: (w.float() + noise[name]).to(w.dtype) for name, w in reference.items()}
    dense = tmp_path / "dense"
    dense.mkdir()
    import json
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(config))
    save_file(state, dense / "model.safetensors")
    errors, unmatched = weight_errors(load(src), load(dense))
    assert not unmatched
    got = {e.name: e for e in errors}
    for name, w in reference.items():
        dense_w = state[name].double()
        diff = w.double() - dense_w
        # AutoAWQ dequantizes in fp16, quanta in float32: the figures agree to fp16's rounding.
        assert got[name].rel_frobenius == pytest.approx((diff.norm() / dense_w.norm()).item(), rel=1e-3), name
        assert got[name].scheme.startswith("affine") and got[name].reference_scheme.startswith("dense")
    assert all(got[n].rel_frobenius == 0 for n in got if n not in reference)    # embeddings, lm_head: same


def test_windows_follow_llama_cpp_layout():
    """Non-overlapping windows of the whole text's ids; with a BOS-adding tokenizer every window starts
    with BOS in place of its first token (llama.cpp's perplexity)."""
    class Tok:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=True):
            ids = [10 + ord(c) for c in text]
            return {"input_ids": ([1] if add_special_tokens else []) + ids}

    text = "abcdefghijklmnopqrstuvwxyz"
    w = tokenize(Tok(), text, WindowSpec(ctx=8))
    ids = [1] + [10 + ord(c) for c in text]
    assert w.bos_token_id == 1 and w.text_tokens == 27
    assert w.windows == [[1] + ids[1:8], [1] + ids[9:16], [1] + ids[17:24]]
    assert w.scored_per_window == 4
    w = tokenize(Tok(), text, WindowSpec(ctx=8, stride=4, n_windows=2, score="all"))
    assert w.windows == [[1] + ids[1:8], [1] + ids[5:12]] and w.scored_per_window == 7
    with pytest.raises(ConfigError, match="only 3 windows"):
        tokenize(Tok(), text, WindowSpec(ctx=8, n_windows=4))
    with pytest.raises(ConfigError, match="27 tokens, fewer than one window of ctx=32"):
        tokenize(Tok(), text, WindowSpec(ctx=32))


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if an engine is built: bad input must be refused before any weight is read."""
    def refuse(*a, **k):
        raise AssertionError("a model was built")
    monkeypatch.setattr("quanta.eval.sides.EngineCore", refuse)


def test_bad_input_refused_before_loading(pair, text, tmp_path, no_model_built):
    ref_path, test_path, _, _ = pair
    with pytest.raises(ConfigError, match="nothing.txt does not exist"):
        quanta.validate(str(test_path), text=tmp_path / "nothing.txt")
    with pytest.raises(ConfigError, match=r"ctx=4096 is longer than the model .*max_position_embeddings=2048"):
        quanta.validate(str(test_path), text=text, ctx=4096)
    with pytest.raises(ConfigError, match="ctx=128 is longer than max_model_len=64"):
        quanta.validate(str(test_path), text=text, ctx=128, model_options={"max_model_len": 64})
    short = tmp_path / "short.txt"
    short.write_text("Hello world.")
    with pytest.raises(ConfigError, match="fewer than one window of ctx=64"):
        quanta.validate(str(test_path), text=short, ctx=64)
    with pytest.raises(ConfigError, match="score"):
        quanta.validate(str(test_path), text=text, score="first-half")
    with pytest.raises(ConfigError, match="reference .*does not exist"):
        quanta.validate(str(test_path), tmp_path / "missing-ref", text=text, ctx=CTX)
    with pytest.raises(ConfigError, match="folder .* does not exist"):
        quanta.validate(str(test_path), text=text, ctx=CTX, save_reference=tmp_path / "no" / "ref")


def test_reference_with_another_vocabulary_refused(pair, text, tmp_path, no_model_built):
    from tiny_models import make_tiny_hf
    other = make_tiny_hf("llama", tmp_path / "other", vocab_size=50000)
    with pytest.raises(ConfigError, match="vocabulary of 50000 tokens"):
        quanta.validate(str(pair[1]), str(other), text=text, ctx=CTX)


def test_reference_with_another_tokenizer_refused(pair, text, tmp_path, no_model_built):
    """Same vocabulary size, but two tokens' ids swapped in the reference's tokenizer."""
    import json
    swapped = tmp_path / "swapped"
    shutil.copytree(pair[0], swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["\u0120the"], vocab["\u0120of"] = vocab["\u0120of"], vocab["\u0120the"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="tokenizes the text differently"):
        quanta.validate(str(pair[1]), str(swapped), text=text, ctx=CTX)


def test_result_json_and_table(live):
    import json
    data = json.loads(live.to_json())
    assert data["kl"]["mean"] == live.kl.mean and data["windows"] == WINDOWS
    assert data["layers_summary"]["tensors"] == len(live.layers)
    table = live.table(layers=True)
    assert "KL divergence" in table and "same top-1 token" in table and "model.layers.0.mlp.up_proj.weight" in table


def test_cli_against_reference(pair, text, capsys):
    """`quanta validate MODEL --reference REF` prints the table; bad input exits 2 with the message."""
    from quanta.cli.main import main
    ref_path, test_path, _, _ = pair
    args = ["-q", "validate", str(test_path), "--reference", str(ref_path), "--text", str(text), "--windows", "2",
            "--device", "cpu", "--dtype", "float32"]
    assert main(args + ["--ctx", str(CTX), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "KL divergence (full vocabulary)" in out and "model.layers.1.mlp.down_proj.weight" in out
    assert main(args + ["--ctx", "4096"]) == 2
    assert "ctx=4096 is longer than the model" in capsys.readouterr().err
