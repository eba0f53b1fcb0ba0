"""The Gluon wgmma kernel (affine/wgmma.py) against the weights' own dequantize(), and its launch configs.

Gluon kernels have no interpreter: the kernel runs in the GPU tests (sm90); on the CPU it is compiled for sm90
(test_compile_check) and its decoding is layout's H2 pair PTX, which test_affine_mma checks bit for bit through
tests/ptx_emulator.py. The CPU tests here check which weights it takes and how it launches; which M the plan gives
it, test_affine_plan."""
import types
from dataclasses import replace

import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
from quanta.kernels import affine, codebook_gemm
from quanta.kernels.affine import plan, wgmma
from quanta.kernels.device_caps import PRESETS, device_caps
from quanta.kernels.triton_support import split_k, whole_wave_split_k
from test_affine_gemm import LLAMA, make_affine
from test_codebook_gemm import make_codebook

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not HOPPER, reason="wgmma runs on sm90")


def check(w, m, dtype, bias=False, config=None, seed=1, kernel=wgmma):
    """`kernel`'s matmul (wgmma, or wgmma_ws) of M random rows against the weight's dequantize() in float64."""
    g = torch.Generator().manual_seed(seed)
    st = affine.prepare(w, "cuda", dtype)
    assert kernel.weight_fits(st)
    x = torch.randn(m, w.shape[1], generator=g).to("cuda", dtype)
    b = (torch.randn(w.shape[0], generator=g) * 0.1).to("cuda", dtype) if bias else None
    y = kernel.matmul(x, st, b, config=config)
    ref = x.double() @ w.dequantize().double().T + (b.double() if bias else 0)
    assert y.shape == (m, w.shape[0]) and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype], rel_err(y, ref)


def test_weights_it_takes():
    """4-bit affine codes in groups of 32, 64, a multiple of 128 or per channel (act-order too, its input gathered
    first), fp16 8-bit codes in groups of 32, 64 (a K tile of 64 columns) or per channel; not bf16 8-bit codes, groups
    of 16 or table codes."""
    def fits(w, dtype=torch.float16):
        return wgmma.weight_fits(affine.prepare(w, DEVICE, dtype))

    assert fits(make_affine(64, 256, 4, 128, "sym")) and fits(make_affine(64, 256, 4, 128, "asym"), torch.bfloat16)
    assert fits(make_affine(40, 423, 4, -1, "fmin")) and fits(make_affine(64, 512, 4, 256, "sym"))
    assert fits(make_affine(64, 256, 4, 128, "asym", act_order=True))
    assert fits(make_affine(64, 256, 4, 64, "sym")) and fits(make_affine(64, 256, 4, 32, "fmin"))
    assert fits(make_affine(64, 256, 8, 32, "sym")) and fits(make_affine(64, 256, 8, 64, "asym"))
    assert fits(make_affine(64, 256, 8, -1, "sym")) and not fits(make_affine(64, 256, 8, 32, "sym"), torch.bfloat16)
    assert not fits(make_affine(64, 256, 4, 16, "sym")) and not fits(make_affine(64, 256, 8, 16, "sym"))
    assert not wgmma.weight_fits(codebook_gemm.prepare(make_codebook(64, 256), DEVICE, torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_default_config_rows_a_program(dtype):
    """256 weight rows a program where two waves of them still take several K tiles each, else 128; BLOCK_M is M's
    bucket (16 or 32)."""
    def cfg(m, n, k):
        st = types.SimpleNamespace(n=n, num_tiles=k // 128, dtype=dtype, bits=4)
        return wgmma.default_config(st, PRESETS["sm90"], m)                    # 132 SMs

    assert cfg(16, 4096, 4096).rows == 128                        # 8B o: 16 blocks x 32 K tiles
    assert cfg(16, 57344, 8192).rows == 256                       # 70B gate_up
    assert cfg(16, 4096, 14336).rows == (256 if dtype == torch.float16 else 128)   # 8B down
    assert cfg(16, 28672, 4096).rows == (256 if dtype == torch.float16 else 128)   # 8B gate_up: K of 32 tiles
    assert [cfg(m, 28672, 4096).block_m for m in (2, 16, 17, 32, 33, 64, 65, 2048)] == [16, 16, 32, 32, 64, 64, 128,
                                                                                         128]
    assert [cfg(m, 28672, 4096).warps for m in (32, 33)] == [4, 8]                 # two warpgroups above M = 32


def test_large_m_rows_fill_the_waves():
    """Above M = 32, 256 weight rows a program unless 128-row programs fill whole waves of one an SM better by
    wave_steps weighted with ROW_STEP_COST; the K loop split for whole waves (waves None)."""
    def cfg(m, n, k):
        return wgmma.large_m_config(types.SimpleNamespace(n=n, num_tiles=k // 128, bits=4), PRESETS["sm90"], m)

    c = cfg(1024, 57344, 8192)                                    # 70B gate_up: 1792 programs
    assert (c.waves, c.min_tiles, c.rows) == (None, wgmma.LARGE_M_MIN_TILES, 256)
    assert cfg(512, 4096, 4096).rows == 128    # 8B o: 128 programs of 128 rows in one wave; 64 of 256 split twice
    assert cfg(1024, 4096, 4096).rows == 256   # 8B o: 128 programs of 256 rows fill one wave
    assert cfg(256, 10240, 8192).rows == 256   # 70B qkv: 80 blocks of 256 rows split in 3 beat 160 of 128 in 4
    assert tuple(cfg(64, 4096, 4096))[:5] == (64, 4, None, wgmma.LARGE_M_MIN_TILES, 256)   # 64 rows of x: 256 rows


def recorded_launches(monkeypatch) -> list:
    """The kernel's launches, (grid, args, kwargs) each, recorded rather than run (Gluon has no interpreter)."""
    launches = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(wgmma, "_affine_wgmma_kernel", Launch(), raising=False)   # absent without Gluon
    return launches


def test_large_m_split_k_fills_the_waves(monkeypatch):
    """matmul splits the K loop of a config with waves None as whole_wave_split_k (one program an SM), else as
    split_k (the launch recorded, not run: Gluon has no interpreter)."""
    launches = recorded_launches(monkeypatch)
    st = affine.prepare(make_affine(4096, 4096, 4, 128, "sym"), DEVICE, torch.float16)   # 8B o
    x = torch.randn(128, 4096, dtype=torch.float16)
    for waves in (None, 2.0):
        wgmma.matmul(x, st, config=(128, 4, waves, 2, 128, 3, 8), caps=PRESETS["sm90"])   # 132 SMs
    whole = whole_wave_split_k(32, 32, 132, 2)[0]
    grids = [grid for grid, _, _ in launches]
    assert grids == [(32, whole), (32, split_k(32, 32, 132, 2.0, 2)[0])] and whole != grids[1][1]


def test_eight_bit_tiles_of_two_word_blocks(monkeypatch):
    """EIGHT_BIT_BLOCKS = 2: a K tile of 8-bit codes takes two blocks of word rows (128 columns), so the launch walks
    half the layout's tiles (an odd count rounded up, the kernel told the words' rows to stop at), and
    groups must not straddle its 128 columns (192 does; 64 and per channel are read from the code where they begin)."""
    launches = recorded_launches(monkeypatch)
    monkeypatch.setattr(wgmma, "EIGHT_BIT_BLOCKS", 2)
    st = affine.prepare(make_affine(256, 320, 8, 32, "sym"), DEVICE, torch.float16)        # 5 tiles of 64 columns
    assert (st.num_tiles, wgmma.kernel_tiles(st), wgmma.tile_columns(st)) == (5, 3, 128)
    wgmma.matmul(torch.randn(2, 320, dtype=torch.float16), st, config=(16, 3, 2.0, 1, 128, 2, 4),
                 caps=PRESETS["sm90"])
    (grid, args, kwargs), = launches
    assert args[9:11] == (3, st.packed.shape[0]) and kwargs["BLOCKS"] == 2
    assert grid == wgmma.grid_of(256, 3, 132, wgmma.WgmmaConfig(16, 3, 2.0, 1, 128, 2, 4), 2)[:2]
    fits = [wgmma.weight_fits(affine.prepare(make_affine(64, 384, 8, g, "sym"), DEVICE, torch.float16))
            for g in (64, 128, 192, -1)]
    assert fits == [True, True, False, True]
    monkeypatch.setattr(wgmma, "EIGHT_BIT_BLOCKS", 1)
    assert wgmma.weight_fits(affine.prepare(make_affine(64, 384, 8, 192, "sym"), DEVICE, torch.float16))


@pytest.mark.parametrize("bits,blocks", [(4, 1), (8, 1), (8, 2)])
def test_every_default_config_fits_shared_memory(bits, blocks, monkeypatch):
    """Each M's default config, on the 8B and 70B shapes and every group layout, keeps its ring of stages within
    SHARED_MEMORY (with two word blocks the 128-row x stages come in 3)."""
    monkeypatch.setattr(wgmma, "EIGHT_BIT_BLOCKS", blocks)
    for group, zero in ((32, "asym"), (32, "sym"), (64, "sym"), (128, "asym"), (-1, "sym")):
        st = affine.prepare(make_affine(64, 256, bits, group, zero), DEVICE, torch.float16)
        for n, k in LLAMA + [(10240, 8192), (57344, 8192), (8192, 28672)]:
            shaped = replace(st, n=n, k=k, k_pad=k, group_size=k if group == -1 else group)
            for m in (1, 16, 32, 33, 64, 65, 256, 1024):
                config = wgmma.default_config(shaped, PRESETS["sm90"], m)
                assert wgmma.shared_bytes(shaped, config) <= wgmma.SHARED_MEMORY, (n, k, group, m, config)
    if blocks == 2:
        assert wgmma.default_config(shaped, PRESETS["sm90"], 256).stages == 3


def test_x_rows_copied_only_when_unaligned():
    """The kernel copies x by 16-byte cp.async: K and the row stride a multiple of 16 elements, else a zero-padded
    copy and K rounded up."""
    x = torch.randn(3, 256, dtype=torch.float16)
    assert wgmma.aligned_rows(x, 256)[0] is x
    for x, k in ((torch.randn(3, 213, dtype=torch.float16), 213), (torch.randn(3, 264)[:, 8:].half(), 256),
                 (torch.randn(3, 272, dtype=torch.float16)[:, 3:259], 256)):
        padded, k16 = wgmma.aligned_rows(x, k)
        assert k16 == -(-k // 16) * 16 and padded.stride(0) % 16 == 0 and padded.data_ptr() % 16 == 0
        assert torch.equal(padded[:, :k], x) and not padded[:, k:].any()


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m", [2, 17, 64, 300])
def test_gpu_act_order_input_gathered(m):
    """An act-order weight (GPTQ desc_act: columns sorted by group at load) against its dequantize() in the model's
    column order: the kernel reads x gathered through perm."""
    check(make_affine(4096, 4096, 4, 128, "sym", act_order=True, device="cuda"), m, torch.float16, bias=m == 17)


@pytest.mark.gpu
@sm90
def test_gpu_runs_with_pdl_off():
    """QUANTA_PDL=0 on sm90 (caps without PDL): the plan's wgmma path launches its kernel with PDL off."""
    w = make_affine(4096, 4096, 4, 128, "sym", device="cuda")
    st = affine.prepare(w, "cuda", torch.float16)
    x = torch.randn(40, 4096, device="cuda", dtype=torch.float16)
    y = plan.matmul(x, st, path="wgmma", caps=replace(device_caps(x.device), pdl=False))
    assert rel_err(y, x.double() @ w.dequantize().double().T.cuda()) < TOL[torch.float16]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [2, 3, 16, 17, 32, 300])
@pytest.mark.parametrize("group,zero", [(128, "sym"), (128, "asym"), (-1, "sym"), (256, "fmin")])
def test_gpu_llama_shapes(n, k, m, group, zero):
    w = make_affine(n, k, 4, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, m, dtype, bias=m == 16)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [2, 16, 33, 300])
@pytest.mark.parametrize("group,zero", [(32, "sym"), (64, "asym"), (32, "fmin")])
def test_gpu_groups_narrower_than_the_tile(n, k, m, group, zero):
    """Groups of 32 and 64 (GGUF Q4_0 / Q4_1, AWQ / GPTQ g32, g64): a scale row a group, or a pair of groups
    without zero points, applied from the code where the group begins; one and two warpgroups a program."""
    w = make_affine(n, k, 4, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, m, dtype, bias=m == 16)
    check(make_affine(200, 300, 4, group, zero, device="cuda"), m, torch.float16, config=(16, 2, 8.0, 1, 128, 3, 4))


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [2, 16, 33, 256])
@pytest.mark.parametrize("group,zero", [(32, "sym"), (64, "asym"), (-1, "sym"), (32, "fmin")])
@pytest.mark.parametrize("blocks", [1, 2])
def test_gpu_eight_bit_codes(n, k, m, group, zero, blocks, monkeypatch):
    """fp16 8-bit codes (GGUF Q8_0: groups of 32, symmetric; RTN w8 per channel): four codes a block of word rows,
    one or two blocks a K tile (EIGHT_BIT_BLOCKS), a scale row a tile or a pair of groups; one and two warpgroups a
    program."""
    monkeypatch.setattr(wgmma, "EIGHT_BIT_BLOCKS", blocks)
    check(make_affine(n, k, 8, group, zero, device="cuda"), m, torch.float16, bias=m == 16)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("group,zero", [(32, "sym"), (64, "asym"), (128, "fmin"), (-1, "asym")])
@pytest.mark.parametrize("config", [(16, 3, 2.0, 2, 128, 1, 4), (32, 2, 0.01, 1, 128, 2, 4),
                                    (128, 3, 8.0, 1, 256, 3, 8)], ids=["lag1", "one-split-stored", "two-warpgroups"])
@pytest.mark.parametrize("blocks", [1, 2])
def test_gpu_eight_bit_odd_shapes_and_configs(group, zero, config, blocks, monkeypatch):
    """8-bit codes with N and K off the block sizes (K of 300: a last tile of 44 columns, or of two blocks the
    second past the words and scales), K of 40 (one block), M over several blocks, split and stored."""
    monkeypatch.setattr(wgmma, "EIGHT_BIT_BLOCKS", blocks)
    for n, k in ((200, 300), (72, 40)):
        w = make_affine(n, k, 8, group, zero, device="cuda")
        for m in (1, 5, 64, 300):
            check(w, m, torch.float16, bias=m == 5, config=config)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k,group,zero", [(72, 256, 128, "sym"), (64, 384, 128, "asym"), (73, 213, -1, "asym"),
                                            (200, 300, 128, "fmin")])
@pytest.mark.parametrize("m", [1, 5, 31, 64, 300])
@pytest.mark.parametrize("config", [(16, 3, 2.0, 2, 128, 1, 4), (16, 4, 8.0, 1, 256, 3, 4),
                                    (32, 2, 0.01, 1, 128, 2, 4), (64, 3, 2.0, 1, 128, 2, 4),
                                    (128, 4, 8.0, 1, 256, 2, 8), (256, 3, 0.01, 1, 128, 3, 8)],
                         ids=["lag1", "4-stages-lag3-split", "one-split-stored", "64-rows-of-x",
                              "two-warpgroups-split", "two-warpgroups-256-rows-of-x-stored"])
def test_gpu_odd_shapes_and_configs(n, k, group, zero, m, config):
    """N and K off the block sizes (odd N: unaligned rows of words), M over several blocks, each launch knob: splits
    of one K tile (the bias added once, by split 0), one split a tile, stored, and two warpgroups a program (the
    refill after the CTA barrier)."""
    w = make_affine(n, k, 4, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, m, dtype, bias=m == 5, config=config)


@pytest.mark.gpu
@sm90
def test_gpu_plan_and_matmul_take_it():
    w = make_affine(4096, 4096, 4, 128, "asym", device="cuda")
    caps = device_caps("cuda")
    for dtype in (torch.float16, torch.bfloat16):
        st = affine.prepare(w, "cuda", dtype)
        m33 = "wgmma" if dtype == torch.float16 else "mma"                 # bf16: 16 blocks, K split
        assert ([plan.choose(st, caps, m).path.name for m in (1, 2, 16, 17, 33, 1025)]
                == ["gemv", "wgmma", "wgmma", "mma", m33, "cublas"])
        st_big = affine.prepare(make_affine(28672, 4096, 4, 128, "sym", device="cuda"), "cuda", dtype)
        m1 = "gemv" if dtype == torch.float16 else "wgmma"                 # the bf16 GEMV decodes in fp32
        assert [plan.choose(st_big, caps, m).path.name for m in (1, 32, 33)] == [m1, "wgmma", "wgmma"]
        x = torch.randn(2, 8, 4096, device="cuda", dtype=dtype)
        b = torch.randn(4096, device="cuda", dtype=dtype) * 0.1
        y = plan.matmul(x, st, b)
        ref = x.double() @ w.dequantize().double().T + b.double()
        assert y.shape == (2, 8, 4096) and rel_err(y, ref) < TOL[dtype]
        x = torch.randn(5, 4099, device="cuda", dtype=dtype)[:, 3:]          # rows neither 16-byte aligned nor strided
        assert rel_err(plan.matmul(x, st), x.double() @ w.dequantize().double().T) < TOL[dtype]
