"""DeviceCaps: what a device can run, as one value that kernel plans and the engine read.

Every "can this chip run that" question (bf16 arithmetic, fp8 conversion instructions, Hopper's wgmma
through Gluon, programmatic dependent launch, how many SMs a grid should fill) is answered from a
DeviceCaps, never by querying the device in a kernel module. The value is read from the device once, and
can be replaced by a named preset (QUANTA_DEVICE_CAPS: `preset`) so that one large GPU runs the plan of a
smaller chip. `use_triton` is the single rule for the elementwise and attention ops.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, replace

import torch

from quanta.quant.errors import ConfigError

ENV_VAR = "QUANTA_DEVICE_CAPS"


@dataclass(frozen=True)
class DeviceCaps:
    """Capabilities of one device. `capability` is (0, 0) for the CPU (where Triton only interprets)."""
    name: str
    capability: tuple[int, int]
    sm_count: int
    gluon: bool          # Gluon's Hopper API can run (wgmma, TMA): sm90 with Triton >= 3.6
    pdl: bool            # kernels may be launched with programmatic dependent launch

    @property
    def is_cuda(self) -> bool:
        return self.capability != (0, 0)

    @property
    def bf16(self) -> bool:
        """bfloat16 arithmetic (sm80 and newer)."""
        return self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """fp8 conversion and tensor-core instructions (sm89 and newer)."""
        return self.capability >= (8, 9)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Whether kernels on this device can compute in `dtype`."""
        return dtype != torch.bfloat16 or self.bf16 or not self.is_cuda


# Named chips for QUANTA_DEVICE_CAPS and for tests: SM counts of the usual card of each generation.
PRESETS: dict[str, DeviceCaps] = {
    "cpu": DeviceCaps("cpu", (0, 0), 132, gluon=False, pdl=False),
    "sm75": DeviceCaps("sm75", (7, 5), 40, gluon=False, pdl=False),      # T4
    "sm80": DeviceCaps("sm80", (8, 0), 108, gluon=False, pdl=False),     # A100
    "sm86": DeviceCaps("sm86", (8, 6), 84, gluon=False, pdl=False),      # A10 / RTX 3090
    "sm89": DeviceCaps("sm89", (8, 9), 58, gluon=False, pdl=False),      # L4
    "sm90": DeviceCaps("sm90", (9, 0), 132, gluon=True, pdl=True),       # H100
}


def _gluon_importable() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except (ImportError, ValueError):
        return False


def _pdl_available() -> bool:
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _measured(device: torch.device) -> DeviceCaps:
    if device.type != "cuda":
        return PRESETS["cpu"]
    props = torch.cuda.get_device_properties(device.index if device.index is not None
                                             else torch.cuda.current_device())
    cap = (props.major, props.minor)
    return DeviceCaps(f"sm{props.major}{props.minor}", cap, props.multi_processor_count,
                      gluon=cap == (9, 0) and _gluon_importable(),
                      pdl=cap >= (9, 0) and _pdl_available() and os.environ.get("QUANTA_PDL", "1") != "0")


def preset(name: str, real: DeviceCaps | None = None) -> DeviceCaps:
    """The preset called `name` (sm75, sm80, sm86, sm89, sm90, cpu). With `real` (the device's own
    caps), refuse a preset the device cannot stand for, and keep PDL/Gluon only where the device has them.

        QUANTA_DEVICE_CAPS=sm75   # a T4: fp16 only, no bf16, no fp8 instructions, no wgmma, no PDL
        QUANTA_DEVICE_CAPS=sm80   # an A100

    An override can only take capabilities away: the chip must really have what the preset claims, so a
    preset above the device's own compute capability is refused."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ConfigError(f"{ENV_VAR}={name!r} is not one of {', '.join(PRESETS)}")
    caps = PRESETS[key]
    if real is None:
        return caps
    if real.is_cuda != caps.is_cuda or caps.capability > real.capability:
        raise ConfigError(f"{ENV_VAR}={name!r} asks for {caps.name} on a {real.name} device: "
                          "an override can only stand for an older chip")
    return replace(caps, gluon=caps.gluon and real.gluon, pdl=caps.pdl and real.pdl)


@functools.lru_cache(maxsize=None)
def _device_caps(device: torch.device, override: str) -> DeviceCaps:
    real = _measured(device)
    return preset(override, real) if override and device.type == "cuda" else real


def device_caps(device: torch.device | str) -> DeviceCaps:
    """The capabilities kernels plan for on `device`: the device's own, or the QUANTA_DEVICE_CAPS preset."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _device_caps(device, os.environ.get(ENV_VAR, ""))


def use_triton(device: torch.device | str, dtype: torch.dtype, caps: DeviceCaps | None = None) -> bool:
    """Whether the elementwise and attention ops run as Triton kernels (else their torch references):
    on CUDA devices only, with Triton importable, in a dtype the chip computes in.

    This is the single rule for the elementwise and attention ops (RMSNorm, rotary, SiLU-and-mul, the paged KV
    store and attention): the layers, the KV cache and attention all ask it, so they cannot disagree."""
    device = torch.device(device)
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return False
    caps = caps or device_caps(device)
    return dtype in (torch.float16, torch.bfloat16, torch.float32) and caps.supports_dtype(dtype)
