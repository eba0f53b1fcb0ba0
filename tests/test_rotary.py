import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001
from quanta.kernels import rotary


@pytest.mark.parametrize("t,hq,hk,d", [(1, 4, 2, 64), (7, 3, 1, 128), (5, 32, 8, 128), (2, 5, 5, 96)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
def test_rotary(t, hq, hk, d, dtype):
    q = torch.randn(t, hq, d).to(DEVICE, dtype)
    k = torch.randn(t, hk, d).to(DEVICE, dtype)
    pos = torch.randint(0, 8192, (t,)).to(DEVICE)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)
    for got, want in zip(rotary.rotary(q, k, pos, inv_freq), rotary.reference(q, k, pos, inv_freq)):
        assert got.shape == want.shape and rel_err(got, want) < TOL[dtype] if dtype != torch.float32 \
            else rel_err(got, want) < 1e-4      # fp32: libdevice vs torch sin/cos of angles up to 8192


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_rotary_and_store_equals_rotary_then_store(fmt, dtype):
    """The fused launch writes the caches exactly as rotary + paged_kv.store do (padding slot: nowhere)."""
    from quanta.kernels import paged_kv
    t, hq, hk, d, slots = 5, 6, 2, 64, 32
    q = torch.randn(t, hq, d).to(DEVICE, dtype)
    kv = torch.randn(t, 2 * hk, d).to(DEVICE, dtype)             # k and v as strided views, as the engine has
    k, v = kv[:, :hk], kv[:, hk:]
    pos = torch.randint(0, 4096, (t,)).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)
    slot = torch.tensor([3, 17, -1, 0, 31]).to(DEVICE)
    form = paged_kv.FP8_FORMATS[fmt] if fmt else None
    scales = ((torch.rand(hk) + 0.5).to(DEVICE), (torch.rand(hk) + 0.5).to(DEVICE)) if fmt else (None, None)

    def caches():
        store = torch.uint8 if fmt else dtype
        return [torch.zeros(slots // 16, 16, hk, d, dtype=store, device=DEVICE) for _ in range(2)]
    kc, vc = caches()
    q_fused = rotary.rotary_and_store(q, k, v, pos, inv_freq, kc, vc, slot, *scales, form)
    kc2, vc2 = caches()
    q_rot, k_rot = rotary.rotary(q, k, pos, inv_freq)
    paged_kv.store(k_rot, v.contiguous(), kc2, vc2, slot, *scales, form)
    assert torch.equal(q_fused, q_rot)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert kc.view(-1, hk, d)[slot[slot >= 0]].ne(0).any()


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
@pytest.mark.parametrize("rows,block_n,min_tiles", [(1, 128, 1), (2, 256, 2)], ids=["split-k", "two-rows"])
def test_gemv_rope_epilogue_equals_gemv_then_rotary_and_store(fmt, rows, block_n, min_tiles):
    """The qkv GEMV with the rotary + KV-store epilogue leaves q and the caches exactly as the GEMV and then
    rotary_and_store do: whole heads per program, a head straddling no region, split-K's last program finishing."""
    from quanta.kernels import affine
    from quanta.kernels.affine import gemv
    from quanta.quant.kinds.affine import Affine
    hq, hk, d, k_in = 3, 2, 64, 512                 # 3 q heads: programs straddle q and k, k and v
    n = (hq + 2 * hk) * d
    g = torch.Generator().manual_seed(0)
    w = Affine(codes=torch.randint(0, 16, (n, k_in), generator=g, dtype=torch.uint8),
               scales=torch.rand(n, k_in // 128, generator=g) * 0.02 + 0.002, bits=4, group_size=128, zeros=8)
    st = affine.prepare(w.to(DEVICE), DEVICE, torch.float16)
    x = torch.randn(rows, k_in, generator=g).to(DEVICE, torch.float16)
    config = gemv.GemvConfig(block_n, 8, 2, 64.0, min_tiles)            # 64.0 waves: K split into 4 or 2 programs

    def fused(rope):
        assert gemv.rope_applies(st, rope, config)
        return gemv.matmul(x, st, config=config, rope=rope)
    check_rope_epilogue(fused, lambda: gemv.matmul(x, st, config=config), rows, hq, hk, d, fmt, g)


def check_rope_epilogue(fused, plain, rows: int, hq: int, hk: int, d: int, fmt: str | None, g: torch.Generator,
                        slots: int = 32) -> None:
    """A GEMM over W = [q; k; v] with the rotary + KV-store epilogue, fused(rope) -> [rows, N], leaves q and the
    caches exactly as the GEMM without it, plain() -> [rows, N], then rotary_and_store do."""
    from quanta.kernels import paged_kv
    pos = torch.tensor([7, 4000][:rows]).to(DEVICE)
    slot = torch.tensor([5, 30][:rows]).to(DEVICE)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)
    form = paged_kv.FP8_FORMATS[fmt] if fmt else None
    scales = ((torch.rand(hk, generator=g) + 0.5).to(DEVICE), (torch.rand(hk, generator=g) + 0.5).to(DEVICE)) \
        if fmt else (None, None)

    def caches():
        return [torch.zeros(slots // 16, 16, hk, d, dtype=torch.uint8 if fmt else torch.float16, device=DEVICE)
                for _ in range(2)]
    kc, vc = caches()
    q_fused = fused(rotary.RopeStore(pos, inv_freq, hq * d, hk * d, d, kc, vc, slot, *scales, form))[:, :hq * d]
    y = plain().view(rows, hq + 2 * hk, d)
    kc2, vc2 = caches()
    q_ref = rotary.rotary_and_store(y[:, :hq], y[:, hq:hq + hk], y[:, hq + hk:], pos, inv_freq, kc2, vc2, slot,
                                    *scales, form)
    assert torch.equal(q_fused.reshape(rows, hq, d), q_ref)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc.ne(0).any() and vc.ne(0).any()
