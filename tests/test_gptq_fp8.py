"""GPTQ onto the FP8 e4m3 grid (quant/gptq.py `gptq_fp8`, `quanta quantize --method gptq --scheme fp8`).

Oracles: llm-compressor 0.14.0.1's own GPTQ (`quantize_weight` with its FP8 weight observer) on the
fixed inputs of tests/fixtures/quant/golden.safetensors, stored by make_gptq_fp8_golden.py beside it;
plain round-to-nearest FP8 (`fp8_weight`, itself checked against compressed-tensors' formula in
test_quant_algorithms.py), which GPTQ must reproduce bit for bit when the Hessian has no off-diagonal
terms; the output written by `--method fp8`, whose layout GPTQ-FP8 must share; transformers' logits.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_tiny_hf  # noqa: E402

import quanta  # noqa: E402
from quanta.loaders import load  # noqa: E402
from quanta.quant.calibration import DEFAULT_TEXT  # noqa: E402
from quanta.quant.errors import ConfigError  # noqa: E402
from quanta.quant.fp8_quant import fp8_weight  # noqa: E402
from quanta.quant.gptq import Hessian, gptq_fp8  # noqa: E402
from quanta.quant.kinds import Fp8  # noqa: E402
from quanta.quant.quantize_model import QuantSpec  # noqa: E402
from quanta.toolkit.quantize.options import QuantizeOptions  # noqa: E402
from quanta.cli.main import main  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "quant"


@pytest.fixture(scope="module")
def golden():
    return {**load_file(FIXTURES / "golden.safetensors"), **load_file(FIXTURES / "gptq_fp8_golden.safetensors")}


def _hessian(H: torch.Tensor, nsamples: int = 1) -> Hessian:
    h = Hessian(H.shape[0])
    h.H, h.nsamples = H.clone(), nsamples
    return h


def _e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many e4m3 grid steps apart two float8_e4m3fn tensors are, element-wise (same sign: bit distance)."""
    ia, ib = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    same_sign = (ia >> 7) == (ib >> 7)
    return torch.where(same_sign, (ia & 0x7F) - (ib & 0x7F), (ia & 0x7F) + (ib & 0x7F)).abs()


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' FP8 rounding of w with a given scale ([] or one per row)."""
    s = scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(())
    return torch.clamp(w / s, -448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("case,strategy,act_order", [("channel", "channel", False), ("channel_act", "channel", True),
                                                     ("tensor", "tensor", False)])
def test_gptq_fp8_matches_llm_compressor(golden, case, strategy, act_order):
    """The same Hessian (llm-compressor's, which has a dead column), blocksize 128 over 256 columns."""
    f, loss = gptq_fp8(golden["input.w"], _hessian(golden["H"], 6), strategy, act_order=act_order)
    assert isinstance(f, Fp8) and f.strategy == strategy and f.input_scale is None
    torch.testing.assert_close(f.scale.reshape(-1), golden[f"{case}.scale"], rtol=0, atol=0)
    want = golden[f"{case}.w"]                        # their fake-quantized weight: code * scale
    theirs = _codes(want, f.scale)
    torch.testing.assert_close(theirs.float() * f.expanded_scale(), want, rtol=0, atol=0)
    steps = _e4m3_steps(f.data, theirs)
    # same algorithm, float32 ops in another order: a code may differ only by one step, from a rounding tie
    assert int((steps > 0).sum()) <= 4 and int(steps.max()) <= 1, int((steps > 0).sum())
    assert loss * 6 == pytest.approx(float(golden[f"{case}.loss"]), rel=1e-4)   # theirs is not divided by n


def _odd_weight() -> torch.Tensor:
    """An odd shape whose K is not a multiple of the blocksize used, with an outlier and a zero row."""
    g = torch.Generator().manual_seed(7)
    w = 0.05 * torch.randn(37, 200, generator=g)
    w[3, 11], w[5] = 9.0, 0.0
    return w


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
@pytest.mark.parametrize("act_order", [False, True])
def test_diagonal_hessian_gives_round_to_nearest_fp8_bit_for_bit(strategy, act_order):
    """With no off-diagonal terms GPTQ propagates no error: every code and scale is plain RTN FP8's."""
    w = _odd_weight()
    H = torch.diag(torch.rand(200, generator=torch.Generator().manual_seed(8)) + 0.5)
    for h in (torch.eye(200), H):
        f, _ = gptq_fp8(w, _hessian(h), strategy, act_order=act_order, blocksize=64)
        rtn = fp8_weight(w, strategy)
        assert torch.equal(f.data.view(torch.uint8), rtn.data.view(torch.uint8))
        assert torch.equal(f.scale, rtn.scale) and f.scale.shape == rtn.scale.shape


def test_dead_input_column_is_zeroed_and_the_scale_is_the_weight_s():
    """An input that is always 0 (diag(H) = 0): its column is written as 0, as GPTQ (and llm-compressor)
    do; the scale still comes from the weight as given, the other columns are RTN's."""
    w = _odd_weight()
    H = torch.eye(200)
    H[11, 11] = 0                                     # the outlier's column: the scale must not change
    f, _ = gptq_fp8(w, _hessian(H), "channel", blocksize=64)
    rtn = fp8_weight(w, "channel")
    assert torch.equal(f.scale, rtn.scale)
    assert not f.data[:, 11].float().any()
    keep = torch.arange(200) != 11
    assert torch.equal(f.data[:, keep].view(torch.uint8), rtn.data[:, keep].view(torch.uint8))


def test_gptq_fp8_beats_rtn_fp8_on_correlated_inputs(golden):
    x, w = golden["input.x"].reshape(-1, 256), golden["input.w"]
    h = Hessian(256)
    h.add_batch(golden["input.x"])
    ref = x @ w.T
    err_rtn = (x @ fp8_weight(w, "channel").dequantize().T - ref).norm()
    for act_order in (False, True):
        err = (x @ gptq_fp8(w, h, "channel", act_order=act_order)[0].dequantize().T - ref).norm()
        assert err < 0.8 * err_rtn, (act_order, float(err), float(err_rtn))


def test_gptq_fp8_rejects_bad_input_naming_the_weight():
    h = Hessian(32)
    h.add_batch(torch.randn(10, 32))
    with pytest.raises(ConfigError, match=r"layers\.0\.q.*strategy.*'block'"):
        gptq_fp8(torch.randn(8, 32), h, "block", name="layers.0.q")
    with pytest.raises(ConfigError, match="damp"):
        gptq_fp8(torch.randn(8, 32), h, damp=1.5)
    with pytest.raises(ConfigError, match="in_features 64"):
        gptq_fp8(torch.randn(8, 64), h)
    with pytest.raises(ConfigError, match="2-D float"):
        gptq_fp8(torch.randn(32), h)


def test_options_resolve_and_refuse():
    o = QuantizeOptions.resolve("gptq", scheme="fp8")             # act-order by default, as llm-compressor
    assert (o.format, o.bits, o.group_size, o.symmetric, o.affine) == ("compressed-tensors", None, None, None, False)
    assert o.describe() == "gptq fp8 e4m3 per-channel, dynamic activations act-order -> compressed-tensors"
    spec = o.spec()
    assert (spec.method, spec.scheme, spec.act_order, spec.fp8_strategy) == ("gptq", "fp8", True, "channel")
    assert not QuantizeOptions.resolve("gptq", scheme="fp8", act_order=False).act_order
    assert QuantizeOptions.resolve("gptq").scheme == "int" and not QuantizeOptions.resolve("gptq").act_order
    for kw, msg in [(dict(method="fp8", scheme="fp8"), "fp8 goes with --method gptq only"),
                    (dict(method="rtn", scheme="fp8"), "fp8 goes with --method gptq only"),
                    (dict(method="gptq", scheme="fp4"), "scheme must be one of int, fp8"),
                    (dict(method="gptq", scheme="fp8", bits=4), "bits=4"),
                    (dict(method="gptq", scheme="fp8", group_size=64), "group_size=64"),
                    (dict(method="gptq", scheme="fp8", symmetric=True), "symmetric=True"),
                    (dict(method="gptq", scheme="fp8", format="gptq"), "writes compressed-tensors with --scheme fp8")]:
        with pytest.raises(ConfigError, match=msg):
            QuantizeOptions.resolve(kw.pop("method"), **kw)
    with pytest.raises(ConfigError, match="GPTQ-FP8 has dynamic activations"):
        QuantSpec("gptq", scheme="fp8", fp8_activation="static")
    with pytest.raises(ConfigError, match="fp8' with method gptq only"):
        QuantSpec("awq", scheme="fp8")


def test_cli_act_order_flags():
    from quanta.cli.main import build_parser

    base = ["quantize", "--method", "gptq", "--out", "o"]
    assert build_parser().parse_args(base).act_order is None          # the method's default
    assert build_parser().parse_args(base + ["--act-order"]).act_order is True
    assert build_parser().parse_args(base + ["--scheme", "fp8", "--no-act-order"]).act_order is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--act-order", "--no-act-order"])


@pytest.mark.skipif(not DEFAULT_TEXT.is_file(), reason="calibration text missing")
def test_cli_writes_what_method_fp8_writes_and_runs(tmp_path, capsys):
    from quanta.engine.llm import LLM

    path, model = build_tiny_hf("llama", tmp_path / "m")
    tokens = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203]
    with torch.no_grad():
        ref_logits = model(torch.tensor([tokens])).logits[0]
    out, plain = tmp_path / "gptq-fp8", tmp_path / "fp8"
    assert main(["quantize", str(path), "--method", "gptq", "--scheme", "fp8", "--samples", "4",
                 "--seqlen", "64", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["scheme"] == "gptq fp8 e4m3 per-channel, dynamic activations act-order -> compressed-tensors"
    # by hand: e4m3 codes + one float32 scale per output row; rows and weights of q, k, v, o, gate, up, down
    rows, weights = 64 + 32 + 32 + 64 + 128 + 128 + 64, 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64
    assert summary["linear_bits_per_weight"] == pytest.approx(8 + 32 * rows / weights)
    quanta.quantize(path, plain, "fp8", quiet=True)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == json.loads((plain / "config.json").read_text())["quantization_config"]
    ours, source = load(out), {n: p.detach().float() for n, p in model.state_dict().items()}
    linears = {n: t for n, t in ours.tensors.items() if n.endswith("_proj.weight")}
    assert len(linears) == 14
    for name, t in linears.items():
        assert isinstance(t, Fp8) and t.strategy == "channel" and t.input_scale is None, name
        assert float((t.dequantize() - source[name]).norm() / source[name].norm()) < 0.06, name
    llm = LLM(model=str(out), dtype=torch.float32, device="cpu", kernel="dequantized", quiet=True)
    logits = llm.prompt_logits(tokens).float()
    assert float((logits - ref_logits).norm() / ref_logits.norm()) < 0.08
