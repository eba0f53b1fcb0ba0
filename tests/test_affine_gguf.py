"""GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights on the affine kernels, against the gguf package's own
dequantization: converted exactly at load (Gguf.to_affine) and held without a 16-bit copy: Q4_0, Q4_1 and Q8_0 at
exactly the bytes their blocks take on disk, Q5_0 / Q5_1 with their 5-bit codes in 8-bit fields. Other GGUF types
stay dequantized, named as a fallback by the registry."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
from quanta.kernels import affine, registry
from quanta.kernels.affine import plan
from quanta.quant.kinds.gguf import Gguf

AFFINE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def make_gguf(n: int, k: int, name: str, device=DEVICE, seed: int = 0) -> tuple[Gguf, torch.Tensor]:
    """A GGUF weight quantized by the gguf package, and the package's dequantization of its blocks [n, k]."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    t = GGMLQuantizationType[name]
    blocks = quants.quantize(w, t)
    weight = Gguf(data=torch.from_numpy(blocks).to(device), ggml_type=int(t), shape=(n, k))
    return weight, torch.from_numpy(quants.dequantize(blocks, t))


def held_bytes(st) -> int:
    return st.packed.nbytes + st.sz.nbytes


def expected_bytes(name: str, n: int, k: int) -> int:
    """Codes and scale words of a weight with groups of 32: its disk size for 4- and 8-bit codes; 5-bit codes take
    8-bit fields, with one scale (Q5_0) or a scale and a min (Q5_1) of 16 bits a group."""
    if name in ("Q5_0", "Q5_1"):
        return n * k + n * (k // 32) * (2 if name == "Q5_0" else 4)
    return None


@pytest.mark.parametrize("name", AFFINE_TYPES)
def test_the_registry_runs_them_on_the_affine_kernels(name):
    w, _ = make_gguf(64, 256, name, device="cpu")
    dtypes = (torch.float16, torch.bfloat16) if torch.cuda.is_available() else (torch.float16,)   # bf16 asks the GPU
    for dtype in dtypes:
        module, reason = registry.select(w, torch.device("cuda"), dtype)
        assert module is affine and reason == "first choice"


def test_other_types_go_to_the_ggml_kernels_as_a_named_fallback():
    t = GGMLQuantizationType.Q4_K                                  # 144 bytes a block of 256
    w = Gguf(data=torch.zeros(8, 144, dtype=torch.uint8), ggml_type=int(t), shape=(8, 256))
    module, reason = registry.select(w, torch.device("cuda"), torch.float16)
    assert module.NAME == "triton_ggml" and "triton_affine: gguf q4_K: no exact affine form" in reason


@pytest.mark.parametrize("name", AFFINE_TYPES)
def test_held_at_their_disk_bytes(name):
    n, k = 64, 512
    w, _ = make_gguf(n, k, name)
    st = affine.prepare(w, DEVICE, torch.float16)
    want = expected_bytes(name, n, k)
    assert held_bytes(st) == (w.nbytes if want is None else want)
    assert held_bytes(st) < 2 * n * k * 0.6                       # far below a 16-bit copy


@pytest.mark.parametrize("name", AFFINE_TYPES)
@pytest.mark.parametrize("path,m", [("gemv", 1), ("gemv", 2), ("splitk", 5), ("cublas", 3), (None, 1), (None, 7)])
def test_every_path_matches_the_gguf_dequantization(name, path, m):
    """K = 288: not a multiple of the 128-column tile of 4-bit codes; odd N."""
    w, ref_w = make_gguf(73, 288, name, seed=1)
    st = affine.prepare(w, DEVICE, torch.float16)
    x = torch.randn(m, 288, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    y = plan.matmul(x, st, path=path)
    assert rel_err(y, x.double() @ ref_w.double().T.to(DEVICE)) < TOL[torch.float16]
    assert affine.path(st, m)[0].startswith("triton_affine/")


@pytest.mark.gpu
@pytest.mark.parametrize("name", AFFINE_TYPES)
def test_gpu_real_shape_at_disk_bytes(name):
    """4096 x 4096 on CUDA: the registry's choice, the device memory prepare() leaves (no 16-bit copy), and every
    planned path of M = 1..300 against the gguf package's dequantization, fp16 and bf16."""
    n = k = 4096
    w, ref_w = make_gguf(n, k, name, device="cuda")
    ref_w = ref_w.cuda().double()
    for dtype in (torch.float16, torch.bfloat16):
        module, _ = registry.select(w, torch.device("cuda"), dtype)
        assert module is affine
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        st = module.prepare(w, torch.device("cuda"), dtype)
        torch.cuda.synchronize()
        want = expected_bytes(name, n, k)
        assert held_bytes(st) == (w.nbytes if want is None else want)
        assert torch.cuda.memory_allocated() - before <= held_bytes(st) + (1 << 20)
        for m in (1, 2, 16, 64, 300):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            assert rel_err(module.apply(x, st), x.double() @ ref_w.T) < TOL[dtype], (dtype, m, module.path(st, m))
