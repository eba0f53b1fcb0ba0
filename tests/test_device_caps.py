"""DeviceCaps: the presets, what an override may claim, and the Triton-or-torch rule, without a GPU."""
import dataclasses

import pytest
import torch

import kernel_util  # noqa: F401  (sets TRITON_INTERPRET without a GPU)
from quanta.kernels.device_caps import ENV_VAR, PRESETS, device_caps, preset, use_triton
from quanta.quant.errors import ConfigError


def test_presets_say_what_each_chip_runs():
    t4, a100, l4, h100 = PRESETS["sm75"], PRESETS["sm80"], PRESETS["sm89"], PRESETS["sm90"]
    assert not t4.bf16 and not t4.fp8 and not t4.gluon and not t4.pdl
    assert a100.bf16 and not a100.fp8 and l4.fp8 and not l4.gluon
    assert h100.bf16 and h100.fp8 and h100.gluon and h100.pdl
    assert not t4.supports_dtype(torch.bfloat16) and t4.supports_dtype(torch.float16)
    assert PRESETS["cpu"].supports_dtype(torch.bfloat16) and not PRESETS["cpu"].is_cuda


def test_an_override_only_takes_capabilities_away():
    h100_no_pdl = dataclasses.replace(PRESETS["sm90"], pdl=False)
    assert preset("sm80", h100_no_pdl) == PRESETS["sm80"]
    assert preset("SM90", h100_no_pdl).pdl is False and preset("sm90", h100_no_pdl).gluon is True
    with pytest.raises(ConfigError, match="older chip"):
        preset("sm90", PRESETS["sm80"])
    with pytest.raises(ConfigError, match="older chip"):
        preset("sm75", PRESETS["cpu"])
    with pytest.raises(ConfigError, match=ENV_VAR):
        preset("sm70")


def test_the_cpu_is_never_overridden(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "sm75")
    assert device_caps("cpu") == PRESETS["cpu"] and not device_caps(torch.device("cpu")).pdl


def test_triton_only_on_cuda_in_a_dtype_the_chip_computes_in():
    assert not use_triton("cpu", torch.float16)
    assert not use_triton("cpu", torch.float32, PRESETS["sm90"])
    assert use_triton("cuda", torch.float16, PRESETS["sm75"]) and not use_triton("cuda", torch.bfloat16, PRESETS["sm75"])
    assert use_triton("cuda", torch.bfloat16, PRESETS["sm80"]) and not use_triton("cuda", torch.int8, PRESETS["sm90"])
