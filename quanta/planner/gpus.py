"""GPUs a plan is made for: `NxSIZE` (1x80GiB, 4x24GiB, 2x16GB) or a card name with an optional count
(t4, 4xt4, h100).

A card's usable memory is what its driver reports as total (nvidia-smi's "Total", the second value of
torch.cuda.mem_get_info): its nominal size less what the driver keeps. GDDR6 datacenter cards with ECC
(T4, L4, A10G) give 1/16 of their memory to ECC (a 16 GiB T4 reports 15 GiB), HBM cards keep some
firmware memory (an 80 GB H100 reports 81559 MiB), consumer cards report (nearly) their full size.
The named cards below carry those reported totals. A size given as NxSIZE is taken to be that reported
total already: give the figure nvidia-smi shows for an unnamed card.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from quanta.quant.errors import ConfigError
from quanta.sizes import parse_bytes

MIB = 2**20

# name -> (MiB the driver reports as total, DeviceCaps preset of its compute capability)
CARDS: dict[str, tuple[int, str]] = {
    "t4": (15360, "sm75"),
    "l4": (23034, "sm89"),
    "a10g": (23028, "sm86"),
    "rtx3090": (24576, "sm86"),
    "rtx4090": (24564, "sm89"),
    "a100-40gb": (40960, "sm80"),
    "a100-80gb": (81920, "sm80"),
    "h100": (81559, "sm90"),
    "h200": (143771, "sm90"),
}

_SPEC = re.compile(r"^\s*(?:(\d+)\s*x\s*)?([a-z0-9.-]+?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Gpus:
    """`count` identical cards of `memory` bytes each (the driver's total); `caps` a DeviceCaps preset
    name (sm75, ...) when the card is known."""
    name: str
    count: int
    memory: int
    caps: str | None = None

    def __str__(self) -> str:
        return f"{self.count}x{self.name}"


def parse_gpus(spec: str | Gpus) -> Gpus:
    """A Gpus from `NxSIZE` or `[Nx]NAME`; ConfigError naming the known cards for anything else."""
    if isinstance(spec, Gpus):
        return spec
    match = _SPEC.match(str(spec))
    if match is None:
        raise ConfigError(f"gpus {spec!r}: expected NxSIZE (1x80GiB, 4x24GiB, 2x16GB) or [N x]NAME "
                          f"({', '.join(CARDS)})")
    count = int(match[1] or 1)
    what = match[2].lower()
    if count < 1:
        raise ConfigError(f"gpus {spec!r}: the count must be at least 1")
    if what in CARDS:
        mib, caps = CARDS[what]
        return Gpus(what, count, mib * MIB, caps)
    memory = parse_bytes(what, unit_required=True)
    if memory is None:
        raise ConfigError(f"gpus {spec!r}: {match[2]!r} is neither a size (80GiB, 24GB) nor a known card "
                          f"({', '.join(CARDS)})")
    if memory < MIB:
        raise ConfigError(f"gpus {spec!r}: {match[2]} is too small for a GPU")
    return Gpus(match[2], count, memory)


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes of `value`: a positive int, a size string (15GiB, 16GB, 512MiB) or a card name (t4, l4: its
    reported total); ConfigError naming `what` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{what} must be bytes (an int) or a size such as '15GiB', got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{what} must be positive, got {value}")
        return value
    text = value.strip().lower()
    if text in CARDS:
        return CARDS[text][0] * MIB
    memory = parse_bytes(text, unit_required=True)
    if memory is None:
        raise ConfigError(f"{what} {value!r} is not a size (15GiB, 16GB, 512MiB) or a known card "
                          f"({', '.join(CARDS)})")
    if memory < 1:
        raise ConfigError(f"{what} {value!r} must be positive")
    return memory
