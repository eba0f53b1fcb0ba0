"""AWQ / GPTQ / bitsandbytes / FP8 / compressed-tensors loaders against fixtures made by the tools themselves.

Each tests/fixtures/<family>/<variant>/ was written by the reference tool (see make_fixtures.py and the
fixture's fixture.json) and holds the tool's own dequantization (reference.safetensors) and the fp32
transformers logits of the dequantized model (reference_logits.safetensors). No tool is needed here.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quanta.loaders import detect, load
from quanta.quant.errors import ConfigError, CorruptFileError, QuantaError, ShapeError, UnsupportedError
from quanta.quant.qtensor import QTensor

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_DIRS = sorted(p.parent for p in FIXTURES.glob("*/*/reference.safetensors"))
FAMILY = {"awq": "awq", "gptq": "gptq", "bnb": "bnb", "ct": "compressed-tensors"}
NOT_BIT_EXACT: set[str] = set()      # every fixture is reproduced bit for bit


def fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def family_of(path: Path) -> str:
    fam = path.parent.name
    if fam == "fp8":
        return "compressed-tensors" if path.name.startswith("ct_") else "fp8"
    return FAMILY[fam]


@pytest.fixture(scope="module")
def checkpoints():
    """Loaded checkpoints by fixture id (each loaded once per module)."""
    cache = {}

    def get(path: Path):
        if path not in cache:
            cache[path] = load(path)
        return cache[path]
    return get


def test_every_family_has_fixtures():
    assert {p.parent.name for p in FIXTURE_DIRS} == {"awq", "gptq", "bnb", "ct", "fp8"}
    assert len(FIXTURE_DIRS) >= 25


@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=fixture_id)
def test_dequantize_matches_tool(path: Path, checkpoints):
    """Our QTensor.dequantize() equals the source tool's own dequantization, bit for bit."""
    assert detect(path) == family_of(path)
    ck = checkpoints(path)
    reference = load_file(path / "reference.safetensors")
    assert reference
    for name, ref in reference.items():
        qt = ck.tensors[name]
        assert isinstance(qt, QTensor), name
        got = qt.dequantize(ref.dtype)
        if fixture_id(path) in NOT_BIT_EXACT:
            ulp = torch.finfo(ref.dtype).eps * ref.abs().clamp(min=torch.finfo(ref.dtype).tiny)
            assert ((got - ref).abs() <= ulp).all(), name
        else:
            assert torch.equal(got, ref), f"{fixture_id(path)}: {name} differs from the tool's dequantization"


@pytest.mark.gpu
@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=fixture_id)
def test_read_on_cuda_unpacks_on_the_device_bit_exactly(path: Path, checkpoints):
    """With read_on("cuda") every quantized weight comes out on the GPU (its stored words crossed as stored)
    and equals, tensor for tensor, what the host read gives."""
    host = checkpoints(path)
    staged = load(path)
    staged.read_on("cuda")
    for name, ref in host.tensors.items():
        if not isinstance(ref, QTensor):
            continue
        got = staged.tensors[name]
        fields = got.tensors()
        assert all(t.device.type == "cuda" for t in fields.values()), name
        for field, t in ref.tensors().items():
            assert torch.equal(fields[field].cpu(), t), f"{name}.{field}"


@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=fixture_id)
def test_checkpoint_contents(path: Path, checkpoints):
    """Config matches config.json; every canonical tensor reads; exactly the reference weights are quantized."""
    ck = checkpoints(path)
    cfg = json.loads((path / "config.json").read_text())
    c = ck.config
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.tie_word_embeddings) == (
        cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg.get("tie_word_embeddings", False))
    quantized = {n for n in ck.tensors if isinstance(ck.tensors[n], QTensor)}
    assert quantized == set(load_file(path / "reference.safetensors"))
    assert ck.tokenizer is not None
    assert ("lm_head.weight" in ck.tensors) != c.tie_word_embeddings


def test_variants_are_what_they_claim(checkpoints):
    """Spot checks that the fixtures exercise the variants they are named after."""
    def w(fixture, name="model.layers.0.mlp.up_proj.weight"):
        return checkpoints(FIXTURES / fixture).tensors[name]
    assert w("gptq/b4_g32_asym_descact").g_idx is not None
    assert w("gptq/b3_g32_asym").bits == 3 and w("gptq/b2_g32_asym_v2").bits == 2
    assert w("gptq/b4_g32_sym_autogptq").zeros == 8                  # v1 stored 7s, read as the implicit 8
    assert w("gptq/b8_gm1_sym_optimum").num_groups == 1
    assert w("awq/gemm_gm1").num_groups == 1
    skip = checkpoints(FIXTURES / "awq/gemm_skip_oldcfg").tensors
    assert not isinstance(skip["model.layers.0.mlp.down_proj.weight"], QTensor)
    assert w("bnb/nf4_dq_bf16").double_quant and w("bnb/fp4").quant_type == "fp4"
    assert w("fp8/ct_tensor_static_kv").input_scale is not None and w("fp8/ct_channel_dynamic").input_scale is None
    for fixture in ("fp8/ct_tensor_static_kv", "fp8/modelopt"):
        kv = checkpoints(FIXTURES / fixture).kv_cache_scales
        assert sorted(kv) == [f"model.layers.{i}.self_attn.{x}_scale" for i in (0, 1) for x in "kv"]
        assert kv["model.layers.1.self_attn.v_scale"].numel() == 1
    bias = checkpoints(FIXTURES / "gptq/b4_g32_qwen2_bias_sharded_tied")
    assert bias.tensors["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert len(list((FIXTURES / "gptq/b4_g32_qwen2_bias_sharded_tied").glob("model-*.safetensors"))) == 2


# --- the engine on every fixture -------------------------------------------------------------------------
def _engine_available() -> bool:
    try:
        import quanta.engine.llm  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _engine_available(), reason="quanta.engine.llm not there yet")
@pytest.mark.parametrize("path", FIXTURE_DIRS, ids=fixture_id)
def test_engine_logits_close_to_reference(path: Path):
    """LLM(fixture, float32) logits are close to the fp32 transformers model on the tool's dequantized weights."""
    from quanta.engine.llm import LLM

    ref = load_file(path / "reference_logits.safetensors")
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", kernel="dequantized")
    logits = llm.prompt_logits(ref["tokens"].tolist()).float()
    expected = ref["logits"][0]
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=2e-2, rtol=1e-2)   # engine dequantizes to fp32, tools to fp16/bf16
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75   # random tiny models have near-ties


@pytest.mark.skipif(not _engine_available(), reason="quanta.engine.llm not there yet")
@pytest.mark.parametrize("variant", ["awq/gemm_g32", "gptq/b4_g32_asym_descact", "bnb/nf4", "fp8/modelopt",
                                     "ct/w4a16_g32_pack"])
def test_quanta_generate_cli(variant: str, capsys):
    """`quanta generate --model FIXTURE "hi" --max-tokens 4` runs for one fixture of every family."""
    from quanta.cli.main import main

    rc = main(["-q", "generate", "--model", str(FIXTURES / variant), "--device", "cpu", "--max-tokens", "4", "hi"])
    assert rc in (0, None)
    assert capsys.readouterr().out.strip()


# --- errors ---------------------------------------------------------------------------------------------
def _copy(variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / variant.replace("/", "_")
    shutil.copytree(FIXTURES / variant, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, drop: str | None = None, replace: dict | None = None) -> None:
    state = load_file(path / "model.safetensors")
    if drop:
        del state[drop]
    state.update(replace or {})
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def _read_all(path: Path) -> None:
    ck = load(path)
    for name in ck.tensors:
        ck.tensors[name]


# A checkpoint spoiled in one way -> the typed error and the words naming what is wrong:
# (fixture, quantization_config changes, tensor dropped, tensors replaced, error, message).
CORRUPT = [
    pytest.param("gptq/b4_g32_asym_descact", {"quant_method": "quip"}, None, None, UnsupportedError, "quip",
                 id="unknown-quant-method"),
    pytest.param("gptq/b4_g32_asym_descact", {"bits": 5}, None, None, UnsupportedError, "bits=5", id="gptq-5-bit"),
    pytest.param("gptq/b4_g32_asym_descact", {}, None,
                 {"model.layers.0.self_attn.q_proj.scales": torch.ones(3, 64, dtype=torch.float16)}, ShapeError,
                 r"q_proj\.scales", id="gptq-scales-shape"),
    pytest.param("gptq/b4_g32_asym_descact", {}, "model.layers.1.mlp.up_proj.qzeros", None, CorruptFileError,
                 r"up_proj\.qzeros.*zero points", id="gptq-zeros-missing"),
    pytest.param("awq/gemm_g32", {}, None, {"model.layers.0.mlp.gate_proj.qweight": torch.zeros(64, 8, dtype=torch.int32)},
                 ShapeError, r"gate_proj\.q(weight|zeros)", id="awq-qweight-shape"),
    pytest.param("awq/gemm_g32", {"bits": 8}, None, None, UnsupportedError, "bits=8", id="awq-8-bit"),
    pytest.param("bnb/nf4", {}, "model.layers.0.self_attn.k_proj.weight.absmax", None, CorruptFileError,
                 r"k_proj\.weight\.absmax", id="bnb-absmax-missing"),
    pytest.param("bnb/int8", {}, "model.layers.0.self_attn.o_proj.SCB", None, CorruptFileError, r"o_proj\.SCB",
                 id="bnb-scb-missing"),
    pytest.param("ct/w4a16_g32_asym_pack", {}, "model.layers.0.self_attn.v_proj.weight_zero_point", None,
                 CorruptFileError, r"v_proj\.weight_zero_point", id="ct-zero-point-missing"),
    pytest.param("fp8/fbgemm", {}, "model.layers.1.mlp.down_proj.weight_scale", None, CorruptFileError,
                 r"down_proj\.weight_scale", id="fp8-scale-missing"),
]


@pytest.mark.parametrize("fixture, config, drop, replace, error, words", CORRUPT)
def test_a_spoiled_checkpoint_is_a_typed_error_naming_what_is_wrong(tmp_path, fixture, config, drop, replace,
                                                                     error, words):
    path = _copy(fixture, tmp_path)
    if config:
        _edit_config(path, **config)
    if drop or replace:
        _edit_tensors(path, drop=drop, replace=replace)
    with pytest.raises(error, match=words):
        _read_all(path)


def test_missing_layer_is_named(tmp_path):
    path = _copy("awq/gemm_g32", tmp_path)
    state = load_file(path / "model.safetensors")
    for k in [k for k in state if k.startswith("model.layers.1.self_attn.o_proj.")]:
        del state[k]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptFileError, match=r"layers\.1\.self_attn\.o_proj"):
        load(path)


def test_errors_are_quanta_errors():
    for cls in (ConfigError, CorruptFileError, ShapeError, UnsupportedError):
        assert issubclass(cls, QuantaError)


def test_fp8_kv_cache_takes_the_checkpoint_scales(tmp_path):
    """A compressed-tensors checkpoint calibrated for an FP8 KV cache runs with its own k/v scales."""
    from quanta.engine import LLM, SamplingParams
    path = _copy("fp8/ct_tensor_static_kv", tmp_path)
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    scales = load_checkpoint_kv_scales(path)
    cache = llm.kv_cache
    for layer in range(llm.checkpoint.config.num_hidden_layers):
        assert torch.allclose(cache.k_scale[layer], scales[f"model.layers.{layer}.self_attn.k_scale"].float().expand(
            cache.k_scale.shape[1]))
        assert torch.allclose(cache.v_scale[layer], scales[f"model.layers.{layer}.self_attn.v_scale"].float().expand(
            cache.v_scale.shape[1]))
    assert not cache.needs_calibration
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def load_checkpoint_kv_scales(path: Path) -> dict:
    return load(path).kv_cache_scales
