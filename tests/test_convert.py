"""quanta convert: lossless round trips (bit-exact), re-quantization reports, tokenizer/chat template transfer,
refusals, validation sidecar. Oracles: the reference tools' dequantized weights committed with the fixtures
(AutoAWQ, GPTQModel), the `gguf` package's reader and dequantizer, transformers' tokenizers and models.
Memory, signal and llama.cpp tests are in test_convert_process.py / test_convert_gguf.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import quanta
from quanta.loaders import load
from quanta.quant.errors import ConfigError
from tiny_models import make_tiny_hf

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE = "Hello world! The quick brown fox, 12345 — naïve café. <|im_start|>user\nhi<|im_end|>"


def conv(src, to, out, **kw):
    kw.setdefault("validate", False)
    return quanta.convert(src, to, out, quiet=True, **kw)


def stored(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint directory (one or more shards)."""
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out |= load_file(str(f))
    return out


def assert_same_files(a: Path, b: Path, names=("tokenizer.json", "tokenizer_config.json", "generation_config.json")):
    """Every one of the tokenizer files `a` has is in `b` with the same content (`b` may add a
    generation_config.json that the writers derive from the config's bos/eos)."""
    for name in names:
        if (a / name).exists():
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name


def dequantized(path: Path) -> dict[str, torch.Tensor]:
    from quanta.quant.qtensor import QTensor
    ckpt = load(path)
    return {n: t.dequantize(torch.float32) for n, t in ckpt.tensors.items() if isinstance(t, QTensor)}


def assert_dequantizes_to_reference(out: Path, src: Path) -> None:
    """Every weight of `out` dequantizes exactly to the source fixture's reference.safetensors (the dequantization
    of the format's own reference code, AutoAWQ's or AutoGPTQ's)."""
    reference = load_file(str(src / "reference.safetensors"))
    got = dequantized(out)
    for name, want in reference.items():
        assert torch.equal(got[name].to(want.dtype), want), name


# --- lossless pairs -------------------------------------------------------------------------------
def test_awq_to_gptq_v2_and_back_is_bit_exact(tmp_path):
    src = FIXTURES / "awq" / "gemm_g32"
    r1 = conv(src, "gptq", tmp_path / "gptq")
    assert r1.lossless and r1.to_dict()["counts"]["lossless"] == 14
    cfg = json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]
    assert cfg["checkpoint_format"] == "gptq_v2" and cfg["desc_act"] is False and cfg["group_size"] == 32
    # the GPTQ output dequantizes to AutoAWQ's own dequantization of the source (oracle: the fixture)
    assert_dequantizes_to_reference(tmp_path / "gptq", src)
    r2 = conv(tmp_path / "gptq", "awq", tmp_path / "awq")
    assert r2.lossless
    a, b = stored(src), stored(tmp_path / "awq")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert_same_files(src, tmp_path / "awq")
    assert (src / "chat_template.jinja").read_text() == (tmp_path / "awq" / "chat_template.jinja").read_text()


def test_symmetric_gptq_to_awq_is_lossless(tmp_path):
    src = FIXTURES / "gptq" / "b4_g32_sym_autogptq"
    report = conv(src, "awq", tmp_path / "awq")
    assert report.lossless
    assert_dequantizes_to_reference(tmp_path / "awq", src)
    back = conv(tmp_path / "awq", "gptq", tmp_path / "gptq")
    assert back.lossless
    assert_dequantizes_to_reference(tmp_path / "gptq", src)


def test_act_order_gptq_to_awq_is_requantized_and_reported(tmp_path):
    src = FIXTURES / "gptq" / "b4_g32_asym_descact"
    report = conv(src, "awq", tmp_path / "awq", group_size=32)
    linears = [r for r in report.tensors if r.name.endswith("_proj.weight")]
    assert linears and all(r.action == "requantized" and not r.lossless and 0 < r.error < 0.2 for r in linears)
    assert all("act-order" in r.source and "act-order" not in r.target for r in linears)
    saved = json.loads((tmp_path / "awq" / "quanta_convert.json").read_text())
    assert saved["lossless"] is False and saved["counts"]["requantized"] == len(linears)
    # the re-quantized weights stay close to GPTQModel's dequantization of the source
    reference = load_file(str(src / "reference.safetensors"))
    got = dequantized(tmp_path / "awq")
    for name, want in reference.items():
        err = float((got[name] - want.float()).norm() / want.float().norm())
        assert err < 0.2, (name, err)


def _gguf_tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """GGUF tensor name -> (type name, raw bytes), read by the `gguf` package (not quanta's reader)."""
    from gguf import GGUFReader
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in GGUFReader(str(path)).tensors}


SLOW = pytest.mark.slow


@pytest.mark.parametrize("ggml_type,to", [("Q4_0", "gptq"), pytest.param("Q8_0", "gptq", marks=SLOW),
                                          ("Q4_0", "awq"), pytest.param("Q4_0", "compressed-tensors", marks=SLOW),
                                          ("Q8_0", "compressed-tensors")])
def test_gguf_legacy_blocks_through_integer_formats_are_bit_exact(tmp_path, ggml_type, to):
    hf = make_tiny_hf("llama", tmp_path / "hf")
    first = conv(hf, f"gguf:{ggml_type}", tmp_path / "a.gguf")
    assert not first.lossless
    mid = conv(tmp_path / "a.gguf", to, tmp_path / "mid")
    linears = [r for r in mid.tensors if r.name.endswith("_proj.weight")]
    assert all(r.action == "lossless" for r in linears), [r for r in linears if r.action != "lossless"][:1]
    conv(tmp_path / "mid", f"gguf:{ggml_type}", tmp_path / "b.gguf")
    a, b = _gguf_tensors(tmp_path / "a.gguf"), _gguf_tensors(tmp_path / "b.gguf")
    blk = [n for n in a if n.startswith("blk.") and a[n][0] == ggml_type]
    assert len(blk) == 14
    for name in blk:
        assert b[name] == a[name], name


@pytest.mark.parametrize("ggml_type", ["Q4_1", pytest.param("Q5_0", marks=SLOW), pytest.param("Q5_1", marks=SLOW),
                                       "Q8_0"])
def test_gguf_to_hf_float32_equals_the_gguf_package_dequantization(tmp_path, ggml_type):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    hf = make_tiny_hf("qwen2", tmp_path / "hf")        # qwen2: GGUF q/k rows are not permuted
    conv(hf, f"gguf:{ggml_type}", tmp_path / "m.gguf")
    report = conv(tmp_path / "m.gguf", "hf", tmp_path / "out", dtype="float32")
    assert all(r.lossless for r in report.tensors)
    out = stored(tmp_path / "out")
    for t in GGUFReader(str(tmp_path / "m.gguf")).tensors:
        if t.name == "blk.1.ffn_down.weight":
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            assert t.tensor_type.name == ggml_type
            assert torch.equal(out["model.layers.1.mlp.down_proj.weight"], want.reshape(out[
                "model.layers.1.mlp.down_proj.weight"].shape))


def test_gguf_q4_1_to_gguf_keeps_blocks_and_hf_to_hf_is_identity(tmp_path):
    hf = make_tiny_hf("llama", tmp_path / "hf", dtype=torch.bfloat16)
    conv(hf, "gguf:Q4_1", tmp_path / "a.gguf")
    report = conv(tmp_path / "a.gguf", "gguf", tmp_path / "b.gguf")
    assert all(r.lossless for r in report.tensors if r.name.endswith("_proj.weight"))
    a, b = _gguf_tensors(tmp_path / "a.gguf"), _gguf_tensors(tmp_path / "b.gguf")
    assert all(b[n] == a[n] for n in a if a[n][0] == "Q4_1")
    again = conv(hf, "hf", tmp_path / "same")
    assert again.lossless and {r.action for r in again.tensors} == {"copied"}
    x, y = stored(hf), stored(tmp_path / "same")
    assert all(torch.equal(x[n], y[n]) for n in x)


def test_requantization_to_each_format_loads_back(tmp_path):
    hf = make_tiny_hf("llama", tmp_path / "hf")
    for to, kind in [("fp8", "fp8"), ("nf4", "codebook"), ("awq", "affine"), ("gptq", "affine"),
                     ("compressed-tensors", "affine"), ("gguf:Q4_K_M", "gguf")]:
        out = tmp_path / to.replace(":", "_")
        report = conv(hf, to, out if kind != "gguf" else out.with_suffix(".gguf"), group_size=32)
        rows = [r for r in report.tensors if r.name.endswith("_proj.weight")]
        assert rows and all(r.action == "quantized" and 0 < r.error < 0.2 for r in rows), to
        ckpt = load(out if kind != "gguf" else out.with_suffix(".gguf"))
        assert ckpt.tensors["model.layers.0.mlp.up_proj.weight"].kind == kind


# --- tokenizer, chat template, config -------------------------------------------------------------
@pytest.mark.slow
def test_gguf_to_hf_carries_tokenizer_and_chat_template(tmp_path, default_model_path):
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    conv(default_model_path, "hf", tmp_path / "hf", dtype="float16")
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    theirs = AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)
    assert ours.encode(SAMPLE) == theirs.encode(SAMPLE)
    field = GGUFReader(str(default_model_path)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode()
    assert ours.chat_template == template
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(msgs, tokenize=False)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == theirs.eos_token_id or gen["eos_token_id"] == 2
    # and back to GGUF: the tokenizer metadata survives (the gguf package reads the same tokens)
    conv(tmp_path / "hf", "gguf:Q8_0", tmp_path / "back.gguf")
    a, b = GGUFReader(str(default_model_path)).fields, GGUFReader(str(tmp_path / "back.gguf")).fields
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        assert [bytes(a[key].parts[i]) for i in a[key].data] == [bytes(b[key].parts[i]) for i in b[key].data], key
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="back.gguf")
    assert back.encode(SAMPLE) == theirs.encode(SAMPLE)
    assert back.chat_template == template


# --- refusals and safety --------------------------------------------------------------------------
def test_refusals_leave_everything_untouched(tmp_path):
    hf = make_tiny_hf("llama", tmp_path / "hf")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    with pytest.raises(ConfigError, match="is the source"):
        conv(hf, "awq", hf, force=True)
    with pytest.raises(ConfigError, match="inside the source"):
        conv(hf, "awq", hf / "sub", force=True)
    with pytest.raises(ConfigError, match="not a format"):
        conv(hf, "exl2", tmp_path / "x")
    with pytest.raises(ConfigError, match="Q9_9"):
        conv(hf, "gguf:Q9_9", tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="calibration applies"):
        conv(hf, "fp8", tmp_path / "x", calibration="x.txt")
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep").write_text("mine")
    with pytest.raises(ConfigError, match="already exists"):
        conv(hf, "awq", tmp_path / "exists")
    assert (tmp_path / "exists" / "keep").read_text() == "mine"
    conv(hf, "awq", tmp_path / "exists", force=True)
    assert not (tmp_path / "exists" / "keep").exists() and (tmp_path / "exists" / "config.json").is_file()
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_failing_conversion_leaves_no_output(tmp_path):
    """A weight the target cannot take (K not a multiple of the group size) fails mid-stream: nothing at DST."""
    hf = make_tiny_hf("llama", tmp_path / "hf")
    with pytest.raises(quanta.QuantaError, match="group size 48"):
        conv(hf, "awq", tmp_path / "out", group_size=48)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_validation_sidecar_and_cli_line(tmp_path, capsys):
    from quanta.cli.main import main
    hf = make_tiny_hf("llama", tmp_path / "hf")
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    rc = main(["convert", str(hf), "--to", "gguf:Q8_0", "--out", str(tmp_path / "m.gguf"), "--windows", "2",
               "--ctx", "64", "--text", str(text), "--device", "cpu", "-q"])
    assert rc == 0
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if ln.startswith("validate:")]
    assert len(line) == 1 and "KL" in line[0] and "top-1" in line[0]
    v = json.loads((tmp_path / "m.gguf.validation.json").read_text())
    assert v["windows"] == 2 and v["ctx"] == 64 and v["kl"]["top1_agreement"] > 0.9
    report = json.loads((tmp_path / "m.gguf.convert.json").read_text())
    assert report["validation"]["kl_mean"] == pytest.approx(v["kl"]["mean"])
    assert main(["convert", str(hf), "--to", "awq", "--out", str(tmp_path / "m.gguf"), "-q"]) == 2
