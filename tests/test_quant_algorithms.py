"""RTN, GPTQ, AWQ search, NF4/FP4 and FP8 against the reference tools' own outputs.

The golden file tests/fixtures/quant/golden.safetensors was produced by running AutoAWQ 0.2.9,
AutoGPTQ's GPTQ / Quantizer and bitsandbytes 0.50.2 (CPU) on fixed weights and inputs; see
tests/fixtures/quant/make_quant_golden.py. FP8 is checked against torch's own float8 cast and
compressed-tensors' formula (scale = amax / 448, clamp, cast), transcribed below.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quanta.quant import chunks
from quanta.quant.awq_search import clip_weight, search_clip, search_scale
from quanta.quant.codebook_quant import dynamic_map, quantize_4bit
from quanta.quant.errors import ConfigError
from quanta.quant.fp8_quant import AmaxObserver, fp8_weight
from quanta.quant.gptq import Hessian, gptq_quantize
from quanta.quant.rtn import rtn_affine

GOLDEN = Path(__file__).parent / "fixtures" / "quant" / "golden.safetensors"


@pytest.fixture(scope="module")
def golden():
    return load_file(GOLDEN)


@pytest.fixture(params=[None, 50], ids=["one-pass", "row-blocks"])
def row_blocks(request, monkeypatch):
    """RTN, NF4/FP4 and FP8 run a block of rows at a time (quant.chunks): also in blocks of a row or two."""
    if request.param:
        monkeypatch.setattr(chunks, "CHUNK", request.param)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (3, 64, False), (4, 32, True), (8, -1, False)])
@pytest.mark.usefixtures("row_blocks")
def test_rtn_awq_convention_matches_autoawq(golden, bits, group, sym):
    key = f"awq_rtn.b{bits}g{group}{'sym' if sym else 'asym'}"
    a = rtn_affine(golden["input.w"], bits, group, symmetric=sym, convention="awq")
    torch.testing.assert_close(a.dequantize(), golden[key + ".w"], rtol=0, atol=0)
    torch.testing.assert_close(a.scales, golden[key + ".scales"], rtol=0, atol=0)
    if not sym:
        assert torch.equal(a.zeros.float(), golden[key + ".zeros"])
    assert int(a.codes.max()) <= 2 ** bits - 1


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (3, 64, False), (8, -1, False), (2, 32, True)])
@pytest.mark.usefixtures("row_blocks")
def test_rtn_gptq_convention_matches_autogptq_quantizer(golden, bits, group, sym):
    a = rtn_affine(golden["input.w"], bits, group, symmetric=sym, convention="gptq")
    want = golden[f"gptq_rtn.b{bits}g{group}{'sym' if sym else 'asym'}.w"]
    torch.testing.assert_close(a.dequantize(), want, rtol=0, atol=0)
    assert a.symmetric == sym and a.group_size == (group if group > 0 else 256)


def test_rtn_rejects_bad_schemes_naming_the_weight():
    w = torch.randn(8, 96)
    with pytest.raises(ConfigError, match=r"layers\.0\.q.*96.*64"):
        rtn_affine(w, 4, 64, name="layers.0.q")
    with pytest.raises(ConfigError, match="bits"):
        rtn_affine(w, 9, 32)


def test_gptq_hessian_matches_autogptq(golden):
    h = Hessian(256)
    x = golden["input.x"]
    for b in range(0, x.shape[0], 2):
        h.add_batch(x[b:b + 2])
    assert h.nsamples == x.shape[0]
    torch.testing.assert_close(h.H, golden["gptq.H"], rtol=1e-5, atol=1e-5)


GPTQ_CASES = {"b4g32sym": (4, 32, True, False, False), "b4g32asym_act": (4, 32, False, True, False),
              "b3pc_asym_act": (3, -1, False, True, False), "b4g64sym_act_static": (4, 64, True, True, True),
              "b4g32asym_static": (4, 32, False, False, True)}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_matches_autogptq_fasterquant(golden, case):
    bits, group, sym, act, static = GPTQ_CASES[case]
    h = Hessian(256)
    x = golden["input.x"]
    for b in range(0, x.shape[0], 2):
        h.add_batch(x[b:b + 2])
    a, loss = gptq_quantize(golden["input.w"], h, bits, group, sym, act_order=act, static_groups=static)
    want = golden[f"gptq.{case}.w"]
    got = a.dequantize()
    # same algorithm, same float32 ops: any code that differs is one step off from a rounding tie
    mismatch = (got - want).abs() > 1e-5
    assert mismatch.float().mean() < 0.002, f"{int(mismatch.sum())} of {want.numel()} weights differ"
    if not mismatch.any():
        torch.testing.assert_close(a.scales, golden[f"gptq.{case}.scale"], rtol=1e-6, atol=0)
    ref_gidx = golden[f"gptq.{case}.g_idx"].long()
    assert torch.equal(a.group_index(), ref_gidx)
    assert (a.g_idx is not None) == (act and not static and group > 0)
    assert loss > 0


def test_gptq_act_order_gidx_is_a_valid_grouping(golden):
    h = Hessian(256)
    h.add_batch(golden["input.x"])
    a, _ = gptq_quantize(golden["input.w"], h, 4, 32, False, act_order=True)
    counts = torch.bincount(a.g_idx.long(), minlength=8)
    assert torch.equal(counts, torch.full((8,), 32))                  # every group holds 32 columns
    perm = torch.argsort(torch.diag(h.H), descending=True)
    assert torch.equal(a.g_idx[perm].long(), torch.arange(256) // 32)  # consecutive in act order


def test_gptq_beats_rtn_on_correlated_inputs(golden):
    x, w = golden["input.x"].reshape(-1, 256), golden["input.w"]
    h = Hessian(256)
    h.add_batch(golden["input.x"])
    ref = x @ w.T
    for bits, group in ((4, 32), (3, 64)):
        err_rtn = (x @ rtn_affine(w, bits, group, symmetric=True).dequantize().T - ref).norm()
        err_gptq = (x @ gptq_quantize(w, h, bits, group, True)[0].dequantize().T - ref).norm()
        assert err_gptq < 0.8 * err_rtn, (bits, group, float(err_gptq), float(err_rtn))


def test_gptq_rejects_bad_damp_and_hessian_size():
    h = Hessian(32)
    h.add_batch(torch.randn(10, 32))
    with pytest.raises(ConfigError, match="damp"):
        gptq_quantize(torch.randn(8, 32), h, group_size=32, damp=0)
    with pytest.raises(ConfigError, match="in_features 64"):
        gptq_quantize(torch.randn(8, 64), h, group_size=32)


class _Mlp(torch.nn.Module):
    def __init__(self, gate, up):
        super().__init__()
        self.gate = torch.nn.Linear(256, 64, bias=False)
        self.up = torch.nn.Linear(256, 64, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(gate)
            self.up.weight.copy_(up)

    def forward(self, x):
        return torch.nn.functional.silu(self.gate(x)) * self.up(x)


def test_awq_scale_search_matches_autoawq(golden):
    mlp = _Mlp(golden["input.w"], golden["input.w_up"])
    s = search_scale(golden["input.x"], [mlp.gate, mlp.up], mlp, bits=4, group_size=32)
    torch.testing.assert_close(s, golden["awq_scale.b4g32"], rtol=1e-5, atol=0)
    assert torch.equal(mlp.gate.weight, golden["input.w"])           # weights restored after the search


def test_awq_clip_search_matches_autoawq(golden):
    max_val = search_clip(golden["input.w"], golden["input.x"], bits=4, group_size=32)
    torch.testing.assert_close(max_val, golden["awq_clip.b4g32"], rtol=0, atol=0)
    clipped = clip_weight(golden["input.w"], max_val)
    assert torch.equal(clipped.abs().reshape(64, 8, 32).amax(dim=-1), torch.minimum(
        golden["input.w"].abs().reshape(64, 8, 32).amax(dim=-1), max_val))
    assert (max_val < golden["input.w"].abs().reshape(64, 8, 32).amax(dim=-1)).any()   # some groups clipped


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel]


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("case", ["b64", "b64dq", "b128dqodd", "b128odd"])
@pytest.mark.usefixtures("row_blocks")
def test_4bit_matches_bitsandbytes(golden, qt, case):
    w = golden["input.w"] if "odd" not in case else golden["input.w"][:, :100].contiguous()
    bs = int(case[1:].split("d")[0].split("o")[0])
    cb = quantize_4bit(w, qt, blocksize=bs, double_quant="dq" in case)
    key = f"bnb.{qt}.{case}"
    assert torch.equal(cb.codes.reshape(-1), _unpack(golden[key + ".packed"], w.numel()))
    assert torch.equal(cb.absmax, golden[key + ".absmax"])
    if "dq" in case:
        assert torch.equal(cb.nested_absmax, golden[key + ".nested_absmax"])
        assert torch.equal(cb.nested_table, golden[key + ".nested_code"])
        assert cb.nested_offset == float(golden[key + ".offset"])
    torch.testing.assert_close(cb.dequantize(), golden[key + ".dequant"], rtol=0, atol=0)


def test_dynamic_map_is_sorted_256_entries():
    m = dynamic_map()
    assert m.numel() == 256 and torch.all(m[1:] >= m[:-1]) and m[-1] == 1.0 and (m == 0).sum() == 1


def test_4bit_rejects_bad_options():
    with pytest.raises(ConfigError, match="blocksize"):
        quantize_4bit(torch.randn(4, 64), blocksize=48)
    with pytest.raises(ConfigError, match="quant_type"):
        quantize_4bit(torch.randn(4, 64), quant_type="nf3")


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
@pytest.mark.usefixtures("row_blocks")
def test_fp8_weight_matches_compressed_tensors_formula(strategy):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.linspace(0.01, 2, 48).unsqueeze(1)
    f = fp8_weight(w, strategy)
    # compressed-tensors calculate_qparams + _quantize, transcribed: symmetric FLOAT 8-bit range ±448
    amax = w.abs().max() if strategy == "tensor" else w.abs().amax(dim=1)
    scale = torch.clamp(amax / (896 / 2), min=torch.finfo(torch.float32).eps)
    s = scale if strategy == "tensor" else scale.unsqueeze(1)
    want = torch.clamp(w / s, -448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(f.data.view(torch.uint8), want.view(torch.uint8))
    torch.testing.assert_close(f.scale, scale, rtol=0, atol=0)
    assert f.strategy == strategy and f.input_scale is None
    rel = (f.dequantize() - w).norm() / w.norm()
    assert rel < 0.04


def test_fp8_static_activation_and_kv_scales():
    obs = AmaxObserver()
    obs.observe(torch.tensor([[1.0, -3.5], [2.0, 0.5]]))
    obs.observe(torch.tensor([-7.0, 4.0]))
    assert float(obs.scale()) == pytest.approx(7.0 / 448)
    f = fp8_weight(torch.randn(4, 8), "tensor", input_scale=obs.scale())
    assert f.describe().endswith("static-act")
    with pytest.raises(ConfigError, match="strategy"):
        fp8_weight(torch.randn(4, 8), "block")
