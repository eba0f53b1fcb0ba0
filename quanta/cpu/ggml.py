"""GGUF weights on the CPU as the file stores them: ggml_matmul.c dequantizes a tile of four weight rows into a
float scratch and multiplies it with every activation row, in float32, threaded over the tiles with OpenMP
(torch's own runtime, so the two share their threads).

Every ggml type quanta reads is held at exactly its file's bytes (the blocks are a view of the loaded tensor), and
every product is one float32 dot product summed in a fixed order whatever the batch (the C file says how), so the
kernel is batch-invariant as the engine's CPU path must be. Without a C compiler, or with QUANTA_NATIVE=0, the
weight goes to the next kernel in the registry's order.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
from dataclasses import dataclass

import torch

from quanta.cpu import affine as cpu_affine
from quanta.cpu.affine import reference  # noqa: F401  (the oracle)
from quanta.quant import native_build
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor

NAME = "cpu_ggml"
SOURCE = pathlib.Path(__file__).with_name("ggml_matmul.c")
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K", "iq4_nl", "iq4_xs")
# -ffp-contract=off: the dequantized values round as ggml's do (the products use explicit fused multiply-adds);
# OpenMP from the runtime torch has loaded (libgomp.so.1 is resolved by its name to the one already in the process)
_BASE = ("-O3", "-fPIC", "-shared", "-std=c11", "-ffp-contract=off", "-fno-fast-math")
_NATIVE = ("-march=native", "-mprefer-vector-width=512")
FLAG_SETS = ((*_BASE, *_NATIVE, "-fopenmp"), (*_BASE, *_NATIVE), (*_BASE, "-march=native"), _BASE)


@dataclass
class State:
    blocks: torch.Tensor        # uint8 [N, K / block_size * type_size]: the file's bytes
    type_id: int
    in_features: int
    out_features: int


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    if torch.device(device).type != "cpu":
        return "CPU only"
    if not isinstance(weight, Gguf):
        return "GGUF blocks only"
    if weight.type.name not in TYPES:
        return f"no native kernel for {weight.type.name}"
    if dtype not in cpu_affine.DTYPES:
        return f"computes in float32 from bfloat16 or float32, not {dtype}"
    return native_build.missing(library)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The products run in float32 whatever the activations' dtype."""
    return torch.float32


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    n, k = weight.shape
    return State(weight.data.reshape(n, -1).contiguous(), weight.type.id, k, n)


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, state.in_features).to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], state.out_features)
    if rows.shape[0]:
        done = library().quanta_ggml_matmul(state.type_id, rows.data_ptr(), rows.shape[0], state.in_features,
                                             state.blocks.data_ptr(), state.out_features, y.data_ptr(),
                                             torch.get_num_threads())
        assert done == 0, (state.type_id, state.in_features)       # supports() admitted only what it holds
    return cpu_affine.finish(y, x.shape[:-1], state.out_features, x.dtype, bias)


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return NAME, "ggml blocks as stored, dequantized four rows at a time in native code, float32 products"


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The native library of ggml_matmul.c (cpu_ggml's and cpu_lut's entry points), None where it cannot be built."""
    lib = native_build.load(SOURCE, FLAG_SETS, "the native ggml matmul")
    if lib is not None:
        fn = lib.quanta_ggml_matmul
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        lut, p, i64 = lib.quanta_lut_matmul, ctypes.c_void_p, ctypes.c_int64     # cpu_lut's entry point
        lut.restype = ctypes.c_int
        lut.argtypes = [p, i64, i64, p, ctypes.c_int, p, p, i64, i64, i64, i64, p, ctypes.c_int]
    return lib
