"""The format table (quanta/loaders/formats.py): a new checkpoint format is one row plus its reader and writer.

A toy format, defined here and nowhere in quanta, stores each quantized linear as plain tensors (codes,
float16 scales and zero points); added as one FORMATS row, detection, loading, `quanta inspect`, `quanta plan`
and `quanta convert` (to it and from it) all handle it. Nothing else is patched."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quanta
from quanta.loaders import FORMATS, detect, load
from quanta.loaders.checkpoint import Checkpoint, ModelConfig
from quanta.loaders.checkpoint_write import Layout, affine_of, write_checkpoint, zeros_of
from quanta.loaders.formats import ConvertTarget, Format
from quanta.loaders.quantized import build_checkpoint, need, quant_config
from quanta.loaders.safetensors_io import read_config
from quanta.loaders.weight_format import WeightFormat, affine_format
from quanta.quant.errors import UnsupportedError
from quanta.quant.kinds import Affine
from quanta.quant.qtensor import QTensor
from tiny_models import make_tiny_hf

GROUP = 32


# --- the toy format: its writer, reader and what the plan counts -----------------------------------------
class ToyLayout(Layout):
    """Affine int4 with integer zero points -> three plain tensors per linear."""

    fmt = "toy"

    def convert_quantized(self, name: str, qt: QTensor) -> dict[str, torch.Tensor]:
        a = affine_of(name, qt, "toy")
        if a.bits != 4 or a.g_idx is not None or a.num_groups * GROUP != a.shape[1]:
            raise UnsupportedError(f"{name}: toy holds int4 in groups of {GROUP} only, not {a.describe()}")
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.toy_codes": a.codes, f"{prefix}.toy_scales": a.scales.half(),
                f"{prefix}.toy_zeros": zeros_of(a)}

    def quantization_config(self) -> dict:
        return {"quant_method": "toy", "group_size": GROUP}


def write_toy(dst, ckpt: Checkpoint, tensors=None, *, overwrite: bool = False, max_shard_size="5GB") -> Path:
    return write_checkpoint(dst, ckpt, tensors, ToyLayout(ckpt.config), overwrite=overwrite,
                            max_shard_size=max_shard_size)


def load_toy(path, tokenizer=None) -> Checkpoint:
    path = Path(path)
    cfg = read_config(path)

    def read(store, prefix: str, shape: tuple[int, int]) -> Affine | None:
        if f"{prefix}.toy_codes" not in store:
            return None
        return Affine(codes=need(store, f"{prefix}.toy_codes", "toy codes"),
                      scales=need(store, f"{prefix}.toy_scales", "toy scales"), bits=4, group_size=GROUP,
                      zeros=need(store, f"{prefix}.toy_zeros", "toy zero points"))
    return build_checkpoint(path, "toy", read, quant_config(path, cfg), cfg=cfg, tokenizer=tokenizer)


def toy_weights(config: ModelConfig, qc: dict, path: Path) -> WeightFormat:
    return affine_format("toy", 4, qc["group_size"], symmetric=False)


TOY = Format("toy", reader=load_toy, weights=toy_weights, writer=write_toy, layout=ToyLayout,
             quant_methods=("toy",), targets=(ConvertTarget("toy", "int-asym"),))


@pytest.fixture
def toy(monkeypatch):
    """The table with the toy row added, for this test only."""
    monkeypatch.setitem(FORMATS, "toy", TOY)


@pytest.fixture
def toy_model(toy, tmp_path) -> tuple[Path, Path]:
    """(a tiny random HF llama, its conversion to the toy format)."""
    src = make_tiny_hf("llama", tmp_path / "hf")
    out = tmp_path / "toy"
    quanta.convert(src, "toy", out, group_size=GROUP, quiet=True, windows=1, ctx=32)
    return src, out


# --- the tests -------------------------------------------------------------------------------------------
def test_convert_writes_the_toy_format_and_validates_it(toy_model):
    """`convert --to toy`: every linear re-quantized into the toy layout, read back through its row for the
    validation, each weight within half a quantization step of the source."""
    src, out = toy_model
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "toy", "group_size": GROUP}
    stored = load_file(out / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.toy_codes"].dtype == torch.uint8
    report = json.loads((out / "quanta_convert.json").read_text())
    assert report["validation"]["top1_agreement"] > 0.5
    source = load_file(src / "model.safetensors")
    for name, t in load(out).tensors.items():
        if isinstance(t, Affine):
            step = t.scales.float().repeat_interleave(GROUP, dim=1)
            assert ((t.dequantize() - source[name].float()).abs() <= step / 2 + 1e-3).all(), name


def test_detection_and_loading_go_through_the_row(toy_model):
    _, out = toy_model
    assert detect(out) == "toy"
    ckpt = load(out)
    assert ckpt.format == "toy" and isinstance(ckpt.tensors["model.layers.1.self_attn.q_proj.weight"], Affine)


def test_plan_counts_the_toy_weights_as_the_affine_kernels_hold_them(toy_model):
    """The toy row says int4 groups of 32 with zero points: the plan holds exactly what it holds for AWQ g32."""
    _, out = toy_model
    p = quanta.plan(str(out), gpus="t4")
    assert p.quantization == "toy (4-bit, groups of 32, zero points)" and p.fits
    awq = quanta.plan(str(out), gpus="t4", quantization="awq", group_size=GROUP)
    assert p.weights == awq.weights


def test_inspect_reports_and_runs_the_toy_checkpoint(toy_model):
    from quanta.cli.inspect import inspect_checkpoint
    _, out = toy_model
    info = inspect_checkpoint(str(out), device="cpu")
    assert info["format"] == "toy"
    assert any(s.startswith("affine int4") for s in info["schemes"])
    assert info["gemms"] and all(g["kernel"] for g in info["gemms"])


def test_convert_from_the_toy_format_to_hf_is_exact(toy_model, tmp_path):
    """Back to float: each weight is the toy weight dequantized, bit for bit."""
    _, out = toy_model
    back = tmp_path / "back"
    quanta.convert(out, "hf", back, dtype="float32", validate=False, quiet=True)
    toy = load(out).tensors
    stored = load_file(back / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(stored[name], toy[name].dequantize(torch.float32))


def test_the_table_has_no_toy_row_outside_the_fixture():
    assert "toy" not in FORMATS
