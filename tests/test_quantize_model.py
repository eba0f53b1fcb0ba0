"""The layer-by-layer quantization driver on a tiny llama, checked with transformers as the oracle.

Each method's streamed tensors are dequantized into transformers' own LlamaForCausalLM; its hidden
states and logits on held-out text are compared with the float model's. The calibrated methods must
beat RTN at the same bits and group size, as they do on real models.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_tiny_hf  # noqa: E402

from quanta.loaders import load  # noqa: E402
from quanta.quant import Affine, Codebook, Fp8, QTensor  # noqa: E402
from quanta.quant.calibration import DEFAULT_TEXT, LayerRunner, load_calibration  # noqa: E402
from quanta.quant.errors import ConfigError  # noqa: E402
from quanta.quant.quantize_model import QuantSpec, quantize_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(not DEFAULT_TEXT.is_file(), reason="calibration text missing")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, model = build_tiny_hf("llama", tmp_path_factory.mktemp("tiny") / "m")
    with torch.no_grad():                 # a few salient channels, as real LLMs' norms have
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] *= 8
    model.save_pretrained(path)
    ckpt = load(path)
    calib = load_calibration(ckpt.tokenizer, n_samples=4, seqlen=64, max_chars=20_000)
    text = DEFAULT_TEXT.read_text()[200_000:203_000]
    held_out = torch.tensor(ckpt.tokenizer(text)["input_ids"][:96]).unsqueeze(0)
    with torch.no_grad():
        ref = model(held_out, output_hidden_states=True)
    return path, model, calib, held_out, ref


def _run(path, spec, calib):
    ckpt = load(path)
    run = quantize_checkpoint(ckpt, spec, calib if spec.needs_calibration else None, quiet=True)
    out = list(run)
    return out, run


def _errors(model, out, held_out, ref):
    """Per-layer hidden-state relative errors and the logits' relative error, via transformers."""
    q = type(model)(model.config).eval()
    state = {n: (t.dequantize() if isinstance(t, QTensor) else t.float()) for n, t in out}
    q.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings or "lm_head.weight" not in state:
        q.tie_weights()
    with torch.no_grad():
        got = q(held_out, output_hidden_states=True)
    hidden = [float((g - r).norm() / r.norm()) for g, r in zip(got.hidden_states[1:-1], ref.hidden_states[1:-1])]
    return hidden, float((got.logits - ref.logits).norm() / ref.logits.norm())


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_layer_runner_matches_transformers(arch, tmp_path):
    """Our layer-at-a-time run (qk-norm, sliding window) equals transformers' whole-model hidden states."""
    path, model = build_tiny_hf(arch, tmp_path / arch)
    ckpt = load(path)
    runner = LayerRunner(ckpt.config)
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(tokens, output_hidden_states=True).hidden_states
        x = model.model.embed_tokens(tokens)
        for i in range(ckpt.config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            layer = runner.build(i, {n[len(prefix):]: ckpt.tensors[n].float()
                                     for n in ckpt.tensors if n.startswith(prefix)})
            x = runner.forward(layer, x)
            if i + 1 < ckpt.config.num_hidden_layers:
                torch.testing.assert_close(x, ref[i + 1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.model.norm(x), ref[-1], rtol=1e-4, atol=1e-5)
    if arch != "qwen3":
        return
    run = quantize_checkpoint(ckpt, QuantSpec("gptq", group_size=32), load_calibration(
        ckpt.tokenizer, n_samples=2, seqlen=32, max_chars=5_000), quiet=True)
    assert sum(isinstance(t, Affine) for _, t in run) == 14


def test_calibrated_methods_beat_rtn(tiny):
    path, model, calib, held_out, ref = tiny
    results = {}
    for spec in (QuantSpec("rtn", bits=4, group_size=32), QuantSpec("awq", bits=4, group_size=32),
                 QuantSpec("gptq", bits=4, group_size=32, symmetric=False, act_order=True)):
        out, run = _run(path, spec, calib)
        names = [n for n, _ in out]
        assert names == sorted(set(names), key=names.index) and names[0] == "model.embed_tokens.weight"
        assert set(names) == set(load(path).tensors)
        quantized = {n: t for n, t in out if isinstance(t, QTensor)}
        assert len(quantized) == 7 * 2 and all(isinstance(t, Affine) and t.bits == 4 for t in quantized.values())
        assert not isinstance(dict(out)["lm_head.weight"], QTensor)
        results[spec.method] = _errors(model, out, held_out, ref)
        rows = {r.name: r for r in run.report}
        assert rows["model.layers.0.mlp.down_proj.weight"].weight_error < 0.5
        if spec.needs_calibration:
            assert 0 < rows["model.layers.1"].output_error < 1
    rtn_hidden, rtn_logits = results["rtn"]
    for method in ("awq", "gptq"):
        hidden, logits = results[method]
        assert logits < 0.9 * rtn_logits, (method, logits, rtn_logits)
        assert hidden[-1] < 0.95 * rtn_hidden[-1], (method, hidden, rtn_hidden)


@pytest.mark.parametrize("spec,kind,bound", [(QuantSpec("nf4", double_quant=True), Codebook, 0.4),
                                             (QuantSpec("fp8", fp8_strategy="tensor"), Fp8, 0.1),
                                             (QuantSpec("rtn", bits=8, group_size=-1, symmetric=True), Affine, 0.05)])
def test_weight_only_methods_stream_without_calibration(tiny, spec, kind, bound, monkeypatch):
    path, model, calib, held_out, ref = tiny
    monkeypatch.setattr(LayerRunner, "__init__", lambda *a, **k: pytest.fail("weight-only ran the model"))
    out, run = _run(path, spec, None)
    assert sum(isinstance(t, kind) for _, t in out) == 14
    _, logits = _errors(model, out, held_out, ref)
    assert logits < bound
    assert all(r.output_error is None for r in run.report)


def test_fp8_static_and_kv_scales(tiny):
    path, model, calib, held_out, ref = tiny
    out, run = _run(path, QuantSpec("fp8", fp8_activation="static", kv_cache_scales=True), calib)
    fp8 = {n: t for n, t in out if isinstance(t, Fp8)}
    assert all(t.input_scale is not None for t in fp8.values())
    q, k = (fp8[f"model.layers.0.self_attn.{p}_proj.weight"].input_scale for p in "qk")
    assert torch.equal(q, k)                          # same input, same observer
    # the input scale of q/k/v is amax(input_layernorm(embeddings of the calibration tokens)) / 448
    emb = model.model.embed_tokens(calib.tokens).detach()
    x0 = model.model.layers[0].input_layernorm(emb).detach()
    assert float(q) == pytest.approx(float(x0.abs().max()) / 448, rel=1e-5)
    assert set(run.kv_cache_scales) == {f"model.layers.{i}.self_attn.{p}_scale" for i in range(2) for p in "kv"}
    v = model.model.layers[0].self_attn.v_proj(x0).detach()
    assert float(run.kv_cache_scales["model.layers.0.self_attn.v_scale"]) == pytest.approx(
        float(v.abs().max()) / 448, rel=1e-5)


def test_bad_schemes_fail_before_any_work(tiny, monkeypatch):
    path, model, calib, held_out, ref = tiny
    ckpt = load(path)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: in_features 64.*48"):
        quantize_checkpoint(ckpt, QuantSpec("rtn", group_size=48))
    with pytest.raises(ConfigError, match="needs calibration"):
        quantize_checkpoint(ckpt, QuantSpec("gptq"))
    with pytest.raises(ConfigError, match="act_order"):
        QuantSpec("awq", act_order=True)
    with pytest.raises(ConfigError, match="bits"):
        QuantSpec("gptq", bits=1)
    with pytest.raises(ConfigError, match="method"):
        QuantSpec("hqq")
    with pytest.raises(ConfigError, match="blocksize"):
        QuantSpec("nf4", blocksize=100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_method_on_the_gpu_gives_the_cpu_runs_quality(tiny):
    """The run on the GPU (a layer and the calibration activations there) streams the same tensors, every one back
    on the CPU, as close to the float model on held-out text; the methods without a search within float rounding of
    the CPU run's weights (AWQ's and GPTQ's searches may take other steps on other rounding)."""
    path, model, calib, held_out, ref = tiny
    for spec in (QuantSpec("awq", bits=4, group_size=32), QuantSpec("rtn", bits=4, group_size=32),
                 QuantSpec("gptq", bits=4, group_size=32, symmetric=False, act_order=True),
                 QuantSpec("fp8", fp8_activation="static", kv_cache_scales=True), QuantSpec("nf4")):
        data = calib if spec.needs_calibration else None
        cpu = list(quantize_checkpoint(load(path), spec, data, quiet=True, device="cpu"))
        run = quantize_checkpoint(load(path), spec, data, quiet=True, device="cuda")
        gpu = list(run)
        assert [n for n, _ in gpu] == [n for n, _ in cpu], spec.method
        for (name, a), (_, b) in zip(cpu, gpu):
            assert type(a) is type(b) and b.device.type == "cpu", (spec.method, name, b.device)
            fa, fb = (t.dequantize() if isinstance(t, QTensor) else t.float() for t in (a, b))
            assert spec.needs_calibration or (fa - fb).norm() <= 1e-3 * fa.norm(), (spec.method, name)
        cpu_logits, gpu_logits = _errors(model, cpu, held_out, ref)[1], _errors(model, gpu, held_out, ref)[1]
        assert gpu_logits <= 1.25 * cpu_logits + 1e-3, (spec.method, gpu_logits, cpu_logits)
        assert all(s.device.type == "cpu" for s in run.kv_cache_scales.values())
