"""The CPU decoder layer's small operations in native code (layer_ops.c): attention over the paged KV cache, rotary
with the KV store, RMSNorm with the residual add, SiLU-and-mul, each one call a layer instead of a dozen torch ops.

Each computes a row from that row alone, in one fixed order (the C file says how), so the engine's CPU path stays
batch-invariant; the engine takes them for every step or for none (`usable`: float32 activations, a library built).
Without a C compiler, or with QUANTA_NATIVE=0, the torch versions run.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
from dataclasses import dataclass

import torch

from quanta.cpu.ggml import FLAG_SETS
from quanta.quant.fp8_codes import Fp8Format, fp8_values
from quanta.quant import native_build

SOURCE = pathlib.Path(__file__).with_name("layer_ops.c")
ROW_BLOCK = 16              # rows of one sequence sharing key tiles (layer_ops.c's ROW_BLOCK)
CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3}
_P = ctypes.c_void_p
_I = ctypes.c_int64
SIGNATURES = {
    "quanta_cpu_attention": [_P, _I, _I, _I, _I, ctypes.c_float, _P, _P, ctypes.c_int, _I, _P, _I, _P, _P, _P, _P,
                             _I, _P, _P, _P, ctypes.c_int],
    "quanta_cpu_rope_store": [_P, _P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _P, ctypes.c_int, _P, _P, ctypes.c_int],
    "quanta_cpu_rms_norm": [_P, _P, _P, ctypes.c_float, _I, _I, _P, _P, ctypes.c_int],
    "quanta_cpu_silu_mul": [_P, _I, _I, _P, ctypes.c_int],
}


def usable(x: torch.Tensor) -> bool:
    """Whether the native operations run activations like `x` (float32 on the CPU, and the library built:
    QUANTA_NATIVE is read once, as the library loads)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _library() is not None


@dataclass
class Rows:
    """A step's query rows for attention: each row's sequence (its row of `tables`), position, and first visible
    key (under a sliding window); position -1 marks a row that attends nothing (padding). `blocks` cuts the rows
    into runs of at most ROW_BLOCK rows of one sequence, which share the key tiles they read."""
    seq: torch.Tensor           # int32 [T]
    pos: torch.Tensor           # int32 [T]
    lo: torch.Tensor            # int32 [T]
    tables: torch.Tensor        # int32 [B, max_blocks], contiguous
    blocks: torch.Tensor        # int32 [runs + 1]: run i is rows blocks[i] .. blocks[i + 1] - 1


def rows(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
         sliding_window: int | None) -> Rows:
    """The step's Rows, made once and shared by every layer: sequence b's queries are rows
    query_start_loc[b] .. query_start_loc[b + 1] and the last of them sits at position seq_lens[b] - 1."""
    starts, lens = query_start_loc.to(torch.int64), seq_lens.to(torch.int64)
    row = torch.arange(int(starts[-1]))
    owner = torch.repeat_interleave(torch.arange(lens.numel()), starts[1:] - starts[:-1])     # each row's sequence
    live = lens[owner] > 0                          # a sequence of length 0 is padding: its rows attend nothing
    pos = torch.where(live, lens[owner] - (starts[1:][owner] - row), -1).to(torch.int32)
    seq = torch.where(live, owner, 0).to(torch.int32)
    cuts = torch.cat([row[(row - starts[owner]) % ROW_BLOCK == 0], row.new_tensor([row.numel()])])
    lo = torch.zeros_like(pos) if sliding_window is None else (pos - sliding_window + 1).clamp_min(0)
    return Rows(seq, pos, lo, block_tables.to(torch.int32).contiguous(), cuts.to(torch.int32))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: Rows, scale: float,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              fmt: Fp8Format | None = None) -> torch.Tensor:
    """Attention of q [T, Hq, D] (float32) over caches [blocks, block_size, Hk, D] (float32 / 16-bit, or uint8 fp8
    codes with `fmt` and per-head scales), which already hold the step's keys and values: [T, Hq, D] float32."""
    t, hq, d = q.shape
    hk, block_size = k_cache.shape[2], k_cache.shape[1]
    q = q.contiguous()
    out = torch.empty_like(q)
    k_table = v_table = None
    if fmt is not None:
        values = fp8_values(fmt.torch_dtype)
        k_table = (values[None, :] * k_scale.float()[:, None]).contiguous()     # codes * scale, as dequantize()
        v_table = (values[None, :] * v_scale.float()[:, None]).contiguous()
    _library().quanta_cpu_attention(
        q.data_ptr(), t, hq, hk, d, scale, k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPES[k_cache.dtype],
        block_size, step.tables.data_ptr(), step.tables.shape[1], step.seq.data_ptr(), step.pos.data_ptr(),
        step.lo.data_ptr(), step.blocks.data_ptr(), step.blocks.numel() - 1, _ptr(k_table), _ptr(v_table),
        out.data_ptr(), torch.get_num_threads())
    return out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
    """Rotated q [T, Hq, D]; k rotated and v stored in the caches at `slots` (none where < 0), as rotary.rotate and
    paged_kv.reference_store do it. q, k, v: views of one [T, width] float32 q/k/v output; cos, sin [T, 1, D] float32.
    None where these inputs are not that (the caller's torch path runs)."""
    if k_cache.dtype == torch.uint8 or not _one_row_layout(q, k, v) or cos.dtype != torch.float32:
        return None
    t, hq, d = q.shape
    out = torch.empty(t, hq, d)
    slots = slots.to(torch.int64).contiguous()
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    _library().quanta_cpu_rope_store(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), t, q.stride(0), hq, k.shape[1], d, cos.data_ptr(), sin.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), CACHE_DTYPES[k_cache.dtype], slots.data_ptr(), out.data_ptr(),
        torch.get_num_threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """fused_norm.reference's result for float32 rows: y, or (y, x + residual) with a residual."""
    x = x.contiguous()
    rows, dim = x.numel() // x.shape[-1], x.shape[-1]
    y = torch.empty_like(x)
    h = None if residual is None else torch.empty_like(x)
    res = None if residual is None else residual.contiguous()
    w = weight.float().contiguous()             # held here: the call reads it
    _library().quanta_cpu_rms_norm(x.data_ptr(), _ptr(res), w.data_ptr(), eps, rows, dim, y.data_ptr(), _ptr(h),
                                   torch.get_num_threads())
    return y if residual is None else (y, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for float32 x [..., 2 * I] = [gate | up]."""
    x = x.contiguous()
    inter = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], inter)
    _library().quanta_cpu_silu_mul(x.data_ptr(), x.numel() // x.shape[-1], inter, y.data_ptr(),
                                   torch.get_num_threads())
    return y


def _one_row_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """q, k, v float32 [T, H, D] with heads of D back to back and one row stride (views of one q/k/v output; a
    single row's stride is whatever its view says, and unused)."""
    return all(x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
               and (x.shape[0] == 1 or x.stride(0) == q.stride(0)) for x in (q, k, v))


def _ptr(x: torch.Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, FLAG_SETS, "the native CPU layer operations")
    if lib is not None:
        for name, args in SIGNATURES.items():
            getattr(lib, name).restype = None
            getattr(lib, name).argtypes = args
    return lib
