"""cpu_lut: NF4 / FP4 and FP8 weights on the CPU through a table of their values (ggml_matmul.c), against the
bitsandbytes tables applied to the codes in float64 and torch's float8 conversion times the scales; a row the same
bit for bit whatever the batch; the FP8 codes held as the weight's own bytes."""
import shutil

import pytest
import torch

from quanta.kernels import registry
from quanta.cpu import lut as cpu_lut
from test_codebook_gemm import make_codebook
from test_cpu_rows import codebook_oracle, fp8_oracle
from test_fp8_gemm import make_fp8

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

CPU = torch.device("cpu")
CASES = {
    "nf4": lambda: (w := make_codebook(72, 256, 64, "nf4", False, device="cpu"), codebook_oracle(w)),
    "fp4-dq": lambda: (w := make_codebook(40, 192, 64, "fp4", True, device="cpu"), codebook_oracle(w)),
    "nf4-rows-a-block": lambda: (w := make_codebook(32, 32, 64, "nf4", False, device="cpu"), codebook_oracle(w)),
    "fp8-channel": lambda: (w := make_fp8(72, 256, "e4m3", "channel", device="cpu"), fp8_oracle(w)),
    "fp8-tensor": lambda: (w := make_fp8(72, 256, "e4m3", "tensor", device="cpu"), fp8_oracle(w)),
    "fp8-block": lambda: (w := make_fp8(300, 256, "e4m3", "block", device="cpu"), fp8_oracle(w)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_lut_matches_the_oracle(case, dtype):
    w, want = CASES[case]()
    module, _ = registry.select(w, CPU, dtype)
    assert module is cpu_lut
    state = cpu_lut.prepare(w, CPU, dtype)
    x = torch.randn(5, w.shape[1]).to(dtype)
    got = cpu_lut.apply(x, state)
    ref = x.double() @ want.double().T
    assert got.dtype == dtype and got.shape == (5, w.shape[0])
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    assert cpu_lut.path(state, 5)[0] == "cpu_lut"


def test_fp8_codes_are_the_weights_own_bytes():
    w, _ = CASES["fp8-block"]()
    state = cpu_lut.prepare(w, CPU, torch.float32)
    assert state.codes.data_ptr() == w.data.data_ptr() and state.codes.nbytes == w.data.nbytes


def test_a_row_does_not_depend_on_the_batch():
    for case in ("nf4", "fp8-block"):
        w, _ = CASES[case]()
        state = cpu_lut.prepare(w, CPU, torch.float32)
        x = torch.randn(19, w.shape[1])
        alone = torch.cat([cpu_lut.apply(x[i:i + 1], state) for i in range(19)])
        for m in (2, 5, 19):
            assert torch.equal(cpu_lut.apply(x[:m], state), alone[:m]), (case, m)


def test_it_refuses_what_it_cannot_run(monkeypatch):
    w, _ = CASES["nf4"]()
    assert cpu_lut.supports(w, torch.device("cuda"), torch.float32) == "CPU only"
    assert "float16" in cpu_lut.supports(w, CPU, torch.float16)
    assert "multiple of 16" in cpu_lut.supports(make_fp8(8, 40, "e4m3", "channel", device="cpu"), CPU, torch.float32)
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    assert "no native library" in cpu_lut.supports(w, CPU, torch.float32)
    assert registry.select(w, CPU, torch.float32)[0].NAME == "cpu_rows"
