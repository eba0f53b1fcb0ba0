"""What every Triton kernel module shares: the import guard, the device check, small launch helpers.

Kernels run on CUDA devices, and on the CPU only under Triton's interpreter (`TRITON_INTERPRET=1`,
set by the tests before the kernel modules are imported). What a device can run (bf16, PDL, its SM count)
comes from its DeviceCaps (device_caps.py), never from a query here.
"""
from __future__ import annotations

import torch

from quanta.kernels.device_caps import DeviceCaps, device_caps

try:
    import triton
    import triton.language as tl
    TRITON_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - triton ships with torch on Linux
    triton = tl = None
    TRITON_ERROR = f"triton is not importable ({exc})"
try:                                 # Triton >= 3.4: programmatic dependent launch (see the end of this file)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


def why_not_device(device: torch.device, dtype: torch.dtype,
                   dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)) -> str | None:
    """None if a Triton kernel can run on `device` computing in `dtype`, else the reason (bf16 as the device's
    DeviceCaps say, so that QUANTA_DEVICE_CAPS=sm75 refuses it)."""
    if TRITON_ERROR is not None:
        return TRITON_ERROR
    if torch.device(device).type != "cuda":
        return f"Triton kernels run on CUDA devices, not {torch.device(device).type}"
    if dtype not in dtypes:
        return f"computes in {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {dtype}"
    if dtype == torch.bfloat16 and not device_caps(device).bf16:
        return f"bfloat16 needs sm80 or newer, the device plans as {device_caps(device).name}"
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_scratch: dict[tuple, torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def zeroed_scratch(key: tuple, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer kept under `key` for kernels that leave it zeroed after each launch (split-K
    partials, split counters): at least `shape[0]` rows of `shape[1:]`. Launches sharing one must be ordered,
    as on one stream. It never shrinks, and a grown one keeps the old alive, since CUDA graphs captured
    earlier hold its address."""
    buf = _scratch.get(key)
    if buf is None or buf.shape[0] < shape[0]:
        if buf is not None:
            _retired.append(buf)
        buf = _scratch[key] = torch.zeros(shape, dtype=dtype, device=device)
    return buf


def split_k(tiles_out: int, k_tiles: int, sms: int, waves: float, min_tiles: int) -> tuple[int, int]:
    """Split the K loop so that about `waves * sms` programs run; returns (splits, k tiles per split).

    Each split keeps at least `min_tiles` K tiles so the partial sums stay worth their atomics.
    """
    want = max(1, round(waves * sms / max(tiles_out, 1)))
    return _even_splits(k_tiles, max(1, min(want, k_tiles // max(min_tiles, 1))))


def _even_splits(k_tiles: int, splits: int) -> tuple[int, int]:
    """(splits, K tiles per split) for about `splits` equal splits of which none is empty."""
    per = cdiv(k_tiles, splits)
    return cdiv(k_tiles, per), per


def whole_wave_split_k(tiles_out: int, k_tiles: int, sms: int, min_tiles: int) -> tuple[int, int]:
    """Split the K loop of compute-bound programs, one per SM, so that the last wave is not left mostly idle;
    returns (splits, k tiles per split), the split count of least `wave_steps`."""
    return _even_splits(k_tiles, min(range(1, max(1, k_tiles // max(min_tiles, 1)) + 1),
                                     key=lambda s: wave_steps(tiles_out, k_tiles, sms, s)))


def wave_steps(tiles_out: int, k_tiles: int, sms: int, splits: int) -> int:
    """Time of a split-K launch of compute-bound programs, one per SM, in K-tile steps of one program: waves x
    (K tiles per program + 2 for its prologue and epilogue), plus 2 for zeroing the output of a split one.
    Fit to the affine MMA kernel at M = 256 on the H100 (8B/70B shapes): a program's prologue and epilogue cost
    about two K tiles of a 128 x 256 program."""
    splits, per = _even_splits(k_tiles, splits)
    return cdiv(tiles_out * splits, sms) * (per + 2) + 2 * (splits > 1)


def stream_k(tiles_out: int, k_tiles: int, sms: int) -> tuple[int, int, int, int]:
    """Whole waves of output tiles, then stream-K for the rest: each of at most `sms` programs takes an equal run
    of the remaining (tile, K tile) steps, crossing at most one tile boundary (there are fewer tiles than SMs).
    Returns (tiles done whole, steps per stream program, stream programs, time in `wave_steps`' units: two
    prologues and epilogues per stream program and the zeroing of the output)."""
    whole = tiles_out // sms * sms
    rest = (tiles_out - whole) * k_tiles
    iters = cdiv(rest, sms)
    programs = cdiv(rest, iters) if rest else 0
    return whole, iters, programs, whole // sms * (k_tiles + 2) + (iters + 4 + 2 if rest else 0)


# --- programmatic dependent launch (PDL, sm90+) --------------------------------------------------
# The decode chain's kernels (RMSNorm, GEMV, rotary, KV store, paged decode) can be launched with PDL: a
# kernel starts while its predecessor finishes, issues what does not depend on it (the GEMV's first weight
# loads), and waits (griddepcontrol.wait) before it reads the predecessor's output or writes anything. Every
# kernel launched so must call pdl_wait before its first dependent read and its first write. On where the
# device's DeviceCaps say so (sm90 with Triton's griddepcontrol, not interpreting; QUANTA_PDL=0 turns it off),
# since the launch gaps it hides are a visible share of a batch-1 decode step. CUDA graphs keep the
# programmatic edges when capturing.

def pdl_launch(caps: DeviceCaps) -> dict:
    """The launch keywords for PDL on a device of these caps: the kernel's PDL constexpr, always given (a Gluon
    kernel's may have no default), and `launch_pdl` only when on, so Triton versions without that option work."""
    return {"PDL": True, "launch_pdl": True} if caps.pdl else {"PDL": False}


if triton is not None:
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel has finished and its writes are visible (PDL); no-op without."""
        if PDL:
            gdc_wait()

    @triton.jit
    def pdl_launch_dependents(PDL: tl.constexpr):
        """Let the next kernel start launching now (PDL); no-op without."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def _zero_kernel(y_ptr, numel, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """y[:numel] = 0. Under PDL the next kernel may launch at once, but the stores wait for the kernel
        before: y is fresh memory from the caching allocator, which that kernel may still be reading."""
        pdl_launch_dependents(PDL)
        pdl_wait(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.zeros((BLOCK,), y_ptr.dtype.element_ty), mask=offs < numel)


ZERO_BLOCK = 4096


def zero_(y: torch.Tensor) -> torch.Tensor:
    """Zero a contiguous tensor in place with a Triton kernel, in the PDL chain where it is on: the output of a
    split-K launch that adds its partial sums. torch's memset is no PDL kernel: between two of them it would make
    the second wait for the first to finish before launching."""
    assert y.is_contiguous() and y.numel() < 2 ** 31
    if y.numel():
        _zero_kernel[(cdiv(y.numel(), ZERO_BLOCK),)](y, y.numel(), BLOCK=ZERO_BLOCK, num_warps=4,
                                                     **pdl_launch(device_caps(y.device)))
    return y
