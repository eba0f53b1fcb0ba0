"""The CPU layer's native operations (cpu/layer_ops.c): attention over the paged cache against float64
softmax attention from torch, rotary-and-store against the torch rotation and store (the same bits), RMSNorm and
SiLU-and-mul against torch; every row the same bit for bit whether it runs alone or in a batch, on one thread or two."""
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from quanta.kernels import fused_norm, paged_kv, rotary
from quanta.cpu import layer_ops
from quanta.quant import fp8_codes

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not layer_ops.usable(torch.zeros(1)),
                                reason="no C compiler")

BLOCK = 16


def paged(lengths: list[int], hk: int, d: int, dtype=torch.float32, seed: int = 0):
    """Random caches whose blocks are handed out shuffled, and each sequence's block table."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / BLOCK) for n in lengths]
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n] + [0] * (max(need) - n))
        at += n
    k = torch.randn(sum(need) + 3, BLOCK, hk, d, generator=g).to(dtype)
    v = torch.randn(sum(need) + 3, BLOCK, hk, d, generator=g).to(dtype)
    return k, v, torch.tensor(tables, dtype=torch.int32)


def oracle(q, k_cache, v_cache, table, pos: int, lo: int, scale: float) -> torch.Tensor:
    """One row's attention [Hq, D] in float64 over keys lo .. pos of its sequence (torch's SDPA)."""
    keys = torch.arange(lo, pos + 1)
    slots = table.long()[keys // BLOCK] * BLOCK + keys % BLOCK
    k = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double()
    v = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double()
    g = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).transpose(0, 1), v.repeat_interleave(g, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.double()[:, None], k, v, scale=scale)[:, 0]


def step(lengths: list[int], queries: list[int]):
    """(query_start_loc, seq_lens) of a step whose sequence b has `queries[b]` queries, the last at position
    lengths[b] - 1."""
    starts = torch.tensor([0] + queries).cumsum(0).to(torch.int32)
    return starts, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("cache", ["f32", "bf16", "fp8"])
def test_attention_matches_float64_softmax_attention(window, cache):
    lengths, queries, hq, hk, d = [37, 70, 5, 16], [1, 23, 5, 1], 6, 2, 64
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}[cache]
    k, v, tables = paged(lengths, hk, d, dtype)
    fmt = k_scale = v_scale = None
    if cache == "fp8":
        fmt = paged_kv.FP8_FORMATS["fp8_e4m3"]
        k_scale, v_scale = torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])
        k, v = paged_kv.quantize(k, k_scale, fmt), paged_kv.quantize(v, v_scale, fmt)
    starts, lens = step(lengths, queries)
    q = torch.randn(int(starts[-1]), hq, d)
    rows = layer_ops.rows(tables, lens, starts, window)
    got = layer_ops.attention(q, k, v, rows, 0.125, k_scale, v_scale, fmt)
    kd = fp8_codes.dequantize(k, k_scale, fmt) if fmt else k
    vd = fp8_codes.dequantize(v, v_scale, fmt) if fmt else v
    for t in range(q.shape[0]):
        b = int(torch.searchsorted(starts, t, right=True)) - 1
        pos = int(lens[b]) - (int(starts[b + 1]) - t)
        lo = 0 if window is None else max(0, pos - window + 1)
        want = oracle(q[t], kd, vd, tables[b], pos, lo, 0.125)
        assert (got[t].double() - want).abs().max().item() < 1e-5, t


def test_attention_rows_do_not_depend_on_the_batch_or_the_threads():
    lengths, queries = [300, 45, 9], [1, 45, 3]
    k, v, tables = paged(lengths, 3, 64)
    starts, lens = step(lengths, queries)
    q = torch.randn(int(starts[-1]), 9, 64)
    together = layer_ops.attention(q, k, v, layer_ops.rows(tables, lens, starts, None), 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in (0, 1, 20, 45, 46, 48):
                b = int(torch.searchsorted(starts, t, right=True)) - 1
                pos = int(lens[b]) - (int(starts[b + 1]) - t)
                one = layer_ops.rows(tables[b:b + 1], torch.tensor([pos + 1]), torch.tensor([0, 1]), None)
                assert torch.equal(layer_ops.attention(q[t:t + 1], k, v, one, 0.125)[0], together[t]), (n, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
def test_rope_store_is_the_torch_rotation_and_store(cache):
    t, hq, hk, d = 7, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    cos, sin = rotary.cos_sin(torch.arange(3, 3 + t), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), torch.float32)
    slots = torch.tensor([5, 9, -1, 0, 31, 17, 2])
    caches = [torch.zeros(2, BLOCK, hk, d, dtype=cache) for _ in range(4)]
    got = layer_ops.rope_store(q, k, v, cos, sin, caches[0], caches[1], slots)
    want = rotary.rotate(q, cos, sin)
    paged_kv.reference_store(rotary.rotate(k, cos, sin), v, caches[2], caches[3], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_torch_and_each_row_stands_alone(residual):
    x, w = torch.randn(9, 576), torch.randn(576)
    r = torch.randn(9, 576) if residual else None
    got = layer_ops.rms_norm(x, w, 1e-5, r)
    want = fused_norm.reference(x.double(), w.double(), 1e-5, None if r is None else r.double())
    if residual:
        assert torch.equal(got[1], x + r)
        got, want = got[0], want[0]
    assert (got.double() - want).abs().max().item() < 1e-5
    alone = torch.cat([layer_ops.rms_norm(x[i:i + 1], w, 1e-5) if r is None
                       else layer_ops.rms_norm(x[i:i + 1], w, 1e-5, r[i:i + 1])[0] for i in range(9)])
    assert torch.equal(alone, got)


def test_silu_and_mul_matches_torch():
    x = torch.randn(5, 2 * 1536) * 4
    got = layer_ops.silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    assert ((got.double() - F.silu(gate) * up).abs() / (1 + (F.silu(gate) * up).abs())).max().item() < 1e-6
    assert torch.equal(torch.cat([layer_ops.silu_and_mul(x[i:i + 1]) for i in range(5)]), got)
