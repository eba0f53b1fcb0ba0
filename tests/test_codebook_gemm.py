"""NF4 / FP4 kernels (the affine kernels with a table) against Codebook.dequantize()."""
import pytest
import torch

from kernel_util import DEVICE, TOL, bf16_rounds_to_nearest, interpreter_bf16_dot, rel_err  # noqa: I001
from quanta.kernels import codebook_gemm
from quanta.kernels.affine import cublas, plan
from quanta.kernels.device_caps import PRESETS, device_caps
from quanta.quant.kinds.codebook import FP4_TABLE, NF4_TABLE, Codebook


def make_codebook(n, k, blocksize=64, quant_type="nf4", double_quant=False, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n * k // blocksize)
    table = torch.tensor(NF4_TABLE if quant_type == "nf4" else FP4_TABLE)
    kw = dict(absmax=torch.rand(blocks, generator=g) * 0.05 + 0.01)
    if double_quant:
        nested = -(-blocks // 256)
        kw = dict(absmax=torch.randint(0, 256, (blocks,), generator=g, dtype=torch.uint8),
                  nested_table=torch.linspace(-1, 1, 256), nested_absmax=torch.rand(nested, generator=g) * 0.05,
                  nested_offset=0.03)
    w = Codebook(codes=torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), table=table,
                 blocksize=blocksize, quant_type=quant_type, **kw)
    return w.to(device)


@pytest.mark.parametrize("n,k,blocksize,qt,dq", [(72, 256, 64, "nf4", False), (73, 192, 64, "fp4", True),
                                                 (40, 384, 128, "nf4", True), (33, 160, 32, "nf4", False)])
@pytest.mark.parametrize("path,m", [("gemv", 1), ("splitk", 5), ("cublas", 3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_codebook_paths(n, k, blocksize, qt, dq, path, m, dtype):
    if dtype == torch.bfloat16 and path == "splitk" and interpreter_bf16_dot():
        pytest.skip("interpreter bf16 tl.dot is wrong; covered by the GPU run")
    w = make_codebook(n, k, blocksize, qt, dq)
    st = codebook_gemm.prepare(w, DEVICE, dtype)
    x = torch.randn(m, k).to(DEVICE, dtype)
    ref = x.double() @ w.dequantize().double().T
    assert rel_err(plan.matmul(x, st, path=path), ref) < TOL[dtype]


@pytest.mark.parametrize("n,k,blocksize,qt,dq", [(72, 256, 64, "nf4", True), (73, 192, 32, "fp4", False),
                                                 (40, 384, 128, "nf4", False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_dequantize_by_lookup(n, k, blocksize, qt, dq, dtype, monkeypatch):
    """The dequantize kernel's byte-permute lookup (the cuBLAS path's on CUDA): each weight is its code's table entry
    in the dtype times its block's scale, rounded once (bit for bit in fp16; the interpreter truncates to bf16), and
    close to Codebook.dequantize()."""
    import ptx_emulator
    ptx_emulator.install(monkeypatch)
    w = make_codebook(n, k, blocksize, qt, dq)
    st = codebook_gemm.prepare(w, DEVICE, dtype)
    got = cublas.dequantize_t(st, cublas.DequantConfig(block_n=32), lookup=True).t()
    scales = w.block_absmax().reshape(n, k // blocksize).to(dtype).float().repeat_interleave(blocksize, 1)
    expect = (w.table.to(dtype).float()[w.codes.long()] * scales).to(dtype)
    if dtype == torch.float16 or bf16_rounds_to_nearest():
        assert torch.equal(got.view(torch.int16), expect.view(torch.int16))
    assert rel_err(got, w.dequantize()) < TOL[dtype] / 4


@pytest.mark.parametrize("caps", ["sm80", "sm89"])
def test_plan_takes_cublas_above_the_gemv(caps):
    """Table codes where the MMA kernel does not run (off sm90): the GEMV up to M = 2 where its byte-permute
    lookup runs (fp16), else up to M = 1; above, dequantize + cuBLAS (faster than the split-K kernel's per-code
    gather). (On sm90, test_affine_plan.)"""
    caps = PRESETS[caps]
    st = codebook_gemm.prepare(make_codebook(64, 256), DEVICE, torch.float16)
    assert [plan.choose(st, caps, m).path.name for m in (1, 2, 3, 16, 128, 1024)] == ["gemv"] * 2 + ["cublas"] * 4
    st = codebook_gemm.prepare(make_codebook(64, 256), DEVICE, torch.bfloat16)
    assert [plan.choose(st, caps, m).path.name for m in (1, 2, 16)] == ["gemv", "cublas", "cublas"]
    name, reason = codebook_gemm.path(st, 2)                        # on this device
    assert name == "triton_codebook/" + plan.choose(st, device_caps(DEVICE), 2).path.name and reason


def test_blocks_across_rows_fall_back():
    w = make_codebook(3, 96, blocksize=64)        # 288 weights: blocks straddle rows
    assert "straddle" in codebook_gemm.supports(w, torch.device("cuda"), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 256])
def test_gpu_nf4_llama(n, k, m):
    w = make_codebook(n, k, 64, "nf4", True, device="cuda")
    st = codebook_gemm.prepare(w, "cuda", torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    assert rel_err(codebook_gemm.apply(x, st), x.double() @ w.dequantize().double().T) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,blocksize", [(28672, 4096, 64), (4096, 14336, 64), (6144, 4096, 128)])
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_nf4_packed_half_gemv(n, k, blocksize, m):
    """The byte-permute table lookup (off by default until measured) on the real PTX, at Llama shapes."""
    from quanta.kernels.affine import gemv
    w = make_codebook(n, k, blocksize, "nf4", True, device="cuda")
    st = codebook_gemm.prepare(w, "cuda", torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    ref = x.double() @ w.dequantize().double().T
    assert rel_err(gemv.matmul(x, st, h2=True), ref) < TOL[torch.float16]


def _iq4(name, n, k, seed=0, device=DEVICE):
    from test_ggml_gemm import make_gguf
    w, ref = make_gguf(n, k, name.upper(), seed=seed, device=device)
    return w, ref.to(device)


IQ4 = ["iq4_nl", "iq4_xs"]
IQ4_K = {"iq4_nl": 288, "iq4_xs": 512}        # IQ4_NL: 9 blocks (a partial last tile); IQ4_XS: 2 super-blocks


@pytest.mark.parametrize("name", IQ4)
def test_iq4_codebook_form_is_exact(name):
    """GGUF IQ4 as a codebook (kvalues / 128, its blocks' scales by 128): every weight the `gguf` package's
    dequantization, in float32 and rounded to fp16; the kernels' layout holds the file's bytes (4-bit codes, and an
    fp16 scale a block of 32, or IQ4_XS's d and 6-bit scales in two words a super-block)."""
    w, ref = _iq4(name, 40, IQ4_K[name], seed=3)
    cb = w.to_codebook()
    assert torch.equal(cb.dequantize(torch.float32), ref)
    assert torch.equal(cb.dequantize(torch.float16), ref.half())
    w, _ = _iq4(name, 40, 512)                                   # K a whole number of tiles: no padding
    st = codebook_gemm.prepare(w, DEVICE, torch.float16)
    assert st.group_size == 32 and st.packed.numel() * 4 + st.sz.numel() * 4 == w.nbytes


def test_iq4_xs_scale_words_give_each_groups_scale(monkeypatch):
    """The dequantize kernel (its table lookup by the emulator, scales by load_scales' super-scaled words) gives
    IQ4_XS's weights: gguf's, within the fp16 roundings of the scale d * (ls - 32) and of the weight."""
    import ptx_emulator
    ptx_emulator.install(monkeypatch)
    w, ref = _iq4("iq4_xs", 24, 512, seed=5)
    st = codebook_gemm.prepare(w, DEVICE, torch.float16)
    got = cublas.dequantize_t(st, cublas.DequantConfig(block_n=32), lookup=True).t()
    assert rel_err(got, ref) < 1e-3


@pytest.mark.parametrize("name", IQ4)
@pytest.mark.parametrize("path,m,h2", [("gemv", 1, True), ("gemv", 2, True), ("gemv", 1, False), ("splitk", 5, None),
                                       ("cublas", 3, None)])
def test_iq4_on_the_codebook_paths(name, path, m, h2, monkeypatch):
    """IQ4 through the table kernels (the GEMV's four packed sums a tile for groups of 32, its PTX run by the
    emulator) against the `gguf` package's dequantization."""
    import ptx_emulator
    from quanta.kernels.affine import gemv
    ptx_emulator.install(monkeypatch)
    k = IQ4_K[name]
    w, ref = _iq4(name, 40, k, seed=m)
    st = codebook_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    y = gemv.matmul(x, st, config=(32, 8, 2, 64.0, 1), h2=h2) if path == "gemv" else plan.matmul(x, st, path=path)
    assert rel_err(y, x.double() @ ref.double().T) < TOL[torch.float16]


@pytest.mark.parametrize("name", IQ4)
def test_iq4_takes_the_codebook_kernels_in_fp16_only(name):
    """The codebook form's scales are exact in fp16: bf16 and the other ggml types are refused with the reason."""
    w, _ = _iq4(name, 8, 256)
    assert "fp16" in codebook_gemm.supports(w, torch.device("cuda"), torch.bfloat16)
    from test_ggml_gemm import make_gguf
    q4k, _ = make_gguf(8, 256, "Q4_K")
    assert "no codebook form" in codebook_gemm.supports(q4k, torch.device("cuda"), torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", IQ4)
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 2, 16, 256])
def test_gpu_iq4_llama(name, n, k, m):
    """IQ4 on the planned codebook path at Llama-3-8B shapes (the GEMV's groups of 32 at M = 1, the MMA kernel, the
    dequantize kernel) against gguf."""
    w, ref = _iq4(name, n, k, device="cuda")
    st = codebook_gemm.prepare(w, "cuda", torch.float16)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    assert rel_err(codebook_gemm.apply(x, st), x.double() @ ref.double().T) < TOL[torch.float16]
