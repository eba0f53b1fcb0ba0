"""The register-operand MMA kernel (affine/mma.py) against the weights' own dequantize(): every mode (affine
int4/int8 with symmetric, integer and float zeros, act-order, narrow groups, bias; NF4/FP4 tables; fp8), the
fp16 pair decoding in PTX (run by tests/ptx_emulator.py on the CPU) and the per-element decoding."""
import dataclasses

import pytest
import torch

from kernel_util import DEVICE, TOL, interpreter_bf16_dot, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
import ptx_emulator
from quanta.kernels import affine, codebook_gemm, fp8_gemm
from quanta.kernels.affine import layout, mma, plan
from quanta.kernels.device_caps import device_caps
from quanta.kernels.triton_support import tl, triton
from quanta.quant.kinds.codebook import FP4_TABLE, NF4_TABLE
from test_affine_gemm import CASES, LLAMA, make_affine
from test_codebook_gemm import make_codebook
from test_fp8_gemm import make_fp8


def with_sms(sms: int):
    """This device's caps with another SM count (how many programs the launches plan for)."""
    return dataclasses.replace(device_caps(DEVICE), sm_count=sms)


def check(w, st, m, dtype, h2=None, bias=False, config=None, seed=1, stream=None, caps=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, w.shape[1], generator=g).to(DEVICE, dtype)
    b = (torch.randn(w.shape[0], generator=g) * 0.1).to(DEVICE, dtype) if bias else None
    y = mma.matmul(x, st, b, config=config, h2=h2, stream=stream, caps=caps)
    ref = x.double() @ w.dequantize().double().T + (b.double() if bias else 0)
    assert y.shape == (m, w.shape[0]) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype], rel_err(y, ref)
    return y


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("m,config", [(3, (16, 3, 1.0, 1, 4, 16)), (40, (32, 2, 64.0, 1, 4, 16)),
                                      (130, (128, 2, 1.0, 1, 8, 16)), (9, (16, 3, 8.0, 1, 4, 32)),
                                      (17, (32, 2, 1.0, 1, 4, 64))],
                         ids=["m3-one-split", "m40-two-m-blocks-split-k", "m130-two-warpgroups",
                              "m9-32-rows-a-warp", "m17-64-rows-a-warp"])
@pytest.mark.parametrize("h2", [True, False], ids=["pairs-in-ptx", "per-element"])
def test_affine_matches_dequantize(case, m, config, h2, monkeypatch):
    ptx_emulator.install(monkeypatch)
    w = make_affine(*case)
    st = affine.prepare(w, DEVICE, torch.float16)
    check(w, st, m, torch.float16, h2=h2, bias=m in (3, 17), config=config)


@pytest.mark.parametrize("case,m,sms", [((136, 896, 4, 128, "asym", False), 40, 4),
                                        ((136, 896, 4, 32, "fmin", True), 40, 4),
                                        ((73, 213, 4, 32, "sym", False), 20, 64)],
                         ids=["whole-wave-then-runs-across-tiles", "act-order-narrow-groups", "stream-only"])
@pytest.mark.parametrize("config", [None, (16, 2, 2.0, 1, 4, 32)], ids=["whole-waves", "two-programs-an-sm"])
def test_stream_k_matches_dequantize(case, m, sms, config, monkeypatch):
    """Stream-K: with 4 SMs the 6 output tiles (3 column blocks x 2 M blocks) of 7 K tiles are one whole wave of
    4 tiles, then 4 programs of 4 (tile, K tile) steps over the other two, runs that cross a tile boundary; with
    64 SMs every tile is streamed. Bias once per tile, from the run that holds its K tile 0."""
    ptx_emulator.install(monkeypatch)
    w = make_affine(*case)
    st = affine.prepare(w, DEVICE, torch.float16)
    if config is None:
        config = (32, 2, None, 1, 4, 16) if m > 20 else (16, 2, None, 1, 4, 16)
    check(w, st, m, torch.float16, bias=True, config=config, stream=True, caps=with_sms(sms))


@pytest.mark.parametrize("m", [4, 20, 64])
@pytest.mark.parametrize("sms,rows", [(1, 64), (132, 16)], ids=["blocks-fill-the-sms", "too-few-blocks"])
def test_default_configs(m, sms, rows, monkeypatch):
    """The launcher's own config for each M bucket, bias included: 64 weight rows a warp up to M = 64, or 16 where
    256-row blocks would not fill the SMs (the 2 here fill 1 SM, not 132)."""
    ptx_emulator.install(monkeypatch)
    w = make_affine(300, 384, 4, 128, "asym")
    st = affine.prepare(w, DEVICE, torch.float16)
    assert mma.default_config(st, with_sms(sms), m).rows_a_warp == rows
    check(w, st, m, torch.float16, bias=True, caps=with_sms(sms))


def test_pairs_in_ptx_equal_per_element_decoding(monkeypatch):
    """Symmetric codes: both decode (q - zero) exactly and round its product with the scale once, so the
    weights agree to the last bit and so do the outputs (same MMA order). (With zbias the per-element path
    rounds twice in the interpreter, once in the GPU's fused multiply-add.)"""
    ptx_emulator.install(monkeypatch)
    w = make_affine(96, 512, 4, 128, "sym")
    st = affine.prepare(w, DEVICE, torch.float16)
    pairs = check(w, st, 5, torch.float16, h2=True, config=(16, 3, 1.0, 1, 4, 16))
    single = check(w, st, 5, torch.float16, h2=False, config=(16, 3, 1.0, 1, 4, 16))
    assert torch.equal(pairs, single)


@pytest.mark.parametrize("qt,n,k,blocksize,dq", [("nf4", 72, 256, 64, True), ("fp4", 72, 256, 32, False),
                                                 ("nf4", 40, 384, 128, False), ("nf4", 33, 160, 16, True),
                                                 ("fp4", 24, 288, 48, False)])
@pytest.mark.parametrize("m,config", [(6, (16, 3, 1.0, 1, 4, 16)), (19, (32, 2, 64.0, 1, 4, 32)),
                                      (5, (16, 3, 8.0, 1, 4, 64)), (1, (16, 3, 4.0, 1, 4, 64))],
                         ids=["m6-one-split", "m19-split-k-32-rows-a-warp", "m5-64-rows-a-warp", "m1-split-k"])
@pytest.mark.parametrize("h2", [True, False], ids=["lookup-in-ptx", "per-element"])
def test_table_codes(qt, n, k, blocksize, dq, m, config, h2, monkeypatch):
    """NF4 / FP4 codes: looked up four at a time by byte permutes (groups of 16..128 columns, and 48, which
    begins mid-pair), or gathered per element."""
    ptx_emulator.install(monkeypatch)
    w = make_codebook(n, k, blocksize, qt, dq)
    check(w, codebook_gemm.prepare(w, DEVICE, torch.float16), m, torch.float16, h2=h2, config=config)


@triton.jit
def _lookup_kernel(w_ptr, s_ptr, lut_ptr, out_ptr, BN: tl.constexpr, R: tl.constexpr):
    """out[i, n, r] = the weight of code i of word (n, r), by mma._table_pairs."""
    offs = tl.arange(0, BN)[:, None] * R + tl.arange(0, R)[None, :]
    p = tl.load(w_ptr + offs)
    s0 = tl.load(s_ptr + tl.arange(0, BN))
    s1 = tl.load(s_ptr + BN + tl.arange(0, BN))
    lut = layout.load_lut_words(lut_ptr)
    for j in tl.static_range(4):
        w0, w1 = mma._table_pairs(p, j, lut, s0, s1, R, BN, out_ptr.dtype.element_ty)
        tl.store(out_ptr + (2 * j) * BN * R + offs, w0)
        tl.store(out_ptr + (2 * j + 1) * BN * R + offs, w1)


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_table_lookup_is_the_rounded_product(qt, dtype, monkeypatch):
    """The byte-permute lookup of every code at every nibble of a word, bit for bit: code i of word (n, r) becomes
    table[code] in the dtype times its pair's scale, rounded once to the dtype (codes 2j with s0, 2j + 1 with s1)."""
    ptx_emulator.install(monkeypatch)
    g = torch.Generator().manual_seed(3)
    bn, r = 32, 16
    codes = torch.randint(0, 16, (8, bn, r), generator=g)
    codes[:, 0, :] = torch.arange(16)                             # every code at every position
    words = sum(codes[i].long() << (4 * i) for i in range(8))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scales = (torch.rand(2, bn, generator=g) * 0.1 + 0.01).to(dtype)
    table = torch.tensor(NF4_TABLE if qt == "nf4" else FP4_TABLE)
    out = torch.empty(8, bn, r, dtype=dtype, device=DEVICE)
    _lookup_kernel[(1,)](words.to(DEVICE), scales.to(DEVICE), layout.lut_byte_words(table, dtype).to(DEVICE),
                         out, BN=bn, R=r)
    entries = table.to(dtype).float()[codes]                       # [8, bn, r]
    expect = (entries * scales.float()[torch.arange(8) % 2][:, :, None]).to(dtype)
    assert torch.equal(out.cpu().view(torch.int16), expect.view(torch.int16))


@pytest.mark.skipif(DEVICE != "cpu", reason="on sm89+ fp8_gemm.prepare makes a W8A8 state")
@pytest.mark.parametrize("fmt,strategy", [("e4m3", "channel"), ("e5m2", "block")])
def test_fp8_weight_only(fmt, strategy):
    w = make_fp8(130, 300, fmt, strategy)
    check(w, fp8_gemm.prepare(w, DEVICE, torch.float16), 4, torch.float16, config=(16, 3, 1.0, 1, 4, 16))


@triton.jit
def _pairs_kernel(w_ptr, s_ptr, zb_ptr, out_ptr, BITS: tl.constexpr, ZERO: tl.constexpr, HAS_ZB: tl.constexpr,
                  BN: tl.constexpr, R: tl.constexpr):
    """out[i, n, r] = the weight of code i of word (n, r), by mma._h2_codes."""
    offs = tl.arange(0, BN)[:, None] * R + tl.arange(0, R)[None, :]
    p = tl.load(w_ptr + offs)
    s = tl.load(s_ptr + tl.arange(0, BN))
    zb = tl.load(zb_ptr + tl.arange(0, BN))
    for i in tl.static_range(32 // BITS):
        w = mma._h2_codes(p, i, s, zb, BITS, ZERO, HAS_ZB, R, out_ptr.dtype.element_ty, BN)
        tl.store(out_ptr + i * BN * R + offs, w)


@pytest.mark.parametrize("bits,dtype", [(4, torch.float16), (8, torch.float16), (4, torch.bfloat16)],
                         ids=["int4-f16", "int8-f16", "int4-bf16"])
@pytest.mark.parametrize("zbias", [False, True], ids=["sym", "zbias"])
def test_pairs_are_the_rounded_product(bits, dtype, zbias, monkeypatch):
    """The pair decoding of every code at every position of a word, bit for bit: (code - zero) x scale rounded once
    to the dtype, or code x scale + zbias (one fused multiply-add) with float zeros. bf16 shifts a high nibble
    down before its magic number; fp16 divides it by 16 in the exact fma."""
    ptx_emulator.install(monkeypatch)
    g = torch.Generator().manual_seed(5)
    bn, r, pack, zero = 32, 16, 32 // bits, 1 << (bits - 1)
    codes = torch.randint(0, 1 << bits, (pack, bn, r), generator=g)
    codes[:, 0, :] = torch.arange(r) % (1 << bits)                  # low and high codes at every position
    codes[:, 1, :] = (1 << bits) - 1 - torch.arange(r) % (1 << bits)
    words = sum(codes[i].long() << (bits * i) for i in range(pack))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    s = (torch.rand(bn, generator=g) * 0.1 + 0.01).to(dtype)
    zb = (-s.float() * torch.randint(0, 1 << bits, (bn,), generator=g) - torch.rand(bn, generator=g) * 0.01).to(dtype)
    out = torch.empty(pack, bn, r, dtype=dtype, device=DEVICE)
    _pairs_kernel[(1,)](words.to(DEVICE), s.to(DEVICE), zb.to(DEVICE), out, BITS=bits, ZERO=zero, HAS_ZB=zbias,
                        BN=bn, R=r)
    s64, zb64 = s.double()[:, None], zb.double()[:, None]
    expect = (codes * s64 + zb64 if zbias else (codes - zero) * s64).to(dtype)
    assert torch.equal(out.cpu().view(torch.int16), expect.view(torch.int16))


@pytest.mark.skipif(interpreter_bf16_dot(), reason="interpreter bf16 tl.dot is wrong; covered by the GPU run")
def test_bf16_int8_decodes_per_element():
    w = make_affine(64, 256, 8, 128, "asym")
    st = affine.prepare(w, DEVICE, torch.bfloat16)
    assert not mma.h2_applies(st)
    check(w, st, 7, torch.bfloat16)


def test_pairs_refuse_what_they_cannot_decode():
    """bf16 8-bit codes: 256 values do not fit beside a magic number in bf16's 7-bit mantissa."""
    st = affine.prepare(make_affine(64, 256, 8, 128, "sym"), DEVICE, torch.bfloat16)
    with pytest.raises(AssertionError):
        mma.matmul(torch.randn(3, 256).to(DEVICE, torch.bfloat16), st, h2=True)
    assert mma.h2_applies(affine.prepare(make_affine(64, 256, 4, 128, "sym"), DEVICE, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [3, 16, 64, 128, 300])
@pytest.mark.parametrize("bits,group,zero", [(4, 128, "sym"), (4, 128, "asym"), (8, -1, "sym"), (4, 32, "fmin")])
def test_gpu_llama_shapes(n, k, m, bits, group, zero):
    w = make_affine(n, k, bits, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, affine.prepare(w, "cuda", dtype), m, dtype, bias=m == 16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [256, 300])
def test_gpu_stream_k(n, k, m):
    w = make_affine(n, k, 4, 128, "asym", device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, affine.prepare(w, "cuda", dtype), m, dtype, bias=True, stream=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("config,stream", [((16, 3, 4.0, 4, 4, 32), False), ((32, 3, 2.0, 1, 8, 32), True)],
                         ids=["32-rows", "8-warps-stream"])
def test_gpu_rows_a_warp(n, k, config, stream):
    """Configs the defaults do not use (64 rows a warp in 4 warps are test_gpu_llama_shapes' M <= 64)."""
    w = make_affine(n, k, 4, 128, "asym", device="cuda")
    check(w, affine.prepare(w, "cuda", torch.float16), 16, torch.float16, bias=True, config=config,
          stream=stream)


@pytest.mark.gpu
def test_gpu_plan_takes_this_path_for_affine_and_table_codes():
    caps = device_caps("cuda")

    def paths(st, ms):
        return [plan.choose(st, caps, m).path.name for m in ms]

    st = affine.prepare(make_affine(4096, 4096, 4, 128, "sym", device="cuda"), "cuda", torch.float16)
    hopper = caps.capability == (9, 0) and caps.gluon
    expect = ["gemv", "wgmma", "wgmma", "wgmma", "cublas"] if hopper else ["gemv", "splitk", "splitk", "cublas",
                                                                            "cublas"]
    assert paths(st, (1, 3, 33, 1024, 1025)) == expect                                   # 4-bit g128: wgmma
    w8 = affine.prepare(make_affine(4096, 4096, 8, 128, "sym", device="cuda"), "cuda", torch.float16)
    expect = ["wgmma", "mma", "cublas"] if hopper else ["splitk", "cublas", "cublas"]     # fp16 8-bit: to M = 256
    assert paths(w8, (33, 512, 513)) == expect
    assert paths(st, (2,)) == ["wgmma" if hopper else "gemv"]
    nf4 = codebook_gemm.prepare(make_codebook(4096, 4096, device="cuda"), "cuda", torch.float16)
    expect = ["gemv", "mma", "mma", "cublas"] if hopper else ["gemv", "gemv", "cublas", "cublas"]
    assert paths(nf4, (1, 2, 512, 513)) == expect
    nf4 = codebook_gemm.prepare(make_codebook(4096, 4096, device="cuda"), "cuda", torch.bfloat16)
    assert paths(nf4, (1, 2)) == (["mma"] * 2 if hopper else ["gemv", "cublas"])


def test_table_codes_take_32_rows_a_warp_above_m32():
    """M = 33..64 of table codes take 32 weight rows a warp (64 spill the lookup's registers); affine codes 64.
    (Which M the plan gives this kernel: test_affine_plan.)"""
    caps = with_sms(1)
    big = codebook_gemm.prepare(make_codebook(1024, 1024), DEVICE, torch.float16)   # 4 blocks of 256 rows
    assert [mma.default_config(big, caps, m).rows_a_warp for m in (32, 33, 64)] == [64, 32, 32]
    big = affine.prepare(make_affine(1024, 1024, 4, 128, "sym"), DEVICE, torch.float16)
    assert mma.default_config(big, caps, 64).rows_a_warp == 64


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [1, 2, 16, 64, 300])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_gpu_table_codes_llama_shapes(n, k, m, blocksize):
    """NF4 (double-quantized absmax, as bnb stores it) on the default configs, fp16 and bf16, looked up in PTX."""
    w = make_codebook(n, k, blocksize, "nf4", True, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, codebook_gemm.prepare(w, "cuda", dtype), m, dtype, bias=m == 16)


@pytest.mark.gpu
def test_gpu_act_order_and_tables():
    w = make_affine(4096, 4096, 4, 128, "asym", act_order=True, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, affine.prepare(w, "cuda", dtype), 24, dtype)
    nf4 = make_codebook(4096, 4096, 64, "nf4", True, device="cuda")
    check(nf4, codebook_gemm.prepare(nf4, "cuda", torch.float16), 8, torch.float16)
