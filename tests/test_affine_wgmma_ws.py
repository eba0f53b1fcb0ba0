"""The warp-specialized wgmma kernel (affine/wgmma_ws.py) against the weights' own dequantize(), and its configs.

Gluon kernels have no interpreter: the kernel runs in the GPU tests (sm90); on the CPU it is compiled for sm90
(test_compile_check: the TMA descriptors' layouts as wgmma_ws.descriptors makes them) and its decode is
wgmma.py's, which test_affine_mma checks bit for bit through tests/ptx_emulator.py."""
import pytest
import torch

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
from quanta.kernels import affine
from quanta.kernels.affine import wgmma, wgmma_ws
from quanta.kernels.device_caps import PRESETS
from test_affine_gemm import LLAMA, make_affine
from test_affine_wgmma import check as affine_wgmma_check

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not HOPPER, reason="wgmma runs on sm90")


def check(w, m, dtype, bias=False, config=None):
    affine_wgmma_check(w, m, dtype, bias, config, kernel=wgmma_ws)


def test_weights_it_takes():
    """wgmma.py's weights whose rows of words are whole 16-byte TMA boxes (N a multiple of 4)."""
    def fits(w):
        return wgmma_ws.weight_fits(affine.prepare(w, DEVICE, torch.float16))

    assert fits(make_affine(64, 256, 4, 128, "sym")) and fits(make_affine(68, 423, 4, -1, "fmin"))
    assert fits(make_affine(64, 256, 4, 128, "asym", act_order=True))
    assert not fits(make_affine(73, 256, 4, 128, "sym")) and not fits(make_affine(64, 256, 4, 64, "sym"))


@pytest.mark.parametrize("m", [33, 64, 65, 300, 1024])
def test_default_config_fits_shared_memory(m):
    """The plan's config: large_m_config's program shape, in as many stages as fit beside the epilogue (3 of
    49 KB at 128 rows of x, 4 of 33 KB at 64), two warpgroups."""
    st = affine.prepare(make_affine(4096, 4096, 4, 128, "sym"), DEVICE, torch.float16)
    c = wgmma_ws.default_config(st, PRESETS["sm90"], m)
    base = wgmma.large_m_config(st, PRESETS["sm90"], m)
    assert c._replace(stages=base.stages) == base and c.warps == 8
    assert c.stages == (3 if c.block_m == 128 else 4) and c.block_m == (64 if m <= 64 else 128)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k", LLAMA)
@pytest.mark.parametrize("m", [33, 64, 300, 1024])
@pytest.mark.parametrize("group,zero", [(128, "sym"), (128, "asym"), (-1, "sym"), (256, "fmin")])
def test_gpu_llama_shapes(n, k, m, group, zero):
    w = make_affine(n, k, 4, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, m, dtype, bias=m == 64)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("n,k,group,zero", [(72, 256, 128, "sym"), (64, 384, 128, "asym"), (76, 213, -1, "asym"),
                                            (200, 300, 128, "fmin")])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("config", [(64, 4, None, 2, 256, 2, 8), (128, 3, None, 1, 256, 3, 8),
                                    (128, 2, 8.0, 1, 128, 3, 8), (64, 2, 0.01, 1, 128, 1, 8)],
                         ids=["64-rows-of-x", "128-rows-of-x", "two-stages-split", "lag1-stored"])
def test_gpu_odd_shapes_and_configs(n, k, group, zero, m, config):
    """N and K off the block sizes (TMA's zeros past them), M over several blocks, splits of one K tile (the bias
    added once), one split stored, two stages (each refilled as soon as it is freed)."""
    w = make_affine(n, k, 4, group, zero, device="cuda")
    for dtype in (torch.float16, torch.bfloat16):
        check(w, m, dtype, bias=m == 5, config=config)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("m", [40, 300])
def test_gpu_act_order_and_unaligned_rows(m):
    """An act-order weight (its input gathered into the sorted column order), and rows of x neither 16-byte
    aligned nor a multiple of 16 long (copied by wgmma.aligned_rows before the descriptor is made)."""
    check(make_affine(4096, 4096, 4, 128, "sym", act_order=True, device="cuda"), m, torch.float16, bias=True)
    w = make_affine(1024, 4096, 4, 128, "asym", device="cuda")
    st = affine.prepare(w, "cuda", torch.float16)
    x = torch.randn(m, 4099, device="cuda", dtype=torch.float16)[:, 3:]
    assert rel_err(wgmma_ws.matmul(x, st), x.double() @ w.dequantize().double().T) < TOL[torch.float16]
