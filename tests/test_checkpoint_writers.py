"""Checkpoint writers (quanta/loaders/*_write.py) against the reference tools.

Oracles: (1) tests/fixtures/written/*: checkpoints quanta wrote, read back by AutoAWQ, transformers (+optimum/
gptqmodel, bitsandbytes) and compressed-tensors in make_writer_fixtures.py; today's writer must reproduce
those files byte for byte, and our dequantization must equal the tools'. (2) The loader fixtures the tools
wrote themselves: re-writing what our readers load from them must reproduce the tools' tensors and
quantization_config. (3) transformers' own config and model for the plain hf writer.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quanta.loaders import load
from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders import FORMATS, write
from quanta.loaders.formats import resolve
from quanta.loaders.hf import canonical_shapes
from quanta.quant import chunks
from quanta.quant.errors import ConfigError, ShapeError, UnsupportedError
from quanta.quant.kinds import Affine, Codebook, Fp8
from quanta.quant.qtensor import QTensor

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from written_models import VARIANTS, WRITTEN, affine, codebook, fp8, synthetic_checkpoint  # noqa: E402


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (float8 compared as bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def assert_same_weights(want, got, name: str) -> None:
    """Same plain tensor, or same QTensor kind with every field identical (dtype and bits)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and same_tensor(want, got), name
        return
    assert type(got) is type(want), f"{name}: {type(got).__name__} != {type(want).__name__}"
    assert got.shape == want.shape, name
    for field, t in want.tensors().items():
        assert same_tensor(t, getattr(got, field)), f"{name}.{field}"
    for field in ("bits", "group_size", "zeros", "post_scale", "blocksize", "quant_type", "dtype", "nested_blocksize",
                  "nested_offset", "block_size"):
        if hasattr(want, field) and not isinstance(getattr(want, field), torch.Tensor):
            assert getattr(got, field) == getattr(want, field), f"{name}.{field}"
    assert torch.equal(got.dequantize(), want.dequantize()), name


# --- (1) files quanta wrote, as the reference tools read them -----------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_written_fixture_is_reproduced_and_tool_agrees(variant: str, tmp_path: Path):
    """Rewriting the synthetic checkpoint gives the committed files byte for byte, and our dequantization of
    them equals what the reference tool dequantized from those same files."""
    committed = WRITTEN / variant
    fmt, options, _ = VARIANTS[variant]
    out = write(tmp_path / variant, synthetic_checkpoint(variant), fmt, **options)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (committed / name).read_bytes(), f"{variant}/{name} changed"
    ck = load(committed)
    ref_file = committed / ("tool_dequant.safetensors" if fmt != "hf" else "model.safetensors")
    reference = {k: v for k, v in load_file(ref_file).items() if k.endswith("_proj.weight")}
    assert len(reference) == 7 * ck.config.num_hidden_layers
    source = synthetic_checkpoint(variant).tensors
    for name, ref in reference.items():
        got = ck.tensors[name]
        ours = got.dequantize(ref.dtype) if isinstance(got, QTensor) else got
        assert torch.equal(ours, ref), f"{variant}: {name} differs from the tool's dequantization"
        assert torch.equal(source[name].dequantize(ref.dtype), ref), name
    made = json.loads((committed / "fixture.json").read_text())
    assert made["versions"]["transformers"] and made["reference"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_on_written_fixture_matches_tool_logits(variant: str):
    """quanta's engine on the written checkpoint gives the logits the tool's own model gave (the tool ran in
    fp16 / bf16, the engine here in fp32: close, not equal). compressed-tensors' FP8 schemes also fake-quantize
    the activations to FP8 in the tool's forward (W8A8), which the engine's dequantized CPU path does not."""
    from quanta.engine.llm import LLM

    ref = load_file(WRITTEN / variant / "tool_logits.safetensors")
    llm = LLM(model=str(WRITTEN / variant), dtype=torch.float32, device="cpu", kernel="dequantized")
    logits = llm.prompt_logits(ref["tokens"].tolist()).float()
    expected = ref["logits"][0]
    tolerance = 0.08 if variant.startswith("ct_fp8") else 0.02
    assert (logits - expected).abs().max() <= tolerance * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


# --- (2) re-writing what the tools wrote ---------------------------------------------------------------------
REWRITABLE = {"awq": ["gemm_g32", "gemm_g64_tied", "gemm_gm1", "gemm_skip_oldcfg"],
              "gptq": ["b2_g32_asym_v2", "b3_g32_asym", "b4_g32_asym_descact", "b4_g32_qwen2_bias_sharded_tied",
                       "b4_g32_sym_autogptq", "b8_gm1_sym_optimum"],
              "bnb": ["nf4", "nf4_dq_bf16", "fp4", "fp4_dq", "int8"],
              "ct": ["w4a16_g32_pack", "w4a16_g32_asym_pack", "w8a16_channel_pack", "gptq_w4_g32_actorder"],
              "fp8": ["ct_tensor_static_kv", "ct_channel_dynamic"]}
FORMAT = {"awq": "awq", "gptq": "gptq", "bnb": "bnb", "ct": "compressed-tensors", "fp8": "compressed-tensors"}


def stored(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("model*.safetensors")):
        out |= load_file(f)
    return out


@pytest.mark.parametrize("fixture", [f"{fam}/{v}" for fam, vs in REWRITABLE.items() for v in vs])
def test_rewriting_tool_checkpoint_reproduces_it(fixture: str, tmp_path: Path):
    """Load a checkpoint the tool wrote, write it again: every stored tensor is the tool's, byte for byte,
    and the quantization_config carries the tool's values."""
    src = FIXTURES / fixture
    ck = load(src, tokenizer=False)          # tokenizer files: test_hf_writer_matches_transformers
    fmt = FORMAT[fixture.split("/")[0]]
    opts = {"checkpoint_format": ck.quant_config["checkpoint_format"]} if fmt == "gptq" else {}
    out = write(tmp_path / "out", ck, fmt, **opts)
    want, got = stored(src), stored(out)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same_tensor(want[k], got[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"
    cfg = json.loads((src / "config.json").read_text())
    if "quantization_config" in cfg:
        tool, ours = cfg["quantization_config"], json.loads((out / "config.json").read_text())["quantization_config"]
        for qc in (tool, ours):        # GPTQ act-order "weight" leaves no trace in the tensors (nor our reader)
            for group in qc.get("config_groups", {}).values():
                group["weights"].pop("actorder")
        shared = sorted(set(tool) & set(ours) - {"meta"})     # meta: who quantized it
        assert "quant_method" in shared and len(shared) >= 5
        assert {k: ours[k] for k in shared} == {k: tool[k] for k in shared}
    back = load(out, tokenizer=False)
    for name in ck.tensors:
        assert_same_weights(ck.tensors[name], back.tensors[name], name)


# Unpacking and packing go a block of rows at a time (quant.chunks): with blocks of a few rows, every weight
# takes many passes (3-bit words straddling, AWQ's column order, GPTQ's packing along dim 0), and the tools'
# bytes still come out.
@pytest.mark.parametrize("fixture", ["awq/gemm_g32", "gptq/b3_g32_asym", "gptq/b2_g32_asym_v2",
                                     "gptq/b8_gm1_sym_optimum", "ct/w4a16_g32_asym_pack", "ct/w8a16_channel_pack"])
def test_rewriting_in_small_row_blocks_reproduces_it(fixture: str, tmp_path: Path, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK", 100)
    test_rewriting_tool_checkpoint_reproduces_it(fixture, tmp_path)


# --- round trips at odd-but-legal shapes ----------------------------------------------------------------------
def odd_checkpoint(make, arch="qwen2", tie=False, plain=(), dtype=torch.float16, seed=0) -> Checkpoint:
    """A qwen2 (q/k/v bias) model with K = 96 and 160, N = 96, 32, 160; linears from `make(gen, n, k, name)`."""
    config = ModelConfig(model_type=arch, vocab_size=100, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, tie_word_embeddings=tie, bos_token_id=1,
                         eos_token_id=[2, 3], torch_dtype=dtype, attention_bias=arch == "qwen2")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in canonical_shapes(config).items():
        if name.endswith("_proj.weight") and not any(p in name for p in plain):
            tensors[name] = make(gen, *shape, name)
        else:
            tensors[name] = torch.randn(shape, generator=gen).to(dtype)
    return Checkpoint(path=Path("odd"), format="synthetic", config=config, tensors=tensors)


ROUND_TRIPS = {
    "awq_g32_with_plain_layer": ("awq", {}, lambda g, n, k, name: affine(g, n, k), ("layers.1.mlp.down_proj",)),
    "gptq_b3_g32_v1": ("gptq", {}, lambda g, n, k, name: affine(g, n, k, bits=3, min_zero=1), ()),
    "gptq_b2_g32_v2_zero0": ("gptq", {"checkpoint_format": "gptq_v2"}, lambda g, n, k, name: affine(g, n, k, bits=2), ()),
    "gptq_b4_actorder_sym": ("gptq", {}, lambda g, n, k, name: affine(g, n, k, sym=True, act_order=True),
                             ("self_attn.o_proj",)),
    "gptq_b8_per_channel": ("gptq", {}, lambda g, n, k, name: affine(g, n, k, bits=8, group=k, min_zero=1), ()),
    "ct_int4_g16_asym": ("compressed-tensors", {}, lambda g, n, k, name: affine(g, n, k, group=16), ("mlp.up_proj",)),
    "ct_mixed_int8_fp8": ("compressed-tensors", {}, lambda g, n, k, name: fp8(g, n, k, channel=True, static=True)
                          if "mlp" in name else affine(g, n, k, bits=8, group=k, sym=True), ()),
    "ct_fp8_block": ("compressed-tensors", {}, lambda g, n, k, name: Fp8(
        data=torch.randn(n, k, generator=g).to(torch.float8_e4m3fn), scale=torch.rand(-(-n // 64), -(-k // 64),
                                                                                         generator=g),
        block_size=(64, 64), shape=(n, k)), ()),
    "bnb_nf4_b64": ("bnb", {}, lambda g, n, k, name: codebook(g, n, k, "nf4"), ("self_attn.q_proj",)),
    "bnb_fp4_dq_fp32": ("bnb", {}, lambda g, n, k, name: codebook(g, n, k, "fp4", double_quant=True,
                                                                   dtype=torch.float32, blocksize=128), ()),
    "bnb_int8": ("bnb", {}, lambda g, n, k, name: Affine(
        codes=torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8), scales=torch.rand(n, 1, generator=g),
        bits=8, group_size=k, zeros=128, post_scale=7.874015718698502e-3), ()),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_round_trip_is_bit_identical(case: str, tmp_path: Path):
    """canonical tensors -> writer -> our reader -> the same canonical tensors, field for field."""
    fmt, options, make, plain = ROUND_TRIPS[case]
    ck = odd_checkpoint(make, plain=plain)
    out = write(tmp_path / case, ck, fmt, max_shard_size=60_000, **options)
    assert (out / "model.safetensors.index.json").is_file()          # several shards
    back = load(out)
    assert back.format == fmt
    assert back.config.eos_token_ids == [2, 3] and back.config.attention_bias
    for name, want in ck.tensors.items():
        assert_same_weights(want, back.tensors[name], name)


def test_kv_cache_scales_round_trip(tmp_path: Path):
    ck = synthetic_checkpoint("ct_fp8_static_kv")
    back = load(write(tmp_path / "o", ck, "compressed-tensors"))
    assert sorted(back.kv_cache_scales) == sorted(ck.kv_cache_scales)
    for name, t in ck.kv_cache_scales.items():
        assert same_tensor(back.kv_cache_scales[name], t)


# --- the plain hf writer against transformers ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama3_rope", "mistral", "qwen3"])
def test_hf_writer_matches_transformers(arch: str, tmp_path: Path):
    """load -> write_hf: transformers builds the same config and the same logits; tokenizer files come along."""
    from tiny_models import build_tiny_hf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, model = build_tiny_hf(arch, tmp_path / "src", dtype=torch.float32, tie=arch == "qwen3")
    ck = load(src)
    out = write(tmp_path / "out", ck, "hf", max_shard_size="100KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    want, got = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    for key in ("rope_parameters", "sliding_window", "layer_types", "head_dim", "tie_word_embeddings",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "vocab_size"):
        if getattr(want, key, None) is not None:
            assert getattr(got, key) == getattr(want, key), key
    tokens = torch.tensor([[1, 5, 9, 200, 17, 3]])
    with torch.no_grad():
        expected = model(tokens).logits
        written = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits
    assert torch.equal(written, expected)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == ck.chat_template and tok("hello world").input_ids == ck.tokenizer("hello world").input_ids
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_hf_writer_dequantizes_to_dtype(tmp_path: Path):
    ck = synthetic_checkpoint("awq_g32")
    back = load(write(tmp_path / "o", ck, "hf", dtype="bfloat16"))
    assert back.config.torch_dtype == torch.bfloat16
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(back.tensors[name], ck.tensors[name].dequantize(torch.bfloat16))


# --- bad input -------------------------------------------------------------------------------------------------
def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_existing_destination_needs_overwrite(tmp_path: Path):
    ck = synthetic_checkpoint("awq_g32")
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists.*overwrite=True"):
        write(dst, ck, "awq")
    assert (dst / "keep.txt").read_text() == "mine"
    write(dst, ck, "awq", overwrite=True)
    assert not (dst / "keep.txt").exists() and load(dst).format == "awq"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_mid_stream_leaves_nothing(error: BaseException, tmp_path: Path):
    ck = synthetic_checkpoint("gptq_b8_g32_sym")

    def stream():
        for i, item in enumerate(ck.tensors.items()):
            if i == len(ck.tensors) // 2:
                raise error
            yield item
    with pytest.raises(type(error)):
        write(tmp_path / "out", ck, "gptq", stream(), max_shard_size=10_000)
    assert list(tmp_path.iterdir()) == []


def zero_at_origin(a: Affine) -> Affine:
    a.zeros[0, 0] = 0
    return a


def with_weight(ck: Checkpoint, name: str, weight) -> Checkpoint:
    ck.tensors = {**ck.tensors, name: weight}
    return ck


UNREPRESENTABLE = [
    ("awq", {}, lambda g: affine(g, 64, 64, bits=3), "3-bit codes.*only 4-bit"),
    ("awq", {}, lambda g: affine(g, 64, 64, act_order=True), "g_idx"),
    ("awq", {}, lambda g: Affine(codes=torch.zeros(64, 64, dtype=torch.uint8), scales=torch.ones(64, 2).half(),
                                 bits=4, group_size=32, mins=torch.zeros(64, 2).half()), "float mins"),
    ("awq", {}, lambda g: affine(g, 64, 64, group=16), "group_size 32 but .* has 16"),
    ("awq", {}, lambda g: Affine(codes=torch.zeros(64, 64, dtype=torch.uint8), scales=torch.full((64, 2), 0.1),
                                 bits=4, group_size=32, zeros=8), "not exactly representable in float16"),
    ("gptq", {}, lambda g: zero_at_origin(affine(g, 64, 64, bits=8)), "zero point of 0.*gptq_v2"),
    ("gptq", {}, lambda g: affine(g, 64, 64, bits=5, min_zero=1), "not 5-bit"),
    ("compressed-tensors", {}, lambda g: affine(g, 64, 64, act_order=True), "actorder"),
    ("compressed-tensors", {}, lambda g: Fp8(data=torch.zeros(64, 64, dtype=torch.float8_e5m2),
                                             scale=torch.tensor(1.0)), "e4m3 only"),
    ("bnb", {}, lambda g: Codebook(codes=torch.zeros(64, 64, dtype=torch.uint8), table=torch.linspace(-1, 1, 16),
                                   blocksize=64, absmax=torch.ones(64), quant_type="custom"), "custom table"),
    ("bnb", {}, lambda g: affine(g, 64, 64), "NF4/FP4 codebooks or LLM.int8"),
    ("hf", {}, lambda g: torch.zeros(64, 64, dtype=torch.int8), "float tensors"),
]


@pytest.mark.parametrize("fmt, options, make, message", UNREPRESENTABLE,
                         ids=[f"{u[0]}-{u[3][:20]}" for u in UNREPRESENTABLE])
def test_unrepresentable_weight_fails_before_anything_appears(fmt, options, make, message, tmp_path: Path):
    """The error names the tensor and the reason, and nothing is left at or beside the destination."""
    base = {"awq": "awq_g32", "gptq": "gptq_b8_g32_sym", "compressed-tensors": "ct_w4_g32_asym",
            "bnb": "bnb_nf4_dq", "hf": "hf_from_awq"}[fmt]
    name = "model.layers.1.self_attn.q_proj.weight"           # late in the stream: shards may exist by then
    ck = with_weight(synthetic_checkpoint(base), name, make(torch.Generator().manual_seed(0)))
    with pytest.raises((UnsupportedError, ConfigError), match=message) as info:
        write(tmp_path / "out", ck, fmt, max_shard_size=10_000, **options)
    assert "q_proj" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_stream_errors(tmp_path: Path):
    ck = synthetic_checkpoint("awq_g32")
    items = list(ck.tensors.items())
    with pytest.raises(ShapeError, match="q_proj.*shape"):
        write(tmp_path / "a", ck, "awq", [(items[1][0], torch.zeros(3, 3))])
    with pytest.raises(UnsupportedError, match="rotary"):
        write(tmp_path / "b", ck, "awq", [("model.rotary.weight", torch.zeros(3))])
    with pytest.raises(ConfigError, match="ended without"):
        write(tmp_path / "c", ck, "awq", items[:-1])
    with pytest.raises(ConfigError, match="twice"):
        write(tmp_path / "d", ck, "awq", items + items[:1])
    with pytest.raises(UnsupportedError, match="no checkpoint writer for format 'fp8'.*compressed-tensors"):
        write(tmp_path / "e", ck, "fp8")
    with pytest.raises(ConfigError, match="max_shard_size"):
        write(tmp_path / "f", ck, "awq", max_shard_size="lots")
    assert list(tmp_path.iterdir()) == []


def test_every_format_row_names_functions_that_exist():
    """Each row's reader, writer, layout and hooks import: a misspelt "module:function" fails here, not in use."""
    for fmt, row in FORMATS.items():
        for ref in (row.reader, row.weights, row.writer, row.layout, row.writer_options, row.check):
            if ref is not None:
                assert callable(resolve(ref)), (fmt, ref)
