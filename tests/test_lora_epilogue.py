"""LoRA products finished in the affine GEMV's epilogue (quanta.kernels.lora_epilogue): the shrink's pieces, and the
plain, SwiGLU and rotary + KV-store GEMVs with the products added, against float64 references and against the
unfused path (the GEMV, then quanta.lora.kernels.add_lora)."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
from quanta.kernels import activation, affine, rotary
from quanta.kernels.affine import gemv
from quanta.lora.kernels import PIECE_K, shrink_rows
from quanta.lora import kernels as lora
from quanta.quant.kinds.affine import Affine


def weight(n: int, k: int, g: torch.Generator):
    w = Affine(codes=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
               scales=torch.rand(n, k // 128, generator=g) * 0.02 + 0.002, bits=4, group_size=128, zeros=8)
    return w, affine.prepare(w.to(DEVICE), DEVICE, torch.float16)


def slots_for(sizes: list[int], k: int, rank: int, g: torch.Generator, n_slots: int = 3):
    """Random stacked slots (A [S, P*R, K], B [S, N, R], scale [S, P]) and the parts' bounds."""
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    p = len(sizes)
    a = (0.1 * torch.randn(n_slots, p * rank, k, generator=g)).to(DEVICE, torch.float16)
    b = (0.1 * torch.randn(n_slots, bounds[-1], rank, generator=g)).to(DEVICE, torch.float16)
    scale = (torch.rand(n_slots, p, generator=g) + 0.5).to(DEVICE)
    return a, b, scale, bounds


def delta64(x, slots, a, b, scale, bounds) -> torch.Tensor:
    """Each row's adapter products in float64 (zero without a slot)."""
    out = torch.zeros(x.shape[0], bounds[-1], dtype=torch.float64, device=x.device)
    rank = b.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        s = a[slot].double() @ x[t].double()
        for p in range(len(bounds) - 1):
            lo, hi = bounds[p], bounds[p + 1]
            out[t, lo:hi] = scale[slot, p].double() * (b[slot, lo:hi].double() @ s[p * rank:(p + 1) * rank])
    return out


@pytest.mark.parametrize("k", [256, 640, 300], ids=["one-piece", "three-pieces", "ragged"])
def test_shrink_pieces_sum_to_a_times_x(k):
    """The pieces over K sum to A[slot] @ x for each row with an adapter; a row without one is not written."""
    g = torch.Generator().manual_seed(0)
    a, b, scale, bounds = slots_for([24, 8], k, 8, g)
    x = torch.randn(2, k, generator=g).to(DEVICE, torch.float16)
    slots = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    ep = shrink_rows(x, slots, a, b, scale, bounds)
    assert ep.part.shape == (-(-k // PIECE_K), 2, 16)
    want = a[2].double() @ x[0].double()
    torch.testing.assert_close(ep.part[:, 0].sum(0).double(), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("rows,block_n,min_tiles", [(1, 128, 1), (2, 256, 2)], ids=["split-k", "two-rows"])
@pytest.mark.parametrize("sizes,rank", [([192], 16), ([128, 64, 64], 16), ([128, 64, 64], 64)],
                         ids=["one-part", "qkv", "qkv-rank-64"])
def test_gemv_adds_the_products_of_each_rows_slot(rows, block_n, min_tiles, sizes, rank):
    """The GEMV (split-K: the adapter's own split adds) with the epilogue equals x W^T + each row's products
    (float64), and the GEMV then add_lora; a row without an adapter gets the plain GEMV's output. Rank 64 over three
    parts: the shrink's rank columns in several blocks."""
    g = torch.Generator().manual_seed(1)
    n, k = sum(sizes), 512
    w, st = weight(n, k, g)
    a, b, scale, bounds = slots_for(sizes, k, rank, g)
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.float16)
    slots = torch.tensor([1, -1][:rows], dtype=torch.int32, device=DEVICE)
    config = gemv.GemvConfig(block_n, 8, 2, 64.0, min_tiles)
    fused = gemv.matmul(x, st, config=config, lora=shrink_rows(x, slots, a, b, scale, bounds))
    plain = gemv.matmul(x, st, config=config)
    ref = x.double() @ w.dequantize().double().T.to(DEVICE) + delta64(x, slots, a, b, scale, bounds)
    assert rel_err(fused, ref) < TOL[torch.float16]
    unfused = lora.add_lora(x, plain.clone(), slots, a, b, scale, bounds)
    torch.testing.assert_close(fused, unfused, atol=2e-3, rtol=2e-3)
    assert not torch.allclose(fused[0], plain[0], atol=1e-2)
    if rows > 1:
        torch.testing.assert_close(fused[1], plain[1], atol=1e-3, rtol=0)


@pytest.mark.parametrize("rows", [1, 2])
def test_glu_epilogue_activates_the_adapted_gate_and_up(rows):
    """The GEMV's SwiGLU epilogue with the products: silu(gate + its products) * (up + its products)."""
    g = torch.Generator().manual_seed(2)
    inter, k = 96, 384
    w, st = weight(2 * inter, k, g)
    a, b, scale, bounds = slots_for([inter, inter], k, 8, g)
    x = torch.randn(rows, k, generator=g).to(DEVICE, torch.float16)
    slots = torch.tensor([0, 2][:rows], dtype=torch.int32, device=DEVICE)
    fused = gemv.matmul(x, st, glu=True, lora=shrink_rows(x, slots, a, b, scale, bounds))   # the GEMV at any M <= 2
    gate_up = x.double() @ w.dequantize().double().T.to(DEVICE) + delta64(x, slots, a, b, scale, bounds)
    assert fused.shape == (rows, inter)
    assert rel_err(fused, activation.reference(gate_up)) < TOL[torch.float16]


def test_rope_epilogue_rotates_and_stores_the_adapted_q_k_v():
    """The qkv GEMV's rotary + KV-store epilogue over q, k, v with their products added: q and the caches as
    rotary_and_store leaves them from the float64 sums (rounded to fp16)."""
    g = torch.Generator().manual_seed(3)
    hq, hk, d, k = 3, 2, 64, 512
    sizes = [hq * d, hk * d, hk * d]
    w, st = weight(sum(sizes), k, g)
    a, b, scale, bounds = slots_for(sizes, k, 16, g)
    x = torch.randn(1, k, generator=g).to(DEVICE, torch.float16)
    slots = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    pos, slot = torch.tensor([9]).to(DEVICE), torch.tensor([5]).to(DEVICE)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)

    def caches():
        return [torch.zeros(2, 16, hk, d, dtype=torch.float16, device=DEVICE) for _ in range(2)]
    kc, vc = caches()
    config = gemv.GemvConfig(128, 8, 2, 64.0, 1)
    rope = rotary.RopeStore(pos, inv_freq, hq * d, hk * d, d, kc, vc, slot, None, None, None)
    q = gemv.matmul(x, st, config=config, rope=rope, lora=shrink_rows(x, slots, a, b, scale, bounds))[:, :hq * d]
    y = (x.double() @ w.dequantize().double().T.to(DEVICE) + delta64(x, slots, a, b, scale, bounds)).half()
    y = y.view(1, hq + 2 * hk, d)
    kc2, vc2 = caches()
    q_ref = rotary.rotary_and_store(y[:, :hq], y[:, hq:hq + hk], y[:, hq + hk:], pos, inv_freq, kc2, vc2, slot,
                                    None, None, None)
    torch.testing.assert_close(q.view(1, hq, d), q_ref, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(kc, kc2, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(vc, vc2, atol=3e-3, rtol=3e-3)
    assert kc.ne(0).any() and vc.ne(0).any()


def test_the_plan_fuses_at_the_gemv_rows_only():
    """lora_fuses holds for the rows the GEMV takes and not above (the caller then adds the products itself)."""
    g = torch.Generator().manual_seed(4)
    _, st = weight(64, 256, g)
    assert affine.lora_fuses(st, 1)
    assert not affine.lora_fuses(st, 3)


@pytest.mark.parametrize("glu,config", [(False, (16, 256, 4, 64.0, 1)), (True, None)], ids=["split-k", "glu"])
def test_fp8_gemv_adds_the_products_too(glu, config):
    """The FP8 GEMV (W8A8 weights at one row) with the epilogue: plain with split-K, and SwiGLU."""
    from quanta.kernels import fp8_gemm, fp8_gemv
    from test_fp8_gemm import make_fp8
    g = torch.Generator().manual_seed(5)
    n, k = 128, 1024
    w = make_fp8(n, k, "e4m3", "channel", seed=5)
    a, b, scale, bounds = slots_for([n // 2, n // 2] if glu else [n], k, 16, g)
    x = torch.randn(1, k, generator=g).to(DEVICE, torch.float16)
    slots = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    ep = shrink_rows(x, slots, a, b, scale, bounds)
    y = fp8_gemv.matmul(x, w.data, w.scale.float(), None, config, hw_fp8=False, glu=glu, lora=ep)
    ref = x.double() @ w.dequantize().double().T.to(DEVICE) + delta64(x, slots, a, b, scale, bounds)
    assert rel_err(y, activation.reference(ref) if glu else ref) < TOL[torch.float16]
    st = fp8_gemm.W8A8State(w.data.t(), w.scale.float().reshape(1, -1), n, k, torch.float16)
    assert fp8_gemm.lora_fuses(st, 1) and not fp8_gemm.lora_fuses(st, 2)


def test_merged_layer_routes_decode_rows_through_the_epilogue(monkeypatch):
    """MergedQuantLinear over a real affine state and stacked slots (the engine's GPU path, interpreted): a decode
    row's gate/up keeps the fused SwiGLU with the adapter's products in the GEMV (one shrink, no add_lora), rows
    beyond the GEMV's take the GEMM and add_lora; both equal W x + scaling B A x (float64)."""
    from quanta.lora.slots import LayerSlots
    g = torch.Generator().manual_seed(6)
    k = 256
    w, layer, step, delta = adapted_gate_up(g, 64, k, 8, slot=1)
    calls = {"add": 0}
    add = LayerSlots.add
    monkeypatch.setattr(LayerSlots, "add", lambda *a: calls.__setitem__("add", calls["add"] + 1) or add(*a))
    for rows in (1, 3):
        step.set([(1, rows)])
        x = torch.randn(rows, k, generator=g).to(DEVICE, torch.float16)
        y = layer.forward_glu(x)
        ref = activation.reference(x.double() @ (w.dequantize().double().to(DEVICE) + delta.to(DEVICE)).T)
        assert rel_err(y, ref) < TOL[torch.float16], rows
        assert calls["add"] == (0 if rows == 1 else 1)


@pytest.mark.parametrize("d,residual", [(576, True), (256, False), (64, True)], ids=["576-residual", "256", "64"])
def test_norm_shrink_is_the_norm_and_the_shrink_in_one_launch(d, residual):
    """norm_shrink leaves y (and h) exactly as fused_norm.rms_norm does, and its pieces sum to A[slot] @ y as stored
    (the GEMV's input), for a row with an adapter; nothing for a row without (D not a power of two: pieces of 256
    in a 1024-wide register row; D = 64: one piece of 64)."""
    from quanta.kernels import fused_norm
    from quanta.lora.kernels import norm_shrink
    g = torch.Generator().manual_seed(7)
    a, b, scale, bounds = slots_for([48, 16, 16], d, 8, g)
    x = torch.randn(2, d, generator=g).to(DEVICE, torch.float16)
    r = torch.randn(2, d, generator=g).to(DEVICE, torch.float16) if residual else None
    w = (torch.rand(d, generator=g) + 0.5).to(DEVICE, torch.float16)
    slots = torch.tensor([2, -1], dtype=torch.int32, device=DEVICE)
    out, ep = norm_shrink(x, w, 1e-5, r, slots, a, b, scale, bounds)
    want = fused_norm.rms_norm(x, w, 1e-5, r)
    for got, ref in zip(out if residual else [out], want if residual else [want]):
        assert torch.equal(got, ref)
    y = out[0] if residual else out
    torch.testing.assert_close(ep.part[:, 0].sum(0).double(), a[2].double() @ y[0].double(), atol=1e-3, rtol=1e-3)
    assert ep.part.shape == (-(-d // min(256, 1 << (d - 1).bit_length())), 2, 24)


def test_a_norm_feeding_an_adapted_layer_makes_its_shrink(monkeypatch):
    """RMSNorm linked to the MergedQuantLinear it feeds (LoRASlots links them): at a decode row the norm's launch
    makes the layer's shrink (no shrink_rows launch) and the layer's output equals the unlinked path's."""
    from quanta.engine.layers import RMSNorm
    from quanta.lora import kernels as lora_kernels
    g = torch.Generator().manual_seed(8)
    k = 256
    _, layer, step, _ = adapted_gate_up(g, 64, k, 8, slot=0)
    step.set([(0, 1)])
    norm = RMSNorm(k, 1e-5, triton=True)
    norm.weight.data = (torch.rand(k, generator=g) + 0.5).to(DEVICE, torch.float16)
    x, r = (torch.randn(1, k, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    shrinks = {"n": 0}
    shrink = lora_kernels.shrink_rows
    monkeypatch.setattr(lora_kernels, "shrink_rows",
                        lambda *a: shrinks.__setitem__("n", shrinks["n"] + 1) or shrink(*a))
    y0, h0 = norm(x, r)
    out0 = layer.forward_glu(y0)
    assert shrinks["n"] == 1
    norm.feed_lora(layer)
    assert "feeds" not in dict(norm.named_children())
    y1, h1 = norm(x, r)
    out1 = layer.forward_glu(y1)
    assert shrinks["n"] == 1 and layer.pending is None
    assert torch.equal(y1, y0) and torch.equal(h1, h0)
    torch.testing.assert_close(out1, out0, atol=2e-3, rtol=2e-3)
    y2, _ = norm(x, r)
    layer.forward_glu(y2.clone())                # not the norm's output: the layer makes its own shrink
    assert shrinks["n"] == 2 and layer.pending is None


def adapted_gate_up(g: torch.Generator, inter: int, k: int, rank: int, slot: int):
    """A gate/up MergedQuantLinear over a real affine state with an adapter in stacked slot `slot` (the engine's GPU
    path, interpreted on the CPU): (the Affine weight, the layer, its LoRAStep, the adapter's delta W [2I, K])."""
    from pathlib import Path
    from quanta.engine.layers import MergedQuantLinear
    from quanta.lora.adapter import Adapter, LoRAWeights
    from quanta.lora.slots import LayerSlots, LoRAStep
    w, st = weight(2 * inter, k, g)
    layer = MergedQuantLinear(k, {"gate_proj": inter, "up_proj": inter}, triton=True)
    layer.fused.kernel, layer.fused.state = affine, st
    slots = LayerSlots(["m.gate_proj", "m.up_proj"], [inter, inter], k, 2, rank, torch.device(DEVICE),
                       torch.float16, stacked=True, input_order=None)
    pair = [LoRAWeights(0.1 * torch.randn(rank, k, generator=g), 0.1 * torch.randn(inter, rank, generator=g), 0.5)
            for _ in range(2)]
    slots.fill(slot, Adapter(Path("a"), rank, {"m.gate_proj": pair[0], "m.up_proj": pair[1]}))
    step = LoRAStep(8, 2, torch.device(DEVICE), triton=True)
    layer.attach_lora(slots, step)
    return w, layer, step, torch.cat([p.scaling * p.b.double() @ p.a.double() for p in pair])
