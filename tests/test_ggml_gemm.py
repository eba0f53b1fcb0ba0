"""GGUF K-quant, IQ4 and 32-value block weights on the ggml kernels (kernels/ggml_gemm.py), against the `gguf`
package's own dequantization of the same bytes: random valid blocks (random bytes, the fp16 d / dmin fields set to
small finite values), every path, held at the file's bytes."""
import types
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
import ptx_emulator
from quanta.kernels import ggml_gemm, registry
from quanta.kernels.affine.layout import Affine
from quanta.kernels.device_caps import PRESETS, device_caps
from quanta.kernels.ggml import cublas, gemm, gemv, gemv_cols, mma, plan, wgmma
from quanta.kernels.ggml import layout
from quanta.kernels.ggml.layout import k4_scale_pairs
from quanta.planner.weight_bytes import gguf_gemm_bytes
from quanta.kernels.triton_support import tl, triton
from quanta.quant.kinds.gguf import Gguf

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
BLOCK32 = ("IQ4_NL", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# Byte offsets of each type's fp16 fields (d, and dmin / m where the type has them), from ggml-common.h: random
# bytes there could be inf or NaN.
FP16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,),
               "IQ4_NL": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}


GGML_NAME = {"q2_K": "Q2_K", "q3_K": "Q3_K", "q4_K": "Q4_K", "q5_K": "Q5_K", "q6_K": "Q6_K"}


def random_blocks(n: int, k: int, name: str, seed: int = 0) -> np.ndarray:
    """uint8 [n, k / block * type_size]: random bytes with each fp16 field in +-[2**-9, 2**-8]."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        half = rng.uniform(0.5, 1.0, (n, k // block)) * rng.choice([-1.0, 1.0], (n, k // block)) * 2.0 ** -8
        raw[:, :, at:at + 2] = half.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def make_gguf(n: int, k: int, name: str, seed: int = 0, device=DEVICE) -> tuple[Gguf, torch.Tensor]:
    """A Gguf weight of random valid blocks and the gguf package's dequantization of them (float32 [n, k])."""
    t = GGMLQuantizationType[name]
    raw = random_blocks(n, k, name, seed)
    ref = torch.from_numpy(quants.dequantize(raw, t).astype(np.float32))
    return Gguf(data=torch.from_numpy(raw).to(device), ggml_type=int(t), shape=(n, k)), ref


def shape_of(name: str) -> tuple[int, int]:
    """N = 40 (not a multiple of any BLOCK_N); K two super-blocks, or for the 32-value types 288 = 9 blocks (a
    partial last tile)."""
    return (40, 512) if name in K_QUANTS else (40, 288)


@pytest.mark.parametrize("name", K_QUANTS + BLOCK32)
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemv", 3), ("gemm", 16), ("gemm", 33), ("cublas", 5), (None, 1),
                                    (None, 5)])
def test_paths_match_the_gguf_dequantization(name, path, m):
    n, k = shape_of(name)
    w, ref = make_gguf(n, k, name, seed=m)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    y = plan.matmul(x, st, path=path)
    assert y.shape == (m, n) and y.dtype == torch.float16
    assert rel_err(y, x.double() @ ref.double().T.to(DEVICE)) < TOL[torch.float16]


@pytest.mark.parametrize("name", gemv_cols.TYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_packed_half_gemv_matches_the_gguf_dequantization(name, m, monkeypatch):
    """The column GEMV's indexing, scales and mins (its PTX's float32 twin under the interpreter; the PTX itself in
    the -m gpu tests, and here through the emulator, one row: the packed-half dots and activation pairs within
    fp16's error), whole and split over K (at super-blocks, halves and quarters: what the type's loop takes), its
    loop one, two and four steps an iteration (Q2_K, Q3_K: from two, a super-block's words loaded first), with a
    bias. Three rows of x (each a program row of the grid) on the planned and the split-K launch: the K-loop variants
    do not depend on the row, and the interpreter runs every row."""
    w, ref = make_gguf(40, 768, GGML_NAME[name], seed=m)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    want = x.double() @ ref.double().T.to(DEVICE) + bias.double()
    # planned; one program's K loop; split-K; the K loop two and four steps an iteration; splits of super-blocks'
    # halves and quarters (each of two parts; the four steps of one a quarter's single one)
    configs = (None, (16, 4, 1e-3, 1), (32, 4, 64.0, 1), (16, 4, 1e-3, 1, 2), (32, 4, 8.0, 1, 4),
               (32, 4, 64.0, 1, 1, 2), (16, 4, 64.0, 2, 2, 2), (32, 4, 64.0, 1, 4, 4), (16, 4, 64.0, 2, 1, 4))
    outputs = {config: gemv_cols.matmul(x, st, bias, config)                     # three rows: planned, split-K
               for config in (configs if m == 1 else (None, (32, 4, 64.0, 1)))}
    for config, y in outputs.items():
        assert y.dtype == torch.float16 and rel_err(y, want) < TOL[torch.float16], config
    if m == 1:                                                       # rows not 8-byte aligned: copied first
        shifted = torch.empty(m, 769, dtype=x.dtype, device=DEVICE)[:, 1:]
        shifted.copy_(x)
        assert shifted.data_ptr() % 8
        assert torch.equal(gemv_cols.matmul(shifted, st, bias), outputs[None])
    if DEVICE == "cpu" and m == 1:
        ptx_emulator.install(monkeypatch)
        y_ptx = gemv_cols.matmul(x, st, bias, None, ptx=True)
        assert rel_err(y_ptx, want) < TOL[torch.float16]


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q2_K"])
@pytest.mark.parametrize("config", [None, (32, 4, 64.0, 1)], ids=["planned", "split-k"])
def test_column_gemv_glu_epilogue_equals_the_gemv_then_silu_and_mul(name, config):
    """SwiGLU in the column-major GEMV's epilogue is the GEMV then activation.silu_and_mul, rounded as they round;
    ggml_gemm.apply_glu takes it for one row, and the GEMM then silu_and_mul for more."""
    from quanta.kernels import activation
    w, _ = make_gguf(96, 512, name, seed=11)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    fused = gemv_cols.matmul(x, st, None, config, glu=True)
    assert fused.shape == (1, 48) and torch.equal(fused, activation.silu_and_mul(gemv_cols.matmul(x, st, None, config)))
    x3 = torch.cat([x, x, x])
    assert torch.equal(ggml_gemm.apply_glu(x3, st), activation.silu_and_mul(ggml_gemm.apply(x3, st)))


@pytest.mark.parametrize("name,fmt", [("Q4_K", None), ("Q4_K", "fp8_e4m3"), ("Q6_K", None)])
def test_column_gemv_rope_epilogue_equals_the_gemv_then_rotary_and_store(name, fmt):
    """Rotary and the KV store in the column-major GEMV's epilogue leave q and the caches as the GEMV, then
    rotary_and_store (256-column programs straddle q and k, k and v)."""
    from test_rotary import check_rope_epilogue
    hq, hk, d = 3, 2, 128
    n = (hq + 2 * hk) * d
    w, _ = make_gguf(n, 512, name, seed=13)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=g).to(DEVICE, torch.float16)
    config = gemv_cols.PACKED_HALF

    def fused(rope):
        assert gemv_cols.rope_applies(st, rope, config) and not gemv_cols.rope_applies(st, rope, (64, 2, 8.0, 1))
        return gemv_cols.matmul(x, st, None, config, rope=rope)
    check_rope_epilogue(fused, lambda: gemv_cols.matmul(x, st, None, config), 1, hq, hk, d, fmt, g)


@pytest.mark.parametrize("a,b", [("Q4_K", "Q6_K"), ("Q6_K", "Q5_K"), ("Q3_K", "Q2_K"), ("Q2_K", "Q3_K"),
                                 ("Q4_K", "Q3_K")])
@pytest.mark.parametrize("config", [None, (32, 4, 64.0, 1), (32, 4, 64.0, 1, 2, 4)],
                         ids=["planned", "split-k", "parts"])
def test_column_gemv_stacks_two_types_in_one_launch(a, b, config):
    """W = [A; B] of two types (a mixed file's q, k over its v) in one launch: each part's columns against the gguf
    package's dequantization, with a bias; pair_applies refuses what one launch cannot run."""
    wa, ref_a = make_gguf(256, 512, a, seed=21)
    wb, ref_b = make_gguf(40, 512, b, seed=22)
    sa, sb = (ggml_gemm.prepare(w, DEVICE, torch.float16) for w in (wa, wb))
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(23)).to(DEVICE, torch.float16)
    bias = torch.randn(296, generator=torch.Generator().manual_seed(24)).to(DEVICE, torch.float16)
    assert gemv_cols.pair_applies(sa, sb, config) is None
    y = gemv_cols.matmul(x, sa, bias, config, second=sb)
    want = x.double() @ torch.cat([ref_a, ref_b]).double().T.to(DEVICE) + bias.double()
    assert y.shape == (1, 296) and rel_err(y[:, :256], want[:, :256]) < TOL[torch.float16]
    assert rel_err(y[:, 256:], want[:, 256:]) < TOL[torch.float16]


def test_column_gemv_pairs_it_cannot_stack_say_why():
    q4 = ggml_gemm.prepare(make_gguf(256, 512, "Q4_K")[0], DEVICE, torch.float16)
    short = ggml_gemm.prepare(make_gguf(40, 512, "Q6_K")[0], DEVICE, torch.float16)
    wide = ggml_gemm.prepare(make_gguf(256, 768, "Q6_K")[0], DEVICE, torch.float16)
    iq4 = ggml_gemm.prepare(make_gguf(40, 512, "IQ4_XS")[0], DEVICE, torch.float16)
    assert "no column-major GEMV" in gemv_cols.pair_applies(q4, iq4)
    assert "whole blocks of 256" in gemv_cols.pair_applies(short, q4)
    assert "do not share an input" in gemv_cols.pair_applies(q4, wide)
    assert ggml_gemm.apply_rows(torch.zeros(1, 512, dtype=torch.float16, device=DEVICE), [q4, short, short]) is None


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_column_gemv_rope_epilogue_over_two_types(fmt):
    """q, k in Q4_K over v in Q6_K, one launch with the rotary + KV-store epilogue: q and the caches as the same
    launch without it, then rotary_and_store."""
    from test_rotary import check_rope_epilogue
    hq, hk, d = 3, 1, 128
    sa = ggml_gemm.prepare(make_gguf((hq + hk) * d, 512, "Q4_K", seed=25)[0], DEVICE, torch.float16)
    sb = ggml_gemm.prepare(make_gguf(hk * d, 512, "Q6_K", seed=26)[0], DEVICE, torch.float16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 512, generator=g).to(DEVICE, torch.float16)
    config = gemv_cols.pair_config(sa, sb)

    def fused(rope):
        assert gemv_cols.rope_applies(sa, rope, config, sb)
        return gemv_cols.matmul(x, sa, None, config, rope=rope, second=sb)
    check_rope_epilogue(fused, lambda: gemv_cols.matmul(x, sa, None, config, second=sb), 1, hq, hk, d, fmt, g)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m,config", [(3, None), (16, (16, 16, 4, 1, 1e-3, 1)), (20, (16, 16, 2, 1, 64.0, 1))])
def test_mma_matches_the_gguf_dequantization(name, m, config, monkeypatch):
    """The MMA kernel's K order (its x gather), scales and mins, by its float32 twin and by its PTX (the emulator
    under the interpreter; the GPU in the -m gpu tests): planned, one program's K loop over two M blocks, and split
    over K; with a bias."""
    w, ref = make_gguf(40, 768, name, seed=m)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    want = x.double() @ ref.double().T.to(DEVICE) + bias.double()
    y = mma.matmul(x, st, bias, config)
    assert y.dtype == torch.float16 and rel_err(y, want) < TOL[torch.float16]
    if DEVICE == "cpu":                 # the PTX itself, run by the emulator
        ptx_emulator.install(monkeypatch)
        y_ptx = mma.matmul(x, st, bias, config, h2=True)
        assert rel_err(y_ptx, want) < TOL[torch.float16] and rel_err(y_ptx, y) < 2e-3


@pytest.mark.parametrize("qh", [0x00, 0xFF, None])
def test_packed_half_q5_k_fifth_bits(qh):
    """Q5_K's fifth bits all clear, all set (every code 16..31) and random, on 37 rows (no multiple of a BLOCK_N) and
    three super-blocks, whole and split over K: each chunk's bits of qh reach its own values."""
    raw = random_blocks(37, 768, "Q5_K", seed=8).reshape(37, 3, 176)
    if qh is not None:
        raw[:, :, 16:48] = qh
    ref = torch.from_numpy(quants.dequantize(raw.reshape(37, -1), GGMLQuantizationType.Q5_K).astype(np.float32))
    w = Gguf(data=torch.from_numpy(raw.reshape(37, -1)).to(DEVICE), ggml_type=int(GGMLQuantizationType.Q5_K),
             shape=(37, 768))
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.float16)
    for config in (None, (16, 4, 64.0, 1)):
        y = gemv_cols.matmul(x, st, None, config)
        assert rel_err(y, x.double() @ ref.double().T.to(DEVICE)) < TOL[torch.float16], (qh, config)


@pytest.mark.parametrize("name", K_QUANTS + BLOCK32)
def test_decoding_is_bit_exact(name):
    """x = I in float32 through the GEMM: y.T is the decoded weight, each value the float32 product the gguf package
    computes (scales and mins multiplied as it multiplies them), bit for bit. (The interpreter's float32 dot is exact
    here; on the GPU it would run in tf32.)"""
    if DEVICE == "cuda":
        pytest.skip("float32 tl.dot runs in tf32 on the GPU")
    n, k = shape_of(name)
    w, ref = make_gguf(n, k, name, seed=7)
    st = ggml_gemm.prepare(w, DEVICE, torch.float32)
    assert torch.equal(gemm.matmul(torch.eye(k), st).T, ref)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS", "Q5_1"])
def test_bf16_gemv(name):
    n, k = shape_of(name)
    w, ref = make_gguf(n, k, name, seed=3)
    st = ggml_gemm.prepare(w, DEVICE, torch.bfloat16)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    y = plan.matmul(x, st, path="gemv")
    assert y.dtype == torch.bfloat16 and rel_err(y, x.double() @ ref.double().T.to(DEVICE)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("path,config", [("gemv", (16, 4, 1e-3, 1)), ("gemv", (32, 4, 64.0, 1)),
                                         ("gemm", (16, 32, 1, 4, 2, 1e-3)), ("gemm", (32, 64, 2, 4, 2, 64.0)),
                                         ("gemm", gemm.SM90_LARGE_M)])
def test_bias_whole_and_split_k(path, config):
    """A bias added once, whether the K loop runs in one program (waves ~0) or is split over several."""
    w, ref = make_gguf(40, 1024, "Q5_K", seed=5)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    bias = torch.randn(40).to(DEVICE, torch.float16)
    y = (gemv if path == "gemv" else gemm).matmul(x, st, bias, config)
    assert rel_err(y, x.double() @ ref.double().T.to(DEVICE) + bias.double()) < TOL[torch.float16]


def test_apply_keeps_leading_dims_and_takes_no_rows():
    w, ref = make_gguf(40, 256, "Q4_K")
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.float16)
    y = ggml_gemm.apply(x, st)
    assert y.shape == (2, 3, 40)
    assert rel_err(y, x.double() @ ref.double().T.to(DEVICE)) < TOL[torch.float16]
    assert ggml_gemm.apply(x[:0], st).shape == (0, 3, 40)


@pytest.mark.parametrize("name", K_QUANTS + BLOCK32)
def test_held_at_the_files_bytes(name):
    """The planes are the blocks' bytes permuted (Q4_K's and Q5_K's 12 scale bytes a block repacked as 16): within 3%
    of the file's, not a 16-bit copy; the memory plan counts what they hold."""
    n, k = shape_of(name)
    w, _ = make_gguf(n, k, name)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    file_bytes = n * k // block * size
    assert w.nbytes == file_bytes
    assert st.nbytes == {"Q4_K": file_bytes * 148 // 144, "Q5_K": file_bytes * 180 // 176}.get(name, file_bytes)
    assert st.nbytes <= 1.03 * file_bytes
    lower = name.lower()
    if name in K_QUANTS and not name.startswith("IQ4"):         # the types the plan puts on these kernels
        assert gguf_gemm_bytes(n, k, lower[:-1] + "K", 2) == st.nbytes
    elif name.startswith("IQ4"):                                # fp16 runs them on the codebook kernels
        from quanta.engine.memory_report import held_bytes
        from quanta.kernels import codebook_gemm
        assert gguf_gemm_bytes(n, k, lower, 2) == held_bytes(codebook_gemm.prepare(w, DEVICE, torch.float16))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS"])
def test_prepare_moves_rows_a_slice_at_a_time_to_the_same_planes(name, monkeypatch):
    """The planes are the same whether the rows reach the device at once or a few rows at a time (3 rows a slice,
    N = 40: a short last slice)."""
    n, k = shape_of(name)
    w, _ = make_gguf(n, k, name)
    whole = ggml_gemm.prepare(w, DEVICE, torch.float16)
    monkeypatch.setattr(layout, "PREPARE_SLICE_BYTES", 3 * w.data.shape[1])
    sliced = ggml_gemm.prepare(w, DEVICE, torch.float16)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(whole.planes, sliced.planes))


def test_q4_k_and_q6_k_planes_are_the_files_words_column_major():
    """Q4_K's (and Q6_K's) planes hold word w of block b of row n at [b * words + w, n]: d | dmin << 16, the scale pairs, the
    code words, each the file's bytes."""
    n, k = shape_of("Q4_K")
    w, _ = make_gguf(n, k, "Q4_K")
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    raw = w.data.reshape(n, k // 256, 144)
    words = [p.t().contiguous().view(torch.uint8).reshape(n, k // 256, -1) for p in st.planes]
    assert all(p.dtype == torch.int32 and p.shape[1] == n for p in st.planes)
    assert torch.equal(words[0], raw[:, :, 0:4]) and torch.equal(words[2], raw[:, :, 16:144])
    assert torch.equal(words[1], k4_scale_pairs(raw[:, :, 4:16]))
    w6, _ = make_gguf(n, k, "Q6_K")
    st6 = ggml_gemm.prepare(w6, DEVICE, torch.float16)
    raw6 = w6.data.reshape(n, k // 256, 210)
    fields = [p.t().contiguous().view(torch.uint8).reshape(n, k // 256, -1) for p in st6.planes]
    assert [p.dtype for p in st6.planes] == [torch.int32] * 3 + [torch.float16]
    assert all(torch.equal(f, raw6[:, :, a:b]) for f, (a, b) in zip(fields, [(0, 128), (128, 192), (192, 208),
                                                                            (208, 210)]))


def test_q4_k_scales_repack_to_the_gguf_packages_scales_and_mins():
    """layout.k4_scale_pairs against gguf's own Q4_K.get_scale_min: byte 2s the scale of sub-block s, 2s + 1 its
    min, for every byte value in every position."""
    rng = np.random.default_rng(9)
    packed = rng.integers(0, 256, (512, 12), dtype=np.uint8)
    packed[:256] = np.arange(256, dtype=np.uint8)[:, None]
    sc, mn = quants.Q4_K.get_scale_min(packed)
    pairs = k4_scale_pairs(torch.from_numpy(packed)).numpy()
    assert np.array_equal(pairs[:, 0::2], sc.reshape(512, 8)) and np.array_equal(pairs[:, 1::2], mn.reshape(512, 8))


@pytest.mark.parametrize("name", [n for n in K_QUANTS if not n.startswith("IQ4")])
def test_the_registry_runs_them_on_cuda(name):
    w, _ = make_gguf(8, 256, name, device="cpu")
    module, reason = registry.select(w, torch.device("cuda"), torch.float16)
    assert module is ggml_gemm and "triton_affine: gguf" in reason and "no exact affine form" in reason
    assert "no codebook form" in reason


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_iq4_runs_on_the_codebook_kernels_in_fp16(name):
    """IQ4's exact codebook form (Gguf.to_codebook) takes the table kernels in fp16 (bf16 keeps the ggml ones:
    test_codebook_gemm's refusal)."""
    w, _ = make_gguf(8, 256, name, device="cpu")
    assert registry.select(w, torch.device("cuda"), torch.float16)[0].NAME == "triton_codebook"


def test_the_32_value_affine_types_stay_on_the_affine_kernels():
    w, _ = make_gguf(8, 256, "Q4_0", device="cpu")
    assert registry.select(w, torch.device("cuda"), torch.float16)[0].NAME == "triton_affine"
    assert ggml_gemm.supports(w, torch.device("cuda"), torch.float16) is None       # the second choice


def test_refusals_say_why():
    w, _ = make_gguf(8, 256, "Q4_K", device="cpu")
    assert "CUDA" in ggml_gemm.supports(w, torch.device("cpu"), torch.float16)
    assert "float32" in ggml_gemm.supports(w, torch.device("cuda"), torch.float32)
    assert "not a gguf weight" in ggml_gemm.supports(torch.zeros(8, 256), torch.device("cuda"), torch.float16)
    affine = Affine(codes=torch.zeros(8, 256, dtype=torch.uint8), scales=torch.ones(8, 2), bits=4, group_size=128,
                    zeros=8, shape=(8, 256))
    assert "not a gguf weight" in ggml_gemm.supports(affine, torch.device("cuda"), torch.float16)
    iq2 = GGMLQuantizationType.IQ2_XXS
    other = Gguf(data=torch.zeros(8, GGML_QUANT_SIZES[iq2][1], dtype=torch.uint8), ggml_type=int(iq2), shape=(8, 256))
    assert "iq2_xxs: no block decoder" in ggml_gemm.supports(other, torch.device("cuda"), torch.float16)
    w.shape = (8, 384)          # Gguf itself refuses such a shape; the kernels say so too
    assert "K=384 is not a multiple of the block size 256" in ggml_gemm.supports(w, torch.device("cuda"),
                                                                                  torch.float16)


def test_plan_takes_the_gemv_for_one_row_the_gemm_above_and_cublas_when_compute_bound():
    w, _ = make_gguf(40, 256, "Q6_K")
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    caps = PRESETS["sm90"]
    ms = (1, plan.GEMV_MAX_M, plan.GEMV_MAX_M + 1, 16, 17, 32, 64, 65, 256, 300, 2048)
    q4k = ggml_gemm.prepare(make_gguf(40, 256, "Q4_K")[0], DEVICE, torch.float16)
    iq4 = ggml_gemm.prepare(make_gguf(40, 256, "IQ4_XS")[0], DEVICE, torch.float16)
    assert plan.CUBLAS_MIN_M == 65 and [plan.cublas_min_m(w) for w in (q4k, st, iq4)] == [65, 17, 2]
    assert [plan.mma_max_m(w) for w in (q4k, st)] == [128, 64] and [plan.wgmma_max_m(w) for w in (q4k, st)] == [384, 256]
    assert [plan.choose(q4k, caps, m).path.name for m in ms] == ["gemv_cols"] * 2 + ["wgmma"] * 8 + ["cublas"]
    assert [plan.choose(q4k, PRESETS["sm80"], m).path.name for m in ms] == ["gemv_cols"] * 2 + ["gemm"] * 5 + \
        ["cublas"] * 4
    assert [plan.choose(st, caps, m).path.name for m in ms] == ["gemv_cols"] * 2 + ["wgmma"] * 7 + ["cublas"] * 2
    assert [plan.choose(st, PRESETS["sm80"], m).path.name for m in ms] == ["gemv_cols"] * 2 + ["gemm"] * 2 + \
        ["cublas"] * 7
    assert [plan.choose(iq4, caps, m).path.name for m in ms] == ["gemv_iq4"] * 2 + ["cublas"] * 9
    assert plan.choose(ggml_gemm.prepare(w, DEVICE, torch.bfloat16), caps, 1).path.name == "gemv"
    assert plan.choose(st, PRESETS["cpu"], 1).path.name == "gemv"                # the interpreter: no PTX
    for other in ("Q4_K", "Q5_K", "Q3_K", "Q2_K"):
        other_st = ggml_gemm.prepare(make_gguf(40, 256, other)[0], DEVICE, torch.float16)
        assert plan.choose(other_st, caps, 1).path.name == "gemv_cols", other
        assert plan.choose(other_st, caps, 16).path.name == ("gemm" if other in ("Q3_K", "Q2_K") else "wgmma"), other
        assert plan.choose(other_st, caps, 129 if other != "Q4_K" else 385).path.name == "cublas", other
    assert gemm.default_config(st, PRESETS["sm75"], 200).block_m <= 64       # fits a T4's shared memory
    name, reason = ggml_gemm.path(st, 1)
    assert name == "triton_ggml/gemv" and "GEMV" in reason and "not gemv_cols: not CUDA" in reason
    name, reason = ggml_gemm.path(st, 12)
    assert name == "triton_ggml/gemm" and f"not gemv: M=12 > {plan.GEMV_MAX_M}" in reason
    assert "not cublas: M=40 < 65" in ggml_gemm.path(q4k, 40)[1]
    name, reason = ggml_gemm.path(st, 300)
    assert name == "triton_ggml/cublas" and "cuBLAS" in reason


def test_wgmma_takes_fp16_q4_k_q5_k_q6_k_on_sm90_with_gluon(monkeypatch):
    """The Gluon kernel takes Q4_K, Q5_K and Q6_K with fp16 activations on sm90 and says why not otherwise; without
    Gluon's Hopper API the plan gives the same rows to the MMA kernel."""
    q4k = ggml_gemm.prepare(make_gguf(40, 256, "Q4_K")[0], DEVICE, torch.float16)
    caps = PRESETS["sm90"]
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        assert wgmma.applies(ggml_gemm.prepare(make_gguf(40, 256, name)[0], DEVICE, torch.float16), caps) is None
    assert "q3_K: no wgmma decoder" in wgmma.applies(ggml_gemm.prepare(make_gguf(40, 256, "Q3_K")[0], DEVICE,
                                                                       torch.float16), caps)
    assert "odd number of blocks" in wgmma.applies(ggml_gemm.prepare(make_gguf(41, 256, "Q6_K")[0], DEVICE,
                                                                     torch.float16), caps)
    assert "bfloat16 activations" in wgmma.applies(ggml_gemm.prepare(make_gguf(40, 256, "Q4_K")[0], DEVICE,
                                                                     torch.bfloat16), caps)
    assert "sm90" in wgmma.applies(q4k, PRESETS["sm80"])
    assert plan.explain(q4k, caps, 16) == ("wgmma", plan._why_wgmma(q4k, caps, 16) + "; not gemv_dp4a: M=16 > 1; "
                                                      "not gemv_iq4: M=16 > 1; not gemv_cols: M=16 > 1; "
                                                      "not gemv: M=16 > 1")
    monkeypatch.setattr(wgmma, "GLUON_ERROR", "Gluon's Hopper API is not importable (test)")
    fresh = ggml_gemm.prepare(make_gguf(40, 256, "Q4_K")[0], DEVICE, torch.float16)      # an empty plan cache
    assert plan.choose(fresh, caps, 16).path.name == "mma"
    assert "not importable" in plan.explain(fresh, caps, 16)[1]


@triton.jit
def _mma_order_kernel(x_ptr, y_ptr, Q6: tl.constexpr):
    rows = tl.arange(0, 16)[:, None] * 256
    cols = tl.arange(0, 128)[None, :]
    for step in tl.static_range(2):
        x = tl.load(x_ptr + rows + step * 128 + cols)
        tl.store(y_ptr + rows + step * 128 + cols, mma._in_mma_order(x, Q6, 16))


@pytest.mark.parametrize("kind", [4, 6])
def test_wgmma_x_order_is_the_mma_kernels(kind):
    """x[:, mma_order] (the gather before the wgmma kernel from ORDERED_MIN_M rows) puts each K step's columns where
    the MMA kernel's in-register permutation puts them (the decode both kernels share reads them there)."""
    x = torch.randn(16, 256, device=DEVICE)
    y = torch.empty_like(x)
    _mma_order_kernel[(1,)](x, y, Q6=kind == 6)
    assert torch.equal(x[:, wgmma.mma_order(256, kind, x.device)], y)
    assert not torch.equal(wgmma.mma_order(256, 4, x.device), wgmma.mma_order(256, 6, x.device))


@pytest.mark.parametrize("name", ["q4_K", "q5_K", "q6_K"])
@pytest.mark.parametrize("m,block_m,warps,rows", [(1, 16, 4, 128), (16, 16, 4, 128), (17, 32, 4, 128),
                                                  (33, 64, 8, 256), (64, 64, 8, 256), (65, 128, 8, 256)])
def test_wgmma_config_by_rows(name, m, block_m, warps, rows):
    """One warpgroup and 16 or 32 rows of x up to M = 32, split for two waves; above, two warpgroups share 64 rows
    of x (from M = 65 Q4_K's 128 in 4 stages, Q6_K's in 3; Q5_K's 64) over 256 weight rows (Q4_K's 256 up to
    M = 16 too), split for whole waves; every split at least its least K steps."""
    st = types.SimpleNamespace(n=14336, k=4096, name=name)
    config = wgmma.default_config(st, PRESETS["sm90"], m)
    block_m = 64 if m > 64 and name == "q5_K" else block_m
    rows = 256 if m <= 16 and name == "q4_K" else rows
    assert config.stages == (3 if m <= 32 or (m > 64 and name == "q6_K") else 4)
    assert (config.block_m, config.warps, config.rows) == (block_m, warps, rows)
    tiles, splits, per = wgmma.grid(st, 132, config, m)
    assert tiles == -(-14336 // rows) * -(-m // block_m) and splits * per >= 4096 // wgmma.STEP > (splits - 1) * per
    assert per >= config.min_tiles and (config.waves is None) == (m > wgmma.ONE_WARPGROUP_MAX_M)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS", "Q2_K", "Q4_1"])
def test_the_dequantized_copy_is_the_gguf_dequantization_rounded_once(name):
    n, k = shape_of(name)
    w, ref = make_gguf(n, k, name, seed=11)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    assert torch.equal(cublas.dequantize(st, cublas.default_config(st, PRESETS["sm90"], 300)), ref.half().to(DEVICE))


# --- the GPU: Llama-3-8B shapes ---------------------------------------------------------------------------------
def random_gguf_cuda(n: int, k: int, name: str, seed: int = 0) -> Gguf:
    """random_blocks made on the GPU (the CPU would take long at these sizes)."""
    t = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[t]
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // block, size), generator=g, device="cuda", dtype=torch.uint8)
    for at in FP16_FIELDS[name]:
        half = (torch.rand(n, k // block, 1, generator=g, device="cuda") * 0.5 + 0.5) * 2.0 ** -8
        half = half * (torch.randint(0, 2, half.shape, generator=g, device="cuda") * 2 - 1)
        raw[:, :, at:at + 2] = half.half().view(torch.uint8)
    return Gguf(data=raw.reshape(n, -1), ggml_type=int(t), shape=(n, k))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", K_QUANTS + BLOCK32)
@pytest.mark.parametrize("n,k", [(14336, 4096), (4096, 14336)])
def test_gpu_llama_shapes(name, n, k):
    """Llama-3-8B's gate (14336 x 4096) and down (4096 x 14336) shapes on CUDA: the registry's choice (the affine
    kernels first for Q4_0..Q8_0), the device memory prepare() leaves (the file's bytes), and every planned path of
    M = 1..300 against dequantize + matmul, fp16 and bf16."""
    w = random_gguf_cuda(n, k, name)
    ref_w = w.dequantize(torch.float32).double()
    for dtype in (torch.float16, torch.bfloat16):
        module, _ = registry.select(w, torch.device("cuda"), dtype)
        on_ggml = (name in K_QUANTS or name == "IQ4_NL") and not (name.startswith("IQ4") and dtype == torch.float16)
        assert (module is ggml_gemm) == on_ggml, module.NAME          # fp16 IQ4 runs on the codebook kernels
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        st = ggml_gemm.prepare(w, torch.device("cuda"), dtype)
        torch.cuda.synchronize()
        assert st.nbytes == {"Q4_K": w.nbytes * 148 // 144, "Q5_K": w.nbytes * 180 // 176}.get(name, w.nbytes)
        assert torch.cuda.memory_allocated() - before <= st.nbytes + (1 << 20)
        for m in (1, 3, 16, 33, 300):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            y = ggml_gemm.apply(x, st)
            assert rel_err(y, x.double() @ ref_w.T) < TOL[dtype], (dtype, m, ggml_gemm.path(st, m))
        for path, m in (("gemv", 8), ("gemm", 1), ("gemv", 1), ("cublas", 16)):   # paths at an M the plan gives another
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            assert rel_err(plan.matmul(x, st, path=path), x.double() @ ref_w.T) < TOL[dtype], (dtype, path)
        if name in ("Q4_K", "Q5_K", "Q6_K") and dtype == torch.float16:     # the wgmma kernel's configs, split or not
            large = (128, 4, None, 2, 256, 3, 8) if name == "Q4_K" else (64, 4, None, 2, 256, 2, 8)
            for m, config in ((2, None), (16, (16, 3, 1e-3, 1, 128, 1, 4)), (48, None), (256, None), (300, large),
                              (40, (64, 3, 4.0, 2, 128, 2, 8))):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                assert rel_err(wgmma.matmul(x, st, None, config), x.double() @ ref_w.T) < TOL[dtype], (m, config)
        if name in ("Q4_K", "Q5_K", "Q6_K") and dtype == torch.float16:     # the MMA kernel's configs, split over K or not
            for m, config in ((2, None), (64, (16, 64, 4, 3, 4.0, 2)), (256, (128, 16, 8, 3, 1e-3, 1))):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                assert rel_err(mma.matmul(x, st, None, config), x.double() @ ref_w.T) < TOL[dtype], (m, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm90 GPU")
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("m,config,ordered", [(5, None, None), (16, (16, 3, 1e-3, 1, 128, 2, 4), None),
                                              (16, (16, 3, 1e-3, 1, 128, 2, 4), True),
                                              (31, (32, 2, 1e-3, 1, 128, 3, 4), None), (70, None, None),
                                              (70, (64, 3, None, 1, 128, 1, 8), None),
                                              (70, (64, 3, None, 1, 128, 1, 8), False)])
def test_gpu_wgmma_edges(name, m, config, ordered):
    """The Gluon kernel against the gguf package on 200 rows (no multiple of a program's rows) and five super-blocks
    (an odd number of K steps' halves), x a strided view: its K order (x gathered in the kernel, or before it),
    each sub-block's scale (and min, fifth or top bits), masked rows of W and x, one program over the whole K loop
    and split over it, a bias."""
    w, ref = make_gguf(200, 1280, name, seed=m, device="cuda")
    st = ggml_gemm.prepare(w, torch.device("cuda"), torch.float16)
    x = torch.randn(m, 1280 + 64, device="cuda", dtype=torch.float16)[:, 32:1312]
    bias = torch.randn(200, device="cuda", dtype=torch.float16)
    y = wgmma.matmul(x, st, bias, config, ordered=ordered)
    assert y.dtype == torch.float16
    assert rel_err(y, x.double() @ ref.double().T.cuda() + bias.double()) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs an sm90 GPU")
@pytest.mark.parametrize("path,m", [("gemv_cols", 1), ("wgmma", 16), ("wgmma", 70)])
def test_gpu_paths_run_with_pdl_off(path, m):
    """QUANTA_PDL=0 on sm90 (caps without PDL): the column GEMV and the Gluon kernel, x gathered in it and before
    it, launch with PDL off."""
    w, ref = make_gguf(512, 1280, "Q4_K", seed=m, device="cuda")
    st = ggml_gemm.prepare(w, torch.device("cuda"), torch.float16)
    x = torch.randn(m, 1280, device="cuda", dtype=torch.float16)
    y = plan.matmul(x, st, path=path, caps=replace(device_caps(x.device), pdl=False))
    assert rel_err(y, x.double() @ ref.double().T.cuda()) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("a,b", [("Q4_K", "Q6_K"), ("Q3_K", "Q2_K")])
def test_gpu_two_types_in_one_launch(a, b):
    """Llama-3-8B's q, k (5120 x 4096) in one type over v (1024 x 4096) in another: ggml_gemm.apply_rows runs them
    in one launch at one row (the PTX), and refuses more rows (the caller then runs each)."""
    wa, wb = random_gguf_cuda(5120, 4096, a), random_gguf_cuda(1024, 4096, b)
    sa, sb = (ggml_gemm.prepare(w, torch.device("cuda"), torch.float16) for w in (wa, wb))
    ref = torch.cat([wa.dequantize(torch.float32), wb.dequantize(torch.float32)]).double()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    y = ggml_gemm.apply_rows(x, [sa, sb])
    assert y.shape == (1, 6144) and rel_err(y, x.double() @ ref.T) < TOL[torch.float16]
    assert ggml_gemm.apply_rows(torch.cat([x, x]), [sa, sb]) is None
