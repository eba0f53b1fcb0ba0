"""LLM.kernels(): per GEMM as it runs (merged q/k/v and gate/up, the lm_head with its own dtype), the
kernel, its compute dtype and the path it takes at each M."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kernel_util import cpu_4bit_kernel  # noqa: I001
from quanta.engine import LLM
from quanta.engine.kernel_report import KernelPath, compute_dtype, layer_paths
from quanta.engine.layers import QuantLinear
from quanta.loaders.synthetic import SHAPES

TINY = SHAPES["tiny"]


def tiny_llm(**kw) -> LLM:
    return LLM(model="synthetic:tiny:w4g32", device="cpu", num_kv_blocks=16, max_model_len=128, quiet=True, **kw)


def test_rows_are_the_gemms_as_they_run():
    rows = tiny_llm().kernels(m=(1, 7))
    hidden, inter, layers = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"]
    head_dim = hidden // TINY["num_attention_heads"]
    qkv = (TINY["num_attention_heads"] + 2 * TINY["num_key_value_heads"]) * head_dim
    expected = []
    for i in range(layers):
        p = f"model.layers.{i}."
        expected += [(p + "self_attn.q_proj+k_proj+v_proj", [qkv, hidden]), (p + "self_attn.o_proj", [hidden, hidden]),
                     (p + "mlp.gate_proj+up_proj", [2 * inter, hidden]), (p + "mlp.down_proj", [hidden, inter])]
    expected.append(("lm_head", [TINY["vocab_size"], hidden]))
    assert [(r["name"], r["shape"]) for r in rows] == expected
    assert all(set(r["paths"]) == {1, 7} for r in rows)


def test_dtypes_say_what_computes():
    """On the CPU with dtype auto the activations are float32, the 4-bit GEMMs compute from 8-bit blocks
    (cpu_vnni) or at bf16 input (cpu_int4) and the dense lm_head runs in bf16; with dtype float32 the lm_head
    does too."""
    rows = tiny_llm().kernels()
    body, head = rows[:-1], rows[-1]
    kernel, computes = cpu_4bit_kernel()
    assert {(r["kernel"], r["dtype"], r["compute_dtype"]) for r in body} == {(kernel, "float32", computes)}
    assert (head["kernel"], head["dtype"], head["compute_dtype"]) == ("dense", "bfloat16", "bfloat16")
    assert tiny_llm(dtype="float32").kernels()[-1]["dtype"] == "float32"


def loaded_layer(kernel) -> QuantLinear:
    layer = QuantLinear(32, 16)
    layer.load(torch.randn(16, 32), None, torch.device("cpu"), torch.float32)
    layer.kernel = kernel                       # a stand-in kernel module over the layer's own state
    return layer


def test_paths_come_from_the_kernel_module_when_it_has_several():
    seen = []

    def path(state, m):
        seen.append(state)
        return ("gemv", "M <= 4") if m <= 4 else ("tiled", "M > 4")
    layer = loaded_layer(SimpleNamespace(NAME="fake", path=path, compute_dtype=lambda dtype: torch.float16))
    assert layer_paths(layer, (1, 4, 5)) == {1: KernelPath("gemv", "M <= 4"), 4: KernelPath("gemv", "M <= 4"),
                                             5: KernelPath("tiled", "M > 4")}
    assert all(state is layer.state for state in seen)
    assert compute_dtype(layer) == torch.float16


def test_a_kernel_without_paths_is_its_own_path():
    layer = loaded_layer(SimpleNamespace(NAME="plain"))
    layer.kernel_reason = "fallback: other: cannot"
    assert layer_paths(layer, (1, 256)) == {m: KernelPath("plain", "fallback: other: cannot") for m in (1, 256)}
    assert compute_dtype(layer) == torch.float32
