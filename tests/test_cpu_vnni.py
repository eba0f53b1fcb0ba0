"""cpu_vnni (4- and 8-bit affine weights, 8-bit activation blocks, VNNI dot products) against the gguf package's
dequantization of the same blocks and the weights' own dequantize(), with x replaced by its 8-bit blocks as this file
computes them (llama.cpp's rule); a row's result the same bit for bit whatever the batch and the thread count; the
weight held at its stored bytes; what it refuses."""
import dataclasses
import os

import pytest
import torch

from kernel_util import rel_err  # noqa: I001
from quanta.kernels import registry
from quanta.cpu import ggml as cpu_ggml, vnni
from quanta.quant import native_build
from quanta.quant.kinds.affine import Affine
from test_affine_gemm import make_affine
from test_affine_gguf import make_gguf
from test_ggml_gemm import make_gguf as random_gguf

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(vnni._library() is None or not vnni._library().quanta_vnni_available(),
                                reason="no AVX512-VNNI or AVX2 build on this CPU")
AVX2 = (*cpu_ggml._BASE, "-mavx2", "-mfma", "-mf16c", "-fopenmp")       # what a CPU without AVX-512 builds
AVX_VNNI = (*AVX2, "-mavxvnni")                                          # and one with 256-bit VNNI (Alder Lake on)


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernel sees it, in float64: blocks of 32 with d = max |x| / 127, codes x * 127 / max |x|
    rounded half to even (float32 arithmetic)."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (codes.double() * (amax / 127).double()).reshape(x.shape)


def half_exact(w: Affine) -> Affine:
    """w with scales (and mins) that float16 holds exactly, as checkpoints store them."""
    mins = None if w.mins is None else w.mins.half().float()
    return dataclasses.replace(w, scales=w.scales.half().float(), mins=mins)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n", [96, 530])
def test_gguf_types_match_the_gguf_package(name, n):
    """Every mode of the kernel's offset (Q4_0's one zero, Q4_1's mins, Q8_0's zero 128 on 8-bit codes), with a
    last tile of 16 rows only partly filled (530 rows), a bias, and the file's bytes held (with 530 rows, the
    padding's 2.6% more)."""
    w, ref = make_gguf(n, 256, name, device="cpu")
    assert registry.select(w, CPU, torch.float32)[0] is vnni
    st = vnni.prepare(w, CPU, torch.float32)
    held = st.codes.nbytes + st.scales.nbytes + (0 if st.offsets is None else st.offsets.nbytes)
    assert held == w.data.nbytes * (-(-n // 16) * 16) // n
    x, bias = torch.randn(2, 3, 256), torch.randn(n)
    y = vnni.apply(x, st, bias)
    want = q8_blocks(x) @ ref.double().T + bias.double()
    assert y.shape == (2, 3, n) and y.dtype == torch.float32
    assert rel_err(y, want) < 1e-6
    assert rel_err(y, x.double() @ ref.double().T + bias.double()) < 2e-2     # what the 8-bit blocks cost


@pytest.mark.parametrize("bits,group,zero", [(4, 128, "asym"), (4, 64, "sym"), (4, 32, "fmin"), (8, 128, "sym"),
                                             (8, -1, "asym")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_affine_groups_match_dequantize(bits, group, zero, dtype):
    """AWQ / GPTQ-like groups (per-group integer zeros, one zero, float mins; channel-wise 8-bit) in float32 and
    bfloat16 activations."""
    w = half_exact(make_affine(48, 384, bits, group, zero, device="cpu"))
    assert vnni.supports(w, CPU, dtype) is None
    st = vnni.prepare(w, CPU, dtype)
    x = torch.randn(5, 384).to(dtype)
    y = vnni.apply(x, st)
    assert y.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2          # bfloat16: the output's rounding
    assert rel_err(y, q8_blocks(x) @ w.dequantize().double().T) < tol
    assert vnni.compute_dtype(dtype) == torch.int8
    assert vnni.path(st, 5)[0] == "cpu_vnni"


def test_rows_do_not_depend_on_the_batch_or_the_threads():
    """A row alone, in batches of every size (passes of four rows and one), with one thread or two: bit for bit."""
    w, _ = make_gguf(200, 576, "Q4_1", device="cpu")
    st = vnni.prepare(w, CPU, torch.float32)
    x = torch.randn(67, 576)
    alone = torch.cat([vnni.apply(x[i:i + 1], st) for i in range(67)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (2, 5, 33, 67):
                assert torch.equal(vnni.apply(x[:m], st), alone[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


def test_it_refuses_what_it_cannot_run():
    w = half_exact(make_affine(64, 256, 4, 64, "sym", device="cpu"))
    assert vnni.supports(w, torch.device("cuda"), torch.float32) == "CPU only"
    assert "plain 4- or 8-bit" in vnni.supports(half_exact(make_affine(64, 256, 4, 64, "sym", act_order=True,
                                                                       device="cpu")), CPU, torch.float32)
    assert "plain 4- or 8-bit" in vnni.supports(half_exact(make_affine(64, 256, 3, 64, "sym", device="cpu")), CPU,
                                                torch.float32)
    assert "multiples of 32" in vnni.supports(half_exact(make_affine(64, 240, 4, 48, "sym", device="cpu")), CPU,
                                              torch.float32)
    assert "float16 does not hold" in vnni.supports(make_affine(64, 256, 4, 64, "sym", device="cpu"), CPU,
                                                    torch.float32)
    assert "padding would hold 30% more" in vnni.supports(make_gguf(37, 256, "Q4_0", device="cpu")[0], CPU,
                                                           torch.float32)
    w5, _ = make_gguf(64, 256, "Q5_1", device="cpu")
    assert "plain 4- or 8-bit" in vnni.supports(w5, CPU, torch.float32)


@pytest.mark.parametrize("flags", [AVX2, AVX_VNNI], ids=["avx2", "avx-vnni"])
def test_the_avx2_build_gives_the_avx512_builds_numbers(monkeypatch, flags):
    """Built as for a CPU without AVX-512 (the 16 lanes as two halves; vpmaddubsw / vpmaddwd for vpdpbusd, 8-bit
    codes a nibble at a time, or AVX-VNNI's 256-bit vpdpbusd), the kernel computes every weight mode and batch bit
    for bit as this CPU's build does."""
    avx2 = native_build.load(vnni.SOURCE, (flags,), "the AVX2 VNNI matmul")
    if avx2 is None or not _runs(flags):
        pytest.skip(f"this compiler or CPU cannot build and run {' '.join(flags[-2:])}")
    native = vnni._library()
    avx2.quanta_vnni_matmul.restype, avx2.quanta_vnni_matmul.argtypes = (native.quanta_vnni_matmul.restype,
                                                                         native.quanta_vnni_matmul.argtypes)
    weights = [random_gguf(530, 512, name, device="cpu")[0] for name in ("Q4_0", "Q4_1", "Q8_0")]
    weights += [half_exact(make_affine(48, 384, bits, 128, "asym", device="cpu")) for bits in (4, 8)]
    x = torch.randn(7, 512)
    for w in weights:
        st = vnni.prepare(w, CPU, torch.float32)
        rows = x[:, :w.shape[1]]
        want = vnni.apply(rows, st)
        monkeypatch.setattr(vnni, "_library", lambda: avx2)
        got = vnni.apply(rows, st)
        monkeypatch.setattr(vnni, "_library", lambda: native)
        assert torch.equal(got, want), w.describe()


def _runs(flags: tuple[str, ...]) -> bool:
    """Whether this CPU has the instruction sets `flags` ask for (Linux's /proc/cpuinfo flags)."""
    have = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    wanted = {"-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c", "-mavxvnni": "avx_vnni"}
    return all(wanted[f] in have for f in flags if f in wanted)
