"""ggml's reference quantizers compiled from native.c: the same bytes as the torch quantizers (tests hold them
equal), a block at a time in C instead of a tensor op at a time over a chunk; every type without an importance
matrix, and all but Q2_K, Q3_K and Q8_0 with one (Q8_0 has no such path).

The library is built on first use with the system C compiler (the one Triton's launchers need too; see
quanta.quant.native_build). Where no compiler works, or QUANTA_NATIVE=0, `quantizer` returns None and the torch
quantizers run. Rows are split over
torch's thread count: ctypes lets go of the GIL during a call, so the pieces run at once.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from quanta.quant import native_build
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME

SOURCE = pathlib.Path(__file__).with_name("native.c")
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
# with an importance matrix too (the _impl paths)
WEIGHTED = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
# -ffp-contract=off: no fused multiply-adds, each float operation rounds on its own as the reference's do
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=c11")
PIECE_BLOCKS = 64           # blocks a thread takes at a time at least


def quantizer(type_name: str, weighted: bool = False) -> Callable[..., torch.Tensor] | None:
    """The compiled reference quantizer of `type_name`: float32 blocks x [nb, block_size] (CPU; with `weighted`,
    and importance weights qw of x's shape and the blocks a row holds, row_blocks) -> uint8 blocks [nb, type_size];
    or None when there is none (type not here, no compiler, QUANTA_NATIVE=0)."""
    if type_name not in (WEIGHTED if weighted else TYPES) or not native_build.enabled():
        return None
    lib = _library()
    if lib is None:
        return None
    fn = getattr(lib, f"quanta_quantize_{type_name}" + ("_w" if weighted else ""))
    return functools.partial(_run, fn, GGML_TYPES_BY_NAME[type_name].type_size, weighted)


def _run(fn, type_size: int, weighted: bool, x: torch.Tensor, qw: torch.Tensor | None = None,
         row_blocks: int = 1) -> torch.Tensor:
    assert x.device.type == "cpu" and x.dtype == torch.float32, (x.device, x.dtype)
    assert weighted == (qw is not None) and x.shape[0] % row_blocks == 0
    x = x.contiguous()
    if weighted:
        qw = qw.to(torch.float32).contiguous()
        assert qw.shape == x.shape, (qw.shape, x.shape)
    nb = x.shape[0]
    out = torch.empty(nb, type_size, dtype=torch.uint8)
    rows = nb // row_blocks
    threads = max(1, min(torch.get_num_threads(), nb // PIECE_BLOCKS, rows))
    bounds = [rows * t // threads * row_blocks for t in range(threads + 1)]       # whole rows a thread
    block = x.shape[1] * 4

    def piece(t: int) -> None:
        lo, hi = bounds[t], bounds[t + 1]
        args = [ctypes.c_void_p(x.data_ptr() + lo * block)]
        args += [ctypes.c_void_p(qw.data_ptr() + lo * block)] if weighted else []
        args += [ctypes.c_void_p(out.data_ptr() + lo * type_size), ctypes.c_int64(hi - lo)]
        fn(*args, *([ctypes.c_int64(row_blocks)] if weighted else []))

    if threads == 1:
        piece(0)
    else:
        list(_pool(threads).map(piece, range(threads)))
    return out


@functools.lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="quanta-ggml")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, (FLAGS,), "the native ggml quantizers")
    if lib is None:
        return None
    for name in TYPES:
        getattr(lib, f"quanta_quantize_{name}").restype = None
    for name in WEIGHTED:
        getattr(lib, f"quanta_quantize_{name}_w").restype = None
    return lib
