"""Paged attention and the paged KV store: the Triton kernels (under TRITON_INTERPRET=1 on the CPU,
compiled on a GPU) against the torch reference, odd lengths and block boundaries included; the
bit-level fp8 conversion against torch's float8 casts; the fp8 KV error against fp32 attention."""
from __future__ import annotations

import pytest
import torch

import quanta.kernels.paged_attention as paged_attention
import quanta.kernels.paged_kv as paged_kv    # conftest set TRITON_INTERPRET=1 when there is no GPU

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [None, "fp8_e4m3", "fp8_e5m2"]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Tolerance vs the reference *with the same fp8 cache*: both read identical codes, so only the
# kernel's own arithmetic differs; fp32 accumulation keeps that at the model dtype's rounding.


def build(lens, qlens, hq, hk, d, block_size, dtype, fmt=None, num_blocks=None, seed=0):
    """A paged cache holding random K/V for each sequence (shuffled blocks), and the step's queries."""
    g = torch.Generator().manual_seed(seed)
    fmt = paged_kv.FP8_FORMATS[fmt] if fmt else None
    need = [-(-n // block_size) for n in lens]
    num_blocks = num_blocks or sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    store = torch.uint8 if fmt else dtype
    k_cache = torch.zeros(num_blocks, block_size, hk, d, dtype=store, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_scale = (0.01 + 0.02 * torch.rand(hk, generator=g)).to(DEVICE) if fmt else None
    v_scale = (0.01 + 0.02 * torch.rand(hk, generator=g)).to(DEVICE) if fmt else None
    tables = tables.to(DEVICE)
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        slot = tables[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(n, hk, d, generator=g).to(DEVICE, dtype)
        v = torch.randn(n, hk, d, generator=g).to(DEVICE, dtype)
        paged_kv.store(k, v, k_cache, v_cache, slot, k_scale, v_scale, fmt)
    starts = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(starts[-1]), hq, d, generator=g).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables, seq_lens, starts, dict(k_scale=k_scale, v_scale=v_scale, fmt=fmt)


CASES = [  # (seq_lens, query lens, Hq, Hk, D, block_size, window)
    ([1, 17, 40], [1, 9, 40], 4, 2, 24, 16, None),        # odd head_dim, chunk in the middle of a block
    ([16, 33, 32], [16, 1, 5], 4, 1, 32, 16, None),       # MQA, exact block boundaries
    ([50, 7], [13, 7], 6, 2, 16, 8, 5),                   # GQA 3, sliding window
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_prefill_kernel_matches_reference(case, fmt):
    lens, qlens, hq, hk, d, bs, window = case
    q, kc, vc, bt, sl, qsl, kw = build(lens, qlens, hq, hk, d, bs, torch.float32, fmt)
    ref = paged_attention.reference(q, kc, vc, bt, sl, qsl, 0.3, window, **kw)
    out = paged_attention.prefill(q, kc, vc, bt, sl, qsl, max(qlens), 0.3, sliding_window=window,
                                  block_m=16, block_n=16, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", CASES)
def test_decode_kernel_matches_reference(case, splits, fmt):
    lens, _, hq, hk, d, bs, window = case
    lens = lens + [0]                                     # a padding row (CUDA-graph bucket) gives zeros
    q, kc, vc, bt, sl, qsl, kw = build(lens[:-1], [1] * (len(lens) - 1), hq, hk, d, bs, torch.float32, fmt)
    sl = torch.cat([sl, torch.zeros(1, dtype=sl.dtype, device=DEVICE)])
    bt = torch.cat([bt, bt[:1]])
    q = torch.cat([q, torch.randn(1, hq, d, device=DEVICE)])
    ref = paged_attention.reference(q[:-1], kc, vc, bt[:-1], sl[:-1], qsl, 0.3, window, **kw)
    out = paged_attention.decode(q, kc, vc, bt, sl, 0.3, sliding_window=window, num_splits=splits, block_n=16, **kw)
    torch.testing.assert_close(out[:-1], ref, atol=TOL[torch.float32], rtol=0)
    assert out[-1].abs().max() == 0
    # the last split merges in place of a second launch and leaves its counters zero for the next call
    again = paged_attention.decode(q, kc, vc, bt, sl, 0.3, sliding_window=window, num_splits=splits, block_n=16,
                                   **kw)
    assert torch.equal(again, out)
    assert not paged_attention.split_counts(DEVICE, len(lens) * hk).any()


@pytest.fixture
def long_and_short():
    """A 300-key and a 5-key sequence (8 query heads over 2 kv heads, d 32, blocks of 16) to decode: decode's
    arguments, its keyword arguments and the reference output."""
    q, kc, vc, bt, sl, qsl, kw = build([300, 5], [1, 1], 8, 2, 32, 16, torch.float32, None)
    return (q, kc, vc, bt, sl, 0.3), kw, paged_attention.reference(q, kc, vc, bt, sl, qsl, 0.3, None, **kw)


def test_decode_merges_more_splits_than_one_merge_step(long_and_short):
    # 300 keys over 12 splits of 32: ten splits see keys (two merge steps of 8, the second partial), two are
    # empty; the 5-key row fills one split and leaves eleven empty
    args, kw, ref = long_and_short
    out = paged_attention.decode(*args, num_splits=12, block_n=16, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("min_keys", [32, 64, 512])
def test_decode_splits_take_at_least_min_split_keys(min_keys, prefetch, monkeypatch, long_and_short):
    # 300 keys over 12 splits: at least 32 keys a split (ten splits, two merge steps), 64 (five) or 512 (one, written
    # straight to out with no merge); the 5-key row takes one split in each. Prefetch: each step's loads one ahead
    monkeypatch.setattr(paged_attention, "DECODE_PREFETCH", prefetch)
    args, kw, ref = long_and_short
    out = paged_attention.decode(*args, num_splits=12, block_n=16, min_split_keys=min_keys, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)
    assert not paged_attention.split_counts(DEVICE, 2 * 2).any()        # two sequences, two kv heads


@pytest.mark.parametrize("prefetch", [False, True])
def test_unsplit_decode_with_and_without_the_prefetch(prefetch, monkeypatch, long_and_short):
    # one program a (sequence, kv head) over every key, as large batches launch it: 300 keys in 19 steps of 16 and
    # 5 keys in one, the prefetch's next loads past the end masked
    monkeypatch.setattr(paged_attention, "DECODE_PREFETCH_UNSPLIT", prefetch)
    args, kw, ref = long_and_short
    out = paged_attention.decode(*args, num_splits=1, block_n=16, **kw)
    torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the Triton interpreter computes bfloat16 wrongly (numpy has no bfloat16)"))])
@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_half_precision_kernels(dtype, fmt):
    lens, qlens = [37, 5], [37, 2]
    q, kc, vc, bt, sl, qsl, kw = build(lens, qlens, 4, 2, 32, 16, dtype, fmt)
    ref = paged_attention.reference(q, kc, vc, bt, sl, qsl, 0.2, **kw)
    out = paged_attention.prefill(q, kc, vc, bt, sl, qsl, 37, 0.2, block_m=16, block_n=16, **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("hardware", [False, True], ids=["bits", "cvt"])
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_every_fp8_code_reads_back_exactly(name, hardware, monkeypatch):
    """One cached key: attention returns its value row, so the kernels' fp8 reading (the code's bits as an
    fp16 and 2^(15 - bias) applied once to the output, or the sm89+ conversion instruction; the scale
    applied once either way) must give every finite code's value, subnormals included, as torch's float8
    cast does."""
    if hardware and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the fp8 conversion instruction needs sm89+")
    monkeypatch.setattr(paged_kv, "HARDWARE_FP8_READ", hardware)
    fmt = paged_kv.FP8_FORMATS[name]
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.where(torch.isfinite(codes.view(fmt.torch_dtype).float()), codes, torch.zeros_like(codes))
    v_cache = torch.zeros(1, 8, 1, 256, dtype=torch.uint8)
    v_cache[0, 0, 0] = codes
    k_cache = torch.randint(0, 0x70, (1, 8, 1, 256), dtype=torch.uint8)
    scale = torch.tensor([0.37], device=DEVICE)
    args = [k_cache.to(DEVICE), v_cache.to(DEVICE), torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE)]
    q = torch.randn(1, 2, 256, device=DEVICE)
    want = (codes.view(fmt.torch_dtype).float() * 0.37).to(DEVICE).expand(1, 2, 256)
    kw = dict(k_scale=scale, v_scale=scale, fmt=fmt)
    decoded = paged_attention.decode(q, *args, 0.1, num_splits=2, block_n=16, **kw)
    start = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    prefilled = paged_attention.prefill(q, *args, start, 1, 0.1, block_m=16, block_n=16, **kw)
    torch.testing.assert_close(decoded, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(prefilled, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_bit_conversion_equals_torch_cast(name):
    """The kernel's bit-op quantization (sm75-safe) gives exactly torch's float8 codes, incl.
    subnormals, zeros of both signs, saturation and ties."""
    fmt = paged_kv.FP8_FORMATS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3968, generator=g) * 10.0 ** torch.randint(-7, 5, (3968,), generator=g).float()
    every_code = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
    special = torch.tensor([0.0, -0.0, 1e9, -1e9, fmt.max, -fmt.max, 2.0 ** -10, 2.0 ** -17, 3 * 2.0 ** -10])
    x = torch.cat([x, every_code[torch.isfinite(every_code)], special])
    x = torch.cat([x, torch.zeros(-x.numel() % 32)]).reshape(-1, 2, 16).to(DEVICE)
    scale = torch.tensor([1.0, 0.5], device=DEVICE)
    slot = torch.arange(x.shape[0], device=DEVICE)
    caches = [torch.zeros(x.shape[0], 1, 2, 16, dtype=torch.uint8, device=DEVICE) for _ in range(4)]
    paged_kv.store(x, x, caches[0], caches[1], slot, scale, scale, fmt)
    paged_kv.reference_store(x, x, caches[2], caches[3], slot, scale, scale, fmt)
    assert torch.equal(caches[0], caches[2])


@pytest.mark.parametrize("name,max_bound,mean_bound", [("fp8_e4m3", 2 ** -4, 2 ** -4), ("fp8_e5m2", 2 ** -3, 2 ** -3)])
def test_fp8_kv_attention_error_vs_fp32(name, max_bound, mean_bound):
    """Stated bound: with amax-calibrated scales (the engine's rule: amax/200 for K, amax/100 for V),
    attention over an fp8 cache differs from fp32 attention by at most half an fp8 ulp relative to the
    output's largest magnitude (e4m3, 3 mantissa bits: 2^-4; e5m2: 2^-3), and so does the mean error
    relative to the mean magnitude. Measured here: e4m3 4.9% max / 3.3% mean, e5m2 7.5% / 6.5%."""
    lens, qlens = [70, 31], [70, 1]
    q, kc, vc, bt, sl, qsl, _ = build(lens, qlens, 4, 2, 32, 16, torch.float32, seed=3)
    ref = paged_attention.reference(q, kc, vc, bt, sl, qsl, 32 ** -0.5)
    fmt = paged_kv.FP8_FORMATS[name]
    hk = kc.shape[2]
    k_scale = (kc.abs().amax() / 200).expand(hk).contiguous()
    v_scale = (vc.abs().amax() / 100).expand(hk).contiguous()
    flat = lambda c: c.view(-1, *c.shape[2:])
    kq = paged_kv.quantize(flat(kc), k_scale, fmt).view(kc.shape)
    vq = paged_kv.quantize(flat(vc), v_scale, fmt).view(vc.shape)
    out = paged_attention.prefill(q, kq, vq, bt, sl, qsl, 70, 32 ** -0.5, k_scale=k_scale, v_scale=v_scale,
                                  fmt=fmt, block_m=16, block_n=16)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    mean = ((out - ref).abs().mean() / ref.abs().mean()).item()
    assert err < max_bound and mean < mean_bound, f"{name}: relative error max {err:.4f}, mean {mean:.4f}"
