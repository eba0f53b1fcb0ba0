"""Every Triton kernel compiles (to cubin, through the wheel's ptxas) for sm75, sm80, sm89 and sm90.

Runs in a subprocess without TRITON_INTERPRET: the interpreter tests in this process decorate the kernels
as interpreted functions, which cannot be compiled.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import compile_check


@pytest.mark.parametrize("cc", compile_check.TARGETS)
def test_every_kernel_compiles(cc):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_check.py")), "--target", str(cc)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"sm{cc}:" in run.stdout
