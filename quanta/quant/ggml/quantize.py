"""GGML quantization in torch: float weights -> ggml blocks (a `Gguf` QTensor), as llama.cpp makes them.

One small function per type maps float32 blocks x [nb, block_size] (and optional importance
weights qw, same shape) to uint8 blocks [nb, type_size]; QUANTIZERS is the table of them. Without
weights each follows ggml-quants.c's `quantize_row_*_ref` (what llama-quantize does without an
imatrix); with weights, the `quantize_row_*_impl` path llama-quantize takes for an imatrix. The
legacy types Q4_0 .. Q8_0 are here, the K-quants in kquantize.py, IQ4_NL / IQ4_XS in iq4quantize.py. On the CPU
the same bytes come from the compiled reference quantizers where they build (native.py).

An importance matrix is, per input column k, the mean of x_k^2 over calibration activations (what
llama-imatrix collects and llama-quantize reads); `Imatrix` accumulates one from layer inputs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from quanta.quant.errors import CorruptFileError, ShapeError, UnsupportedError
from quanta.quant.ggml import iq4quantize as iq4
from quanta.quant.ggml import kquantize as kq
from quanta.quant.ggml import native
from quanta.quant.ggml.kquantize import f16_bytes
from quanta.quant.ggml.qsearch import first_absmax, inverse, make_qkx_quants, make_qx_quants, seq_sum, sqrtf
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import Gguf

# float32 blocks [nb, block_size] (+ weights) -> uint8 blocks [nb, type_size]
Quantizer = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

# Elements quantized per pass: bounds the temporaries of the K-quant searches to tens of MB.
_CHUNK = 1 << 18


# --- legacy 32-element types ----------------------------------------------------------------------
def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """32 codes -> 16 bytes: element j in the low nibble of byte j, element j+16 in the high one."""
    q = q.to(torch.uint8)
    return (q[:, :16] & 0xF) | (q[:, 16:] << 4)          # uint8 shifts drop the bits above the nibble


_BIT = torch.arange(8, dtype=torch.uint8)


def _qh(q: torch.Tensor) -> torch.Tensor:
    """The 5th bits of 32 codes as a little-endian u32 [nb, 4] (bit j = element j)."""
    bits = ((q.to(torch.uint8) >> 4) & 1).view(-1, 4, 8) << _BIT.to(q.device)
    return bits.sum(2, dtype=torch.uint8)               # distinct bits: the sum is their OR


def _sigma2(x: torch.Tensor, row_blocks: int) -> torch.Tensor:
    """The legacy imatrix paths' sigma2: mean of x^2 over the whole row, one value per block."""
    rows = x.view(-1, row_blocks * x.shape[1])
    return (seq_sum(rows * rows) / rows.shape[1]).repeat_interleave(row_blocks).unsqueeze(1)


def _weights(x: torch.Tensor, qw: torch.Tensor, row_blocks: int) -> torch.Tensor:
    return qw * sqrtf(_sigma2(x, row_blocks) + x * x)


def q4_0(x, qw=None, row_blocks=1):
    """(q - 8) * d with d = max / -8 (the signed value of largest magnitude maps to -8)."""
    if qw is not None:
        d, q = make_qx_quants(x, 8, _weights(x, qw, row_blocks))
        return torch.cat([f16_bytes(d), _nibbles(q)], dim=1)
    d = first_absmax(x, 1).unsqueeze(1) / -8
    q = torch.trunc(x * inverse(d) + 8.5).to(torch.int32).clamp(max=15)
    return torch.cat([f16_bytes(d.squeeze(1)), _nibbles(q)], dim=1)


def q5_0(x, qw=None, row_blocks=1):
    """(q - 16) * d with d = max / -16."""
    if qw is not None:
        d, q = make_qx_quants(x, 16, _weights(x, qw, row_blocks))
        return torch.cat([f16_bytes(d), _qh(q), _nibbles(q)], dim=1)
    d = first_absmax(x, 1).unsqueeze(1) / -16
    q = torch.trunc(x * inverse(d) + 16.5).clamp_(max=31).to(torch.uint8)   # x / d lies in [-16, 16]
    return torch.cat([f16_bytes(d.squeeze(1)), _qh(q), _nibbles(q)], dim=1)


def _min_scale(x, qw, row_blocks, nmax):
    """Q4_1 / Q5_1: (d, m, codes), min-max (ref) or make_qkx3_quants (imatrix)."""
    if qw is not None:
        d, q, the_min = make_qkx_quants(x, _weights(x, qw, row_blocks), nmax, -0.9, 0.05, 36, False)
        return d, -the_min, q
    mn, mx = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    d = (mx - mn) / nmax
    q = torch.trunc((x - mn) * inverse(d) + 0.5).to(torch.int32)
    return d.squeeze(1), mn.squeeze(1), q


def q4_1(x, qw=None, row_blocks=1):
    """q * d + m with m = min, d = (max - min) / 15."""
    d, m, q = _min_scale(x, qw, row_blocks, 15)
    return torch.cat([f16_bytes(d), f16_bytes(m), _nibbles(q.clamp(max=15))], dim=1)


def q5_1(x, qw=None, row_blocks=1):
    """q * d + m with m = min, d = (max - min) / 31."""
    d, m, q = _min_scale(x, qw, row_blocks, 31)
    q = q & 0x1F                                  # C keeps the low 5 bits of (uint8_t)(x + 0.5f)
    return torch.cat([f16_bytes(d), f16_bytes(m), _qh(q), _nibbles(q)], dim=1)


def q8_0(x, qw=None, row_blocks=1):
    """q * d with d = absmax / 127, q = roundf(x / d) (half away from zero). No imatrix path."""
    d = x.abs().max(1, keepdim=True).values / 127
    v = x * inverse(d)
    a = v.abs()
    q = torch.sign(v) * (torch.floor(a) + torch.floor(2 * (a - torch.floor(a))))
    return torch.cat([f16_bytes(d.squeeze(1)), q.to(torch.int8).view(torch.uint8)], dim=1)


QUANTIZERS: dict[str, Callable] = {
    "q4_0": q4_0, "q4_1": q4_1, "q5_0": q5_0, "q5_1": q5_1, "q8_0": q8_0,
    "q2_K": kq.q2_k, "q3_K": kq.q3_k, "q4_K": kq.q4_k, "q5_K": kq.q5_k, "q6_K": kq.q6_k,
    "iq4_nl": iq4.iq4_nl, "iq4_xs": iq4.iq4_xs,
}
_LEGACY = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


# --- public -------------------------------------------------------------------------------------
def quantize(w: torch.Tensor, type_name: str, imatrix: torch.Tensor | None = None, what: str = "weight") -> Gguf:
    """Quantize a float weight W [N, K] to GGML type `type_name` (q4_0 .. q8_0, q2_K .. q6_K) as
    llama.cpp does, returning a `Gguf` QTensor; `imatrix` [K] (per-column importance, see `Imatrix`)
    selects llama.cpp's importance-weighted path. ShapeError when K is not a multiple of the block."""
    return _quantize(w, type_name, imatrix, what, measure=False)[0]


def quantize_with_error(w: torch.Tensor, type_name: str, imatrix: torch.Tensor | None = None,
                        what: str = "weight") -> tuple[Gguf, float]:
    """`quantize`, and the relative error ||dequantize(Q) - W|| / ||W|| of the result, measured on each chunk's
    blocks as they are made (while the chunk is in cache), not by a second pass over the whole weight."""
    return _quantize(w, type_name, imatrix, what, measure=True)


def _quantize(w: torch.Tensor, type_name: str, imatrix: torch.Tensor | None, what: str,
              measure: bool) -> tuple[Gguf, float | None]:
    t = GGML_TYPES_BY_NAME.get(type_name)
    if t is None or type_name not in QUANTIZERS:
        raise UnsupportedError(f"{what}: cannot quantize to GGML type {type_name!r} "
                               f"(supported: {', '.join(QUANTIZERS)})")
    if w.dim() != 2:
        raise ShapeError(f"{what}: expected a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if k % t.block_size:
        raise ShapeError(f"{what} {[n, k]}: rows of {k} are not a whole number of {t.name} blocks of "
                         f"{t.block_size}; use a type with 32-element blocks (q5_0, q8_0) for this tensor")
    if imatrix is not None and tuple(imatrix.shape) != (k,):
        raise ShapeError(f"{what} {[n, k]}: imatrix must have shape [{k}], got {list(imatrix.shape)}")
    w = w.detach()                                # stays on its device: CUDA float ops round as the C does
    qw = None if imatrix is None else imatrix.detach().to(w.device, torch.float32).expand(n, k)
    fn, row_blocks = QUANTIZERS[type_name], k // t.block_size
    compiled = native.quantizer(type_name, weighted=qw is not None) if w.device.type == "cpu" else None
    rows = max(1, _CHUNK // k)
    out = torch.empty(n, t.row_bytes(k), dtype=torch.uint8, device=w.device)
    sums = torch.zeros(2, dtype=torch.float64, device=w.device)     # squared error, squared W
    for start in range(0, n, rows):
        x = w[start:start + rows].float().reshape(-1, t.block_size)     # float32 a chunk at a time
        # NaN / infinity show in the norm (one read of x, wanted for the error anyway); the element-wise check
        # runs only then, since a huge finite x overflows the norm too
        norm = torch.linalg.vector_norm(x)
        if not bool(torch.isfinite(norm)) and not bool(torch.isfinite(x).all()):
            raise CorruptFileError(f"{what} {[n, k]}: holds NaN or infinite values (a damaged checkpoint?); GGML "
                                   f"blocks cannot represent them")
        q = None if qw is None else qw[start:start + rows].reshape(-1, t.block_size)
        if compiled is not None:
            blocks = compiled(x) if q is None else compiled(x, q, row_blocks)
        else:
            blocks = fn(x, q, row_blocks) if type_name in _LEGACY else fn(x, q)
        out[start:start + rows] = blocks.view(-1, out.shape[1])
        if measure:
            sums += torch.stack([torch.dist(t.decode(blocks), x), norm]).double() ** 2
    error = float(sums[0].sqrt() / sums[1].sqrt().clamp(min=1e-12)) if measure else None
    return Gguf(data=out, ggml_type=t.id, shape=(n, k)), error


class Imatrix:
    """Per-input-column importance of one linear layer, as llama-imatrix collects it: the sum of
    x_k^2 over every calibration token row x, and the row count; `weights()` is their ratio."""

    def __init__(self, in_features: int):
        self.sums = torch.zeros(in_features, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate activations x [..., in_features] (the layer's input)."""
        x = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float64)
        if x.shape[1] != self.sums.numel():
            raise ShapeError(f"imatrix: activations have {x.shape[1]} columns, expected {self.sums.numel()}")
        self.sums += (x * x).sum(0)
        self.count += x.shape[0]

    def weights(self) -> torch.Tensor:
        """float32 [in_features]: the mean squared activation per column (llama-quantize's quant_weights)."""
        if self.count == 0:
            raise ShapeError("imatrix: no activations were added")
        return (self.sums / self.count).float()


# Affine forms that are exactly a legacy GGML type: (bits, integer zero or None for float mins) -> type.
_AFFINE_TYPES = {(4, 8): "q4_0", (4, None): "q4_1", (5, 16): "q5_0", (5, None): "q5_1", (8, 128): "q8_0"}


def _exact_f16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.half().float(), t.float()))


def affine_to_gguf(a: Affine) -> Gguf | None:
    """The legacy GGML blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) exactly equal to Affine `a`, or None
    when `a` has no such form (group other than 32, act-order, per-group zeros, scales or mins that are
    not float16 values, a post_scale)."""
    zero = a.zeros if isinstance(a.zeros, int) or a.zeros is None else False
    name = _AFFINE_TYPES.get((a.bits, zero)) if zero is not False else None
    if (name is None or a.group_size != 32 or a.g_idx is not None or a.post_scale is not None
            or a.shape[1] % 32 or not _exact_f16(a.scales) or (a.mins is not None and not _exact_f16(a.mins))):
        return None
    n, k = a.shape
    q = a.codes.to(torch.int32).reshape(-1, 32)
    d = f16_bytes(a.scales.float().reshape(-1))
    if name == "q8_0":
        blocks = torch.cat([d, (q - 128).to(torch.int8).view(torch.uint8)], dim=1)
    else:
        parts = [d] + ([f16_bytes(a.mins.float().reshape(-1))] if a.mins is not None else [])
        parts += [_qh(q)] if a.bits == 5 else []
        blocks = torch.cat([*parts, _nibbles(q)], dim=1)
    t = GGML_TYPES_BY_NAME[name]
    return Gguf(data=blocks.reshape(n, t.row_bytes(k)), ggml_type=t.id, shape=(n, k))
