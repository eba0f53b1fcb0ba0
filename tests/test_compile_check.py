"""Every Triton kernel compiles (to cubin, through the wheel's ptxas) for sm75, sm80, sm89 and sm90.

Runs in subprocesses without TRITON_INTERPRET: the interpreter tests in this process decorate the kernels
as interpreted functions, which cannot be compiled. The four targets compile side by side (each process is
one thread of LLVM and ptxas), started together by the first test that asks for one.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import compile_check


@pytest.fixture(scope="module")
def compiling():
    """target -> (its process, its stdout file, its stderr file), every target's process already running."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {}
    for cc in compile_check.TARGETS:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("compile_check.py")), "--target",
                                 str(cc)], stdout=out, stderr=err, text=True, env=env)
        runs[cc] = (proc, out, err)
    yield runs
    for proc, out, err in runs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
        err.close()


@pytest.mark.parametrize("cc", compile_check.TARGETS)
def test_every_kernel_compiles(cc, compiling):
    proc, out, err = compiling[cc]
    returncode = proc.wait(timeout=900)
    out.seek(0)
    err.seek(0)
    assert returncode == 0, err.read()[-3000:]
    assert f"sm{cc}:" in out.read()
