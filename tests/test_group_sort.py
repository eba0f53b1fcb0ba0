"""Act-order down_proj groups sorted by renumbering the MLP's intermediate features (quant/group_sort.py):
the MLP computes the same function (checked in float64 against the unsorted weights' dequantization), down_proj
becomes a plain grouped weight, and the engine then runs it on a packing kernel instead of a dequantized copy."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_util import cpu_4bit_kernel  # noqa: I001
from quanta.engine import LLM
from quanta.quant.group_sort import sort_mlp
from quanta.quant.kinds import Affine


def act_order_affine(n: int, k: int, group: int, gen: torch.Generator, zeros: bool = True) -> Affine:
    """A random 4-bit weight whose groups are scattered over K as GPTQ desc_act leaves them."""
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=gen)] = (torch.arange(k) // group).to(torch.int32)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    z = torch.randint(0, 16, (n, k // group), generator=gen, dtype=torch.int32) if zeros else 8
    return Affine(codes=codes, scales=scales, bits=4, group_size=group, zeros=z, g_idx=g_idx)


def mlp(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    w = [t.dequantize(torch.float64) if isinstance(t, Affine) else t.double() for t in (gate, up, down)]
    return (F.silu(x @ w[0].T) * (x @ w[1].T)) @ w[2].T


def test_sorted_mlp_is_the_same_function_with_plain_down_groups():
    gen = torch.Generator().manual_seed(0)
    hidden, inter, group = 64, 256, 32
    gate, up = act_order_affine(inter, hidden, group, gen), torch.randn(inter, hidden, generator=gen)
    down = act_order_affine(hidden, inter, group, gen)
    x = torch.randn(5, hidden, generator=gen, dtype=torch.float64)
    g2, u2, d2, gb, ub = sort_mlp(gate, up, down, None, torch.randn(inter, generator=gen))
    assert d2.g_idx is None and d2.group_size == group and gb is None and ub is not None
    torch.testing.assert_close(mlp(x, g2, u2, d2), mlp(x, gate, up, down), rtol=1e-12, atol=1e-12)
    assert gate.g_idx is not None and torch.equal(g2.g_idx, gate.g_idx)      # gate's own groups run along hidden


def test_uneven_groups_and_plain_weights_are_left_as_they_are():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    uneven = act_order_affine(32, 64, 16, gen)
    uneven.g_idx[0] = uneven.g_idx[1] = 0                  # a group of 17 columns: no runs of 16 to sort into
    plain = act_order_affine(32, 64, 16, gen)
    plain.g_idx = None
    for down in (uneven, plain):
        out = sort_mlp(gate, up, down)
        assert out[0] is gate and out[1] is up and out[2] is down


def test_engine_runs_an_act_order_down_proj_packed():
    # the packed 4-bit kernels take plain groups only: unsorted, an act-order down_proj would fall back to cpu_rows
    with LLM("synthetic:tiny-tp:w4g64act", device="cpu", max_model_len=64, num_kv_blocks=8, quiet=True) as llm:
        kernels = {k["name"].rsplit(".", 1)[-1]: k["kernel"] for k in llm.kernels()}
    assert kernels["down_proj"] == cpu_4bit_kernel()[0]
    assert kernels["o_proj"] == "cpu_rows"                # its K is the attention heads: not reorderable


def test_synthetic_act_order_shares_g_idx_over_one_input_as_gptq_does():
    """GPTQ orders columns by the Hessian of the layer's input, so q/k/v (and gate/up) of a real desc_act
    checkpoint carry one g_idx and stack into one GEMM; the synthetic benchmark model must too, or it
    measures separate GEMMs that real checkpoints do not run."""
    from quanta.loaders.synthetic import load_synthetic
    tensors = load_synthetic("synthetic:tiny:w4g32act", "cpu").tensors
    g = {n: tensors[f"model.layers.1.{n}.weight"].g_idx for n in
         ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert torch.equal(g["self_attn.q_proj"], g["self_attn.k_proj"]) and torch.equal(g["self_attn.q_proj"], g["self_attn.v_proj"])
    assert torch.equal(g["mlp.gate_proj"], g["mlp.up_proj"])
    assert not torch.equal(g["self_attn.q_proj"], g["mlp.gate_proj"])      # another input, another order
    assert not torch.equal(g["self_attn.o_proj"], g["self_attn.q_proj"])
    with LLM("synthetic:tiny:w4g32act", device="cpu", quiet=True) as llm:
        names = [row["name"] for row in llm.kernels()]
    assert "model.layers.0.self_attn.q_proj+k_proj+v_proj" in names and "model.layers.0.mlp.gate_proj+up_proj" in names


def test_which_quantization_configs_declare_act_order():
    from quanta.quant.group_sort import declares_act_order
    assert declares_act_order({"quant_method": "gptq", "desc_act": True})
    assert declares_act_order({"config_groups": {"group_0": {"weights": {"actorder": "group"}}}})
    assert declares_act_order({"synthetic": "w4g128act"})
    for plain in ({"quant_method": "gptq", "desc_act": False}, {"config_groups": {"g": {"weights": {"actorder": None}}}},
                  {"synthetic": "w4g128"}, {}, None):
        assert not declares_act_order(plain)
