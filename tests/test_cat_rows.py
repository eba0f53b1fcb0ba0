"""cat_rows: q/k/v or gate/up weights stacked into one weight of the same kind, exactly (the stacked
weight dequantizes to the stacked dequantizations), or None when the formats cannot be shared."""
import gguf
import numpy as np
import pytest
import torch

from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.codebook import Codebook
from quanta.quant.kinds.fp8 import Fp8
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import cat_rows

G = torch.Generator().manual_seed(0)


def affine(n, k=128, group=32, zero="int", g_idx=None):
    groups = k // group
    kw = {"zeros": torch.randint(0, 16, (n, groups), generator=G, dtype=torch.int32)} if zero == "int" else \
        {"mins": torch.randn(n, groups, generator=G)} if zero == "float" else {"zeros": 8}
    return Affine(codes=torch.randint(0, 16, (n, k), generator=G, dtype=torch.uint8),
                  scales=torch.rand(n, groups, generator=G), bits=4, group_size=group, g_idx=g_idx, **kw)


def gguf_weight(n, k=64, qtype=gguf.GGMLQuantizationType.Q5_1):
    data = gguf.quants.quantize(np.random.default_rng(n).standard_normal((n, k)).astype(np.float32), qtype)
    return Gguf(data=torch.from_numpy(data), ggml_type=int(qtype), shape=(n, k))


def fp8(n, k=64, scale=None):
    data = torch.randn(n, k, generator=G).to(torch.float8_e4m3fn)
    return Fp8(data=data, scale=torch.tensor(scale) if scale is not None else torch.rand(n, generator=G))


def codebook(n, k=64):
    table = torch.linspace(-1, 1, 16)
    return Codebook(codes=torch.randint(0, 16, (n, k), generator=G, dtype=torch.uint8), table=table,
                    blocksize=64, absmax=torch.rand(n * k // 64, generator=G))


CASES = {
    "dense": lambda: [torch.randn(n, 128, generator=G) for n in (64, 16, 16)],
    "affine-int": lambda: [affine(n) for n in (64, 16, 16)],
    "affine-float-mins": lambda: [affine(n, zero="float") for n in (48, 48)],
    "affine-sym": lambda: [affine(n, zero="sym") for n in (32, 8)],
    "affine-same-act-order": lambda: (lambda g: [affine(n, g_idx=g) for n in (32, 8)])(
        (torch.randperm(128, generator=G) // 32).int()),
    "gguf": lambda: [gguf_weight(n) for n in (32, 8, 8)],
    "fp8-channel": lambda: [fp8(n) for n in (32, 16)],
    "fp8-tensor-scales-differ": lambda: [fp8(32, scale=0.5), fp8(16, scale=0.25)],
    "codebook": lambda: [codebook(n) for n in (32, 16)],
}


@pytest.mark.parametrize("case", CASES)
def test_stacked_weight_dequantizes_to_stacked_parts(case):
    parts = CASES[case]()
    merged = cat_rows(parts)
    assert merged is not None and tuple(merged.shape) == (sum(p.shape[0] for p in parts), parts[0].shape[1])
    deq = (lambda w: w if isinstance(w, torch.Tensor) else w.dequantize())
    assert torch.equal(deq(merged), torch.cat([deq(p) for p in parts]))


@pytest.mark.parametrize("parts", [
    lambda: [affine(32), affine(32, group=64)],                                  # group sizes differ
    lambda: [affine(32, zero="int"), affine(32, zero="float")],                  # zero forms differ
    lambda: [affine(32, g_idx=(torch.arange(128) // 32).flip(0).int()), affine(32, g_idx=(torch.arange(128) // 32).int())],
    lambda: [gguf_weight(32), gguf_weight(32, qtype=gguf.GGMLQuantizationType.Q8_0)],
    lambda: [affine(32), torch.randn(32, 128)],                                  # kinds differ
    lambda: [torch.randn(32, 128), torch.randn(32, 128).half()],                 # dtypes differ
])
def test_incompatible_parts_stay_apart(parts):
    assert cat_rows(parts()) is None


@pytest.mark.parametrize("compatible", [True, False])
def test_merged_linear_equals_its_parts(compatible):
    """MergedQuantLinear runs one GEMM on stacked weights, or each part when they cannot stack; either way
    its output is the parts' outputs side by side."""
    from quanta.engine.layers import MergedQuantLinear
    parts = [affine(32), affine(16)] if compatible else [affine(32), affine(16, group=64)]
    biases = [torch.randn(32, generator=G), torch.randn(16, generator=G)]
    merged = MergedQuantLinear(128, {"a": 32, "b": 16}, bias=True)
    merged.load(parts, biases, torch.device("cpu"), torch.float32, names=["a.weight", "b.weight"])
    assert (merged.separate is None) == compatible and len(merged.linears()) == (1 if compatible else 2)
    x = torch.randn(3, 128, generator=G)
    torch.testing.assert_close(merged(x), each_alone(parts, biases, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="bias missing"):
        MergedQuantLinear(128, {"a": 32, "b": 16}, bias=True).load(parts, [biases[0], None], torch.device("cpu"),
                                                                   torch.float32, names=["a.weight", "b.weight"])


def test_mixed_gguf_parts_run_as_runs_of_one_type():
    """A mixed file's q, k (Q4_K) and v (Q6_K): q and k stack into one GEMM, v stays apart (stack_runs), and the
    output is the three parts' side by side."""
    from test_ggml_gemm import make_gguf

    from quanta.engine.layers import MergedQuantLinear, stack_runs
    parts = [make_gguf(n, 256, name, seed=n, device="cpu")[0] for n, name in ((32, "Q4_K"), (16, "Q4_K"), (16, "Q6_K"))]
    assert stack_runs(parts) == [[0, 1], [2]] and stack_runs(parts[::-1]) == [[0], [1, 2]]
    biases = [torch.randn(n, generator=G) for n in (32, 16, 16)]
    merged = MergedQuantLinear(256, {"q_proj": 32, "k_proj": 16, "v_proj": 16}, bias=True)
    merged.load(parts, biases, torch.device("cpu"), torch.float32, names=["q_proj", "k_proj", "v_proj"])
    assert [name for name, _ in merged.linears()] == ["q_proj+k_proj", "v_proj"]
    x = torch.randn(2, 256, generator=G)
    torch.testing.assert_close(merged(x), each_alone(parts, biases, x), rtol=1e-5, atol=1e-5)


def each_alone(parts: list, biases: list, x: torch.Tensor) -> torch.Tensor:
    """The parts' outputs side by side, each from a QuantLinear of its own."""
    from quanta.engine.layers import QuantLinear
    want = []
    for w, b in zip(parts, biases):
        single = QuantLinear(x.shape[-1], w.shape[0], bias=True)
        single.load(w, b, torch.device("cpu"), torch.float32)
        want.append(single(x))
    return torch.cat(want, dim=-1)
