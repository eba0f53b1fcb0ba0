"""quanta convert --merge-lora: every targeted weight becomes W + scaling * B @ A. Oracle: peft's
merge_and_unload() of the same adapter on the same transformers model; the gguf package's reader for GGUF
output. Merged weights are reported "merged", never lossless."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import quanta
from quanta.loaders import load
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.qtensor import QTensor
from test_lora_adapter import peft_adapter, tiny_llama, write_gguf_lora


def base_and_adapter(tmp_path, **lora):
    """A tiny llama saved in tmp/base, a random peft adapter of it in tmp/lora: (base dir, adapter dir, peft's
    merged state dict, the base state dict)."""
    model = tiny_llama()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(str(tmp_path / "base"))
    pm = peft_adapter(model, tmp_path / "lora", **lora)
    merged = {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}
    return tmp_path / "base", tmp_path / "lora", merged, base


def conv(src, to, out, **kw):
    return quanta.convert(src, to, out, quiet=True, validate=False, **kw)


def test_merge_to_hf_float32_equals_peft_merge_and_unload(tmp_path):
    base, lora, merged, original = base_and_adapter(tmp_path, rank_pattern={"o_proj": 4}, alpha_pattern={"up_proj": 7})
    report = conv(base, "hf", tmp_path / "out", merge_lora=lora, dtype="float32")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(out) == set(merged)
    for name, w in merged.items():
        assert torch.allclose(out[name], w, rtol=1e-6, atol=1e-7), name
        targeted = name.endswith("_proj.weight")
        assert torch.equal(out[name], original[name]) != targeted, name       # the merged ones changed, only they
    rows = {r.name: r for r in report.tensors}
    assert {n for n, r in rows.items() if r.action == "merged"} == {n for n in merged if n.endswith("_proj.weight")}
    assert all(not r.lossless and r.error == 0.0 and r.method == "lora merge" for r in rows.values()
               if r.action == "merged")
    assert not report.lossless and "(lossless)" not in report.summary()
    assert report.merged_lora["rank"] == 8 and report.merged_lora["modules"] == 14
    stored = json.loads((tmp_path / "out" / "quanta_convert.json").read_text())
    assert stored["lossless"] is False and stored["counts"]["merged"] == 14 and stored["merged_lora"]["modules"] == 14


def test_merge_into_q8_0_gguf_holds_the_merged_weights(tmp_path):
    import gguf
    base, lora, merged, original = base_and_adapter(tmp_path)
    report = conv(base, "gguf:Q8_0", tmp_path / "m.gguf", merge_lora=lora)
    assert {r.action for r in report.tensors if r.name.endswith("_proj.weight")} == {"merged"}
    assert all(r.method == "lora merge, then gguf q8_0" and 0 < r.error < 0.01 for r in report.tensors
               if r.action == "merged")
    ckpt = load(tmp_path / "m.gguf")                              # quanta reads it back (q / k un-permuted)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.1.mlp.down_proj.weight"):
        t = ckpt.tensors[name]
        assert isinstance(t, QTensor) and t.kind == "gguf"
        w = t.dequantize(torch.float32)
        err, moved = (w - merged[name]).norm() / merged[name].norm(), (merged[name] - original[name]).norm()
        assert err < 0.01 and (w - original[name]).norm() > 0.5 * moved, name
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))             # and the gguf package reads the file
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    values = gguf.quants.dequantize(down.data, down.tensor_type)
    assert torch.allclose(torch.from_numpy(values), merged["model.layers.1.mlp.down_proj.weight"], atol=2e-3)


def test_merge_from_a_quantized_source_and_a_gguf_adapter(tmp_path):
    base, lora, merged, original = base_and_adapter(tmp_path)
    conv(base, "gguf:Q8_0", tmp_path / "base.gguf")
    src = load(tmp_path / "base.gguf")
    dequant = {n: t.dequantize(torch.float32) for n, t in src.tensors.items() if isinstance(t, QTensor)}
    from peft import PeftModel
    pm = PeftModel.from_pretrained(tiny_llama(), str(lora))
    adapter = write_gguf_lora(tmp_path / "lora.gguf", pm)
    report = conv(tmp_path / "base.gguf", "hf", tmp_path / "out", merge_lora=adapter, dtype="float32")
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, w in dequant.items():
        if name.endswith("_proj.weight"):                         # the dequantized source plus peft's delta
            assert torch.allclose(out[name], w + (merged[name] - original[name]), atol=1e-5), name
    assert sum(r.action == "merged" and r.source == "gguf q8_0" for r in report.tensors) == 14


def test_merge_to_awq_requantizes_the_merged_weights(tmp_path):
    base, lora, merged, original = base_and_adapter(tmp_path)
    report = conv(base, "awq", tmp_path / "awq", merge_lora=lora, group_size=32)
    assert all(r.method.startswith("lora merge, then rtn int4") for r in report.tensors if r.action == "merged")
    ckpt = load(tmp_path / "awq")
    name = "model.layers.0.mlp.gate_proj.weight"
    w = ckpt.tensors[name].dequantize(torch.float32)
    assert (w - merged[name]).norm() < (w - original[name]).norm()
    assert (w - merged[name]).norm() / merged[name].norm() < 0.2


def test_merge_refusals_leave_no_output(tmp_path):
    base, lora, _, _ = base_and_adapter(tmp_path)
    with pytest.raises(ConfigError, match="no such LoRA adapter"):
        conv(base, "hf", tmp_path / "o1", merge_lora=tmp_path / "missing")
    other = tmp_path / "other"
    peft_adapter(tiny_llama(intermediate_size=96), other)
    with pytest.raises(ShapeError, match="do not fit"):
        conv(base, "hf", tmp_path / "o2", merge_lora=other)
    dora = tmp_path / "dora"
    peft_adapter(tiny_llama(), dora, use_dora=True)
    with pytest.raises(UnsupportedError, match="DoRA"):
        conv(base, "hf", tmp_path / "o3", merge_lora=dora)
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))
    assert not list(tmp_path.glob(".o*"))                      # no staging folder left either


def test_cli_merge_lora(tmp_path, capsys):
    from quanta.cli.main import main
    base, lora, merged, _ = base_and_adapter(tmp_path)
    assert main(["convert", str(base), "--merge-lora", str(lora), "--to", "hf", "--dtype", "float32",
                 "--out", str(tmp_path / "out"), "--no-validate", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "merged 14" in printed and "merged LoRA" in printed and "(lossless)" not in printed
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.weight"
    assert torch.allclose(out[name], merged[name], rtol=1e-6, atol=1e-7)


def test_validation_compares_with_the_unmerged_source_off_the_exact_path(tmp_path, capsys):
    from quanta.cli.main import main
    from tiny_models import build_tiny_hf
    base, model = build_tiny_hf("llama", tmp_path / "base")
    peft_adapter(model, tmp_path / "lora", seed=3)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    assert main(["convert", str(base), "--merge-lora", str(tmp_path / "lora"), "--to", "hf", "--out",
                 str(tmp_path / "out"), "--windows", "2", "--ctx", "64", "--text", str(text), "--device", "cpu",
                 "-q"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validate:")]
    assert len(line) == 1 and line[0].endswith("against the unmerged source)")
    report = json.loads((tmp_path / "out" / "quanta_convert.json").read_text())
    assert report["validation"]["reference"] == "the unmerged source" and report["lossless"] is False
    assert report["validation"]["kl_mean"] > 0                  # the adapter changed the model; not the exact path
