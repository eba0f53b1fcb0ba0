"""The GEMV's packed-half (H2) inner loop on the CPU: Triton's interpreter runs the kernel with its inline
PTX executed by tests/ptx_emulator.py (PTX ISA semantics), against Affine.dequantize() and against the
fp32 inner loop of the same kernel."""
import types

import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
import ptx_emulator
from quanta.kernels import affine
from quanta.kernels.affine import gemv
from quanta.kernels.affine.layout import AFFINE, LUT
from quanta.kernels.device_caps import PRESETS
from test_affine_gemm import make_affine

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the GPU runs the real PTX (test_affine_gemm.py)")

CASES = [  # n, k, bits, group, zero, act_order: every case H2 takes (fp16, a scale per K, half or quarter tile)
    (72, 256, 4, 128, "sym", False),
    (64, 384, 4, 128, "asym", False),      # integer zero points: the xsum correction
    (40, 423, 4, -1, "asym", False),       # per-channel, K not a multiple of the tile
    (96, 512, 4, 256, "fmin", True),       # float mins, act-order permutation
    (48, 256, 8, 128, "sym", False),
    (33, 130, 8, -1, "fmin", False),       # int8, odd N, ragged K
    (56, 320, 8, 64, "asym", True),
    (64, 256, 4, 64, "sym", False),        # two groups a tile: a packed sum's two lanes
    (40, 384, 4, 64, "fmin", False),       # float mins: the activations' sum per group
    (72, 256, 4, 32, "sym", False),        # four groups a tile (GGUF Q4_0): two packed sums' lanes
    (48, 416, 4, 32, "asym", True),        # per-group zero points, act-order, K not a multiple of the tile
    (33, 256, 4, 32, "fmin", False),       # GGUF Q4_1's min
    (64, 192, 8, 32, "sym", False),        # 8-bit, two groups a 64-column tile (GGUF Q8_0)
    (40, 256, 8, 32, "asym", False),
    (40, 256, 5, 32, "sym", False),        # 5-bit codes in 8-bit fields (GGUF Q5_0): zero 16, not the centre
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("m", [1, 2])
def test_h2_gemv_matches_dequantize(case, m, monkeypatch):
    ptx_emulator.install(monkeypatch)
    w = make_affine(*case)
    st = affine.prepare(w, DEVICE, torch.float16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, w.shape[1], generator=g).half()
    bias = (torch.randn(w.shape[0], generator=g) * 0.1).half()
    y = gemv.matmul(x, st, bias, config=(32, 8, 2, 64.0, 1), h2=True)      # split-K over several programs
    y32 = gemv.matmul(x, st, bias, config=(32, 8, 2, 64.0, 1), h2=False)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    assert rel_err(y, ref) < TOL[torch.float16]
    assert rel_err(y, y32) < 1e-3


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == 8], ids=lambda c: "-".join(map(str, c)))
def test_h2_gemv_whole_tile_steps(case, monkeypatch):
    """Steps of all 16 word rows of a tile over 4 warps, as the H100's 8-bit configs take them, split over
    several programs: the same sums as the fp32 loop and the dequantized weight."""
    ptx_emulator.install(monkeypatch)
    w = make_affine(*case)
    st = affine.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(5)).half()
    y = gemv.matmul(x, st, config=(64, 16, 4, 64.0, 1), h2=True)
    assert rel_err(y, x.double() @ w.dequantize().double().T) < TOL[torch.float16]
    assert rel_err(y, gemv.matmul(x, st, config=(64, 16, 4, 64.0, 1), h2=False)) < 1e-3


@pytest.mark.parametrize("kind", ["int4", "int8", "nf4", "iq4"])
def test_default_config_by_code_kind(kind):
    """Under PDL (sm90), 8-bit codes (twice the bytes a weight) and table codes (more instructions a code; in groups of
    32 four sums a word) take their own launch tables, swept apart from 4-bit affine codes; without PDL (sm80) table
    codes theirs, the others one."""
    from quanta.kernels import codebook_gemm
    from test_codebook_gemm import make_codebook
    if kind in ("nf4", "iq4"):
        st = codebook_gemm.prepare(make_codebook(64, 256, 64 if kind == "nf4" else 32, "nf4", True), DEVICE,
                                   torch.float16)
    else:
        st = affine.prepare(make_affine(64, 256, 8 if kind == "int8" else 4, 128, "sym"), DEVICE, torch.float16)
    table = {"int4": gemv.GEMV_CONFIGS_PDL, "int8": gemv.GEMV_CONFIGS_PDL_W8,
             "nf4": gemv.GEMV_CONFIGS_PDL_TABLE, "iq4": gemv.GEMV_CONFIGS_PDL_TABLE32}[kind]
    assert gemv.default_config(st, PRESETS["sm90"]) == table[0][1]
    no_pdl = gemv.GEMV_CONFIGS_TABLE if kind in ("nf4", "iq4") else gemv.GEMV_CONFIGS
    assert gemv.default_config(st, PRESETS["sm80"]) == no_pdl[0][1]


def test_table_configs_keep_a_steps_rows_in_one_thread():
    """The table codes' packed-half row sums reduce a step's rows: every launch config of their table puts its warps
    side by side along N (128 columns a warp, 4 words a thread), so that the rows of a column lie in one thread and
    the reduction needs no shared memory."""
    for _, c in gemv.GEMV_CONFIGS_PDL_TABLE + gemv.GEMV_CONFIGS_TABLE + gemv.GEMV_CONFIGS_PDL_TABLE32:
        assert c.block_n == 128 * c.warps


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_table_words_hold_the_halved_table_twice(qt):
    """AffineState.lut_bytes: the table's byte words for the other kernels, then the halved table's twice (the
    GEMV's lanes read the copy of their parity), each byte word the fp16 bits of table / 2 exactly."""
    from quanta.kernels import codebook_gemm
    from quanta.kernels.affine.layout import lut_byte_words
    from test_codebook_gemm import make_codebook
    st = codebook_gemm.prepare(make_codebook(64, 256, 64, qt), DEVICE, torch.float16)
    table = st.lut.half()
    assert torch.equal(st.lut_bytes[:8], lut_byte_words(st.lut))
    assert torch.equal(st.lut_bytes[8:16], st.lut_bytes[16:])
    assert torch.equal(st.lut_bytes[8:16], lut_byte_words(st.lut / 2))
    halved = (table.float() / 2).half()
    assert torch.equal(halved.float() * 2, table.float())        # halving loses no bit of any entry


@pytest.mark.parametrize("bits", [4, 8])
def test_glu_calls_take_their_own_config_in_the_glu_band(bits):
    """A call with the SwiGLU epilogue on 7-8B models' stacked gate/up (GLU_BAND, under PDL) takes GLU_CONFIGS_PDL's
    config for its code width; the same weight without the epilogue, other sizes, table codes, bf16 and devices
    without PDL keep the plan's."""
    def state(n, k, mode=AFFINE, dtype=torch.float16, table=False):
        return types.SimpleNamespace(n=n, k=k, bits=bits, mode=mode, dtype=dtype, tile_scale=True, off_centre=False,
                                     table_lookup=table, group_size=64, tile_k=128)

    plain = gemv.GemvConfig(256, 4, 2, 8.0, 2)
    gate_up = state(28672, 4096)                                     # Llama-3-8B: 117M weights
    assert gemv.glu_config(gate_up, PRESETS["sm90"], plain) == gemv.GLU_CONFIGS_PDL[bits] != plain
    assert gemv.glu_config(state(57344, 8192), PRESETS["sm90"], plain) == plain      # 70B: 470M
    assert gemv.glu_config(state(8192, 4096), PRESETS["sm90"], plain) == plain
    assert gemv.glu_config(state(28672, 4096, dtype=torch.bfloat16), PRESETS["sm90"], plain) == plain
    assert gemv.glu_config(state(28672, 4096, mode=LUT, table=True), PRESETS["sm90"], plain) == plain
    assert gemv.glu_config(gate_up, PRESETS["sm80"], plain) == plain


def test_h2_keeps_outlier_activations_finite(monkeypatch):
    """(q - 8)/16 keeps each packed-half product within |x| / 2: activations of 3000 stay finite."""
    ptx_emulator.install(monkeypatch)
    w = make_affine(64, 512, 4, 128, "sym")
    st = affine.prepare(w, DEVICE, torch.float16)
    x = torch.randn(1, 512) * 100
    x[0, ::97] = 3000.0
    x = x.half()
    y = gemv.matmul(x, st, h2=True)
    assert torch.isfinite(y).all()
    assert rel_err(y, x.double() @ w.dequantize().double().T) < TOL[torch.float16]


def test_h2_refuses_weights_it_cannot_run():
    w = make_affine(64, 256, 4, 16, "sym")                 # 8 groups a 128-column tile: more than a word's lanes
    st = affine.prepare(w, DEVICE, torch.float16)
    assert not gemv.use_h2(st, PRESETS["sm90"])
    with pytest.raises(AssertionError):
        gemv.matmul(torch.randn(1, 256).half(), st, h2=True)
    # 5-bit codes with mins (GGUF Q5_1) in 8-bit fields sit far below the field's centre of 128
    off = affine.prepare(make_affine(64, 256, 5, 32, "fmin"), DEVICE, torch.float16)
    assert off.off_centre and not gemv.h2_applies(off)


def test_ptx_emulator_against_numpy():
    """The emulator's instructions against NumPy's own bit operations and fp16 arithmetic."""
    import numpy as np
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 2**32, 64, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    out = ptx_emulator.run("{\nlop3.b32 $0, $1, $2, $3, 0xEA;\n}", [a, b, c])
    assert np.array_equal(out, (a & b) | c)
    out = ptx_emulator.run("{\nlop3.b32 $0, $1, $2, $3, 0x96;\n}", [a, b, c])         # a ^ b ^ c
    assert np.array_equal(out, a ^ b ^ c)
    h = rng.standard_normal((2, 64)).astype(np.float16)
    pairs = h.view(np.uint16).astype(np.uint32)
    packed = pairs[0] | (pairs[1] << 16)
    prod = ptx_emulator.run("{\nmul.rn.f16x2 $0, $1, $2;\n}", [packed, packed])
    assert np.array_equal((prod & 0xFFFF).astype(np.uint16).view(np.float16), h[0] * h[0])
    assert np.array_equal((prod >> 16).astype(np.uint16).view(np.float16), h[1] * h[1])
    total = ptx_emulator.run("{\n.reg .f16 x, y;\n.reg .f32 p, q;\nmov.b32 {x, y}, $1;\ncvt.f32.f16 p, x;\n"
                             "cvt.f32.f16 q, y;\nadd.f32 $0, p, q;\n}", [packed])
    assert np.array_equal(total.view(np.float32), h[0].astype(np.float32) + h[1].astype(np.float32))
    bf = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bits = bf.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    packed = bits[0] | (bits[1] << 16)
    prod = ptx_emulator.run("{\n.reg .b32 z;\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, $1, $2, z;\n}",
                            [packed, packed])
    for half, row in ((prod & 0xFFFF, bf[0]), (prod >> 16, bf[1])):     # torch rounds to nearest even, as PTX's .rn
        got = torch.from_numpy(half.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(got, (row.float() * row.float()).to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["int4", "int4-g32", "nf4", "table-g32"])
def test_h2_with_the_glu_epilogue(kind, monkeypatch):
    """The packed-half loop (affine, or the NF4 table lookup the engine's gate_up takes by default; scale groups of
    32 too, as GGUF Q4_0 and IQ4 take it) with silu(gate) * up made in the epilogue equals it followed by the
    activation kernel (split-K, two column blocks, the second partial)."""
    from quanta.kernels import activation, codebook_gemm
    from test_codebook_gemm import make_codebook
    ptx_emulator.install(monkeypatch)
    if kind.startswith("int4"):
        st = affine.prepare(make_affine(160, 384, 4, 32 if kind.endswith("g32") else 128, "sym"), DEVICE,
                            torch.float16)
    else:
        st = codebook_gemm.prepare(make_codebook(160, 384, 32 if kind.endswith("g32") else 64, "nf4", True), DEVICE,
                                   torch.float16)
    x = torch.randn(2, 384).half()
    fused = gemv.matmul(x, st, h2=True, glu=True)
    assert torch.equal(fused, activation.silu_and_mul(gemv.matmul(x, st, h2=True)))


@pytest.mark.parametrize("n,k,blocksize,qt,dq", [(72, 256, 64, "nf4", True), (40, 192, 64, "fp4", False),
                                                 (33, 384, 128, "nf4", False), (48, 256, 32, "nf4", False),
                                                 (40, 160, 32, "fp4", True)])
@pytest.mark.parametrize("m", [1, 2])
def test_h2_table_gemv_matches_dequantize(n, k, blocksize, qt, dq, m, monkeypatch):
    """NF4 / FP4 through the byte-permute lookup: every code of the table, groups of 32 and 64 (four and two per K
    tile) and 128, K not a multiple of the tile, against Codebook.dequantize() and the fp32 gather loop."""
    from quanta.kernels import codebook_gemm
    from test_codebook_gemm import make_codebook
    ptx_emulator.install(monkeypatch)
    w = make_codebook(n, k, blocksize, qt, dq)
    st = codebook_gemm.prepare(w, DEVICE, torch.float16)
    assert gemv.h2_applies(st)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=g).half()
    y = gemv.matmul(x, st, config=(32, 8, 2, 64.0, 1), h2=True)
    y32 = gemv.matmul(x, st, config=(32, 8, 2, 64.0, 1), h2=False)
    ref = x.double() @ w.dequantize().double().T
    assert rel_err(y, ref) < TOL[torch.float16]
    assert rel_err(y, y32) < 1e-3


def test_ptx_emulator_prmt_follows_the_isa():
    """prmt.b32's generic mode as the PTX ISA states it: nibble i of the selector picks byte i of the
    result from {b, a} (a = bytes 0-3), its bit 3 replicating that byte's sign."""
    import numpy as np
    a = np.array([0x44332211], dtype=np.uint32)
    b = np.array([0x88776655], dtype=np.uint32)
    run = lambda sel: int(ptx_emulator.run(f"{{\nprmt.b32 $0, $1, $2, {sel};\n}}", [a, b])[0])  # noqa: E731
    assert run(0x3210) == 0x44332211 and run(0x7654) == 0x88776655
    assert run(0x0123) == 0x11223344 and run(0x5140) == 0x66225511
    assert run(0x8F00) == 0x00FF1111          # byte 7 = 0x88: sign set -> 0xFF; byte 0 = 0x11: sign clear -> 0
