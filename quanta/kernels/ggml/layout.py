"""The ggml kernels' weight layout: each block field of a GGUF weight in its own plane, the same bytes.

A ggml row interleaves its fields block by block (Q6_K: 128 bytes of low bits, 64 of high bits, 16 scales, an fp16
d, then the next block), so a field sits at a 210-byte stride that no wide load can follow. `prepare()` moves each
field of every block into a plane of its own, row-major [N, blocks * field size] (code words load 16 bytes at a
time along K), or for the `columns` types column-major [blocks * field words, N] (a word row loads contiguous over
the output columns: gemv_cols.py). The held bytes are the file's, permuted; only Q4_K's and Q5_K's 12 bytes of
scales and mins are repacked, exactly, as 16 (k4_scale_pairs: a scale and its min a byte each).

Each type's row of LAYOUTS gives its planes (the byte range of the field in a block and the dtype the kernels read
it in, in the order the decoder takes them) and the axes its decoder (decode.py) spreads a tile of 256 values over.
No Triton here: the memory plan reads this table too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from quanta.quant.ggml.types import GgmlType
from quanta.quant.kinds.gguf import Gguf

TILE = 256                  # values of a row a tile holds: one K-quant super-block, or eight 32-value blocks
INT32_LIMIT = 2 ** 31       # plane offsets are int32 in the kernels
PREPARE_SLICE_BYTES = 64 << 20      # file bytes prepare() moves to the device at once


class Plane(NamedTuple):
    """One field of a block: bytes [offset, offset + size) of each block, read by the kernels as `dtype`; `held`
    bytes a block where the kernels hold the field repacked (REPACKS), else `size`."""
    offset: int
    size: int
    dtype: torch.dtype
    held: int = 0

    @property
    def held_bytes(self) -> int:
        return self.held or self.size


class GgmlLayout(NamedTuple):
    """How the kernels read one ggml type.

    `axes` (A, B, C, D): the decoder's tile [BLOCK_N, A, B, C, D] holds value a*B*C*D + b*C*D + c*D + d of the tile
    (row-major, so a reshape to [BLOCK_N, 256] is the row's order); D is always the byte within a code word, and
    a scale never changes along C or D. A is split by `parts` (a tile of 256 / parts values); the largest split keeps
    one value of A. The decoder gives each value as a float f and its sub-block's scale (and min): the value is
    (f - center) * scale (- min where `has_min`); see decode.py. `block`: values a ggml block holds (a tile spans
    256 / block blocks, one a value of A, for the 32-value types). `columns`: the planes are held column-major,
    element e of block b of every row in row b * (size / element size) + e of a [.., N] plane (see prepare)."""
    id: int
    axes: tuple[int, int, int, int]
    planes: tuple[Plane, ...]
    center: float = 1.0
    has_min: bool = False
    block: int = TILE
    columns: bool = False


U8, I32, F16 = torch.uint8, torch.int32, torch.float16

# The byte layouts are ggml-common.h's (and blocks.py's decoders'); the axes are decode.py's.
LAYOUTS: dict[str, GgmlLayout] = {
    "q2_K": GgmlLayout(10, (4, 4, 4, 4), (Plane(0, 16, I32), Plane(16, 64, I32), Plane(80, 4, I32)), has_min=True,
                       columns=True),
    "q3_K": GgmlLayout(11, (4, 4, 4, 4), (Plane(0, 32, I32), Plane(32, 64, I32), Plane(96, 12, I32),
                                          Plane(108, 2, F16)), center=1.5, columns=True),
    "q4_K": GgmlLayout(12, (4, 2, 8, 4), (Plane(0, 4, I32), Plane(4, 12, I32, held=16), Plane(16, 128, I32)),
                       has_min=True, columns=True),
    "q5_K": GgmlLayout(13, (4, 2, 8, 4), (Plane(0, 4, I32), Plane(4, 12, I32, held=16), Plane(16, 32, I32),
                                          Plane(48, 128, I32)), has_min=True, columns=True),
    "q6_K": GgmlLayout(14, (4, 4, 4, 4), (Plane(0, 128, I32), Plane(128, 64, I32), Plane(192, 16, I32),
                                          Plane(208, 2, F16)), center=1.5, columns=True),
    "iq4_nl": GgmlLayout(20, (8, 2, 4, 4), (Plane(0, 2, F16), Plane(2, 16, I32)), center=0.0, block=32),
    "iq4_xs": GgmlLayout(23, (8, 2, 4, 4), (Plane(0, 2, F16), Plane(2, 6, U8), Plane(8, 128, I32)), center=0.0),
    # the 32-value types also run on the affine kernels, which the registry tries first
    "q4_0": GgmlLayout(2, (8, 2, 4, 4), (Plane(0, 2, F16), Plane(2, 16, I32)), center=1.5, block=32),
    "q4_1": GgmlLayout(3, (8, 2, 4, 4), (Plane(0, 4, F16), Plane(4, 16, I32)), has_min=True, block=32),
    "q5_0": GgmlLayout(6, (8, 2, 4, 4), (Plane(0, 2, F16), Plane(2, 4, I32), Plane(6, 16, I32)), center=1.5, block=32),
    "q5_1": GgmlLayout(7, (8, 2, 4, 4), (Plane(0, 4, F16), Plane(4, 4, I32), Plane(8, 16, I32)), has_min=True,
                       block=32),
    "q8_0": GgmlLayout(8, (8, 1, 8, 4), (Plane(0, 2, F16), Plane(2, 32, I32)), center=1.5, block=32),
}
# IQ4_NL / IQ4_XS codes index ggml's kvalues_iq4nl
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(slots=True, eq=False)
class GgmlState:
    """A GGUF weight [N, K] in plane layout (see the module docstring); `lut` the IQ4 table (float32 [16]) or None."""
    planes: tuple[torch.Tensor, ...]
    layout: GgmlLayout
    name: str
    n: int
    k: int
    dtype: torch.dtype
    lut: torch.Tensor | None
    plans: dict = field(default_factory=dict, repr=False)      # plan.choose's cache

    @property
    def blocks(self) -> int:
        """ggml blocks a row."""
        return self.k // self.layout.block

    @property
    def tiles(self) -> int:
        """Tiles of 256 values a row (the last one partly masked for 32-value types when K is no multiple of 256)."""
        return -(-self.k // TILE)

    @property
    def nbytes(self) -> int:
        """Bytes held: the planes (the file's bytes of the weight; Q4_K's and Q5_K's scales repacked larger)."""
        return sum(p.numel() * p.element_size() for p in self.planes)


def why_not(weight, t: GgmlType) -> str | None:
    """None if these kernels decode the weight's type and its shape fits their offsets, else why not."""
    if t.name not in LAYOUTS:
        return f"gguf {t.name}: no block decoder in the ggml kernels (they take {', '.join(LAYOUTS)})"
    n, k = weight.shape
    if k % t.block_size:
        return f"gguf {t.name}: K={k} is not a multiple of the block size {t.block_size}"
    if n * t.row_bytes(k) >= INT32_LIMIT:
        return f"gguf {t.name} {[n, k]}: {n * t.row_bytes(k)} bytes overflow the kernels' int32 offsets"
    return None


def prepare(weight: Gguf, device: torch.device, dtype: torch.dtype) -> GgmlState:
    """The weight's blocks split into planes on `device` (a permutation of the same bytes; nothing decoded)."""
    t = weight.type
    layout = LAYOUTS[t.name]
    assert sum(p.size for p in layout.planes) == t.type_size, t.name
    n, k = weight.shape
    nb = k // t.block_size
    device = torch.device(device)
    if layout.columns:
        planes = tuple(torch.empty(nb * p.held_bytes // p.dtype.itemsize, n, dtype=p.dtype, device=device)
                       for p in layout.planes)
    else:
        planes = tuple(torch.empty(n, nb * p.held_bytes, dtype=torch.uint8, device=device) for p in layout.planes)
    # rows move a slice at a time, so that the device holds the planes and one slice of the file's bytes, not a
    # second copy of the weight while it is split
    step = max(1, PREPARE_SLICE_BYTES // max(1, nb * t.type_size))
    for r in range(0, n, step):
        blocks = weight.data[r:r + step].to(device).view(-1, nb, t.type_size)
        for plane, p in zip(planes, layout.planes):
            field = _field(blocks, p, t.name).reshape(blocks.shape[0], -1)
            if layout.columns:
                plane[:, r:r + step] = field.view(p.dtype).t()
            else:
                plane[r:r + step] = field
        del blocks
    if not layout.columns:
        planes = tuple(plane.view(p.dtype) for plane, p in zip(planes, layout.planes))
    lut = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device) if t.name.startswith("iq4") else None
    return GgmlState(planes, layout, t.name, n, k, dtype, lut)


def _field(blocks: torch.Tensor, p: Plane, name: str) -> torch.Tensor:
    """Bytes [offset, offset + size) of each block [n, blocks, type_size], repacked where the plane says so."""
    field = blocks[:, :, p.offset:p.offset + p.size]
    return k4_scale_pairs(field) if p.held else field.contiguous()


def k4_scale_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K scales [..., 12] (get_scale_min_k4's packing) as [..., 16]: byte 2s the 6-bit scale of
    sub-block s, byte 2s + 1 its min."""
    b = packed.to(torch.int32)
    lo, hi, mid = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo & 63, (mid & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([hi & 63, (mid >> 4) | ((hi >> 6) << 4)], dim=-1)
    return torch.stack([sc, mn], dim=-1).flatten(-2).to(torch.uint8)


def held_block_bytes(layout: GgmlLayout) -> int:
    """Bytes the kernels hold per ggml block of this layout (the file's, plus any repack's growth)."""
    return sum(p.held_bytes for p in layout.planes)


def split_output(x2: torch.Tensor, st: GgmlState, splits: int) -> torch.Tensor:
    """y [M, N] for a launch over x2 [M, K]: float32 zeros where `splits` > 1 programs add partial sums into it (each
    16-bit addition would round), else uninitialised in x2's dtype. The launchers return y.to(x2.dtype)."""
    if splits > 1:
        return torch.zeros(x2.shape[0], st.n, device=x2.device, dtype=torch.float32)
    return torch.empty(x2.shape[0], st.n, device=x2.device, dtype=x2.dtype)


def plane_args(st: GgmlState) -> tuple[torch.Tensor, ...]:
    """The four plane pointers a kernel takes (the first plane stands in for the ones a type does not have)."""
    return st.planes + (st.planes[0],) * (4 - len(st.planes))


def word_planes(st: GgmlState) -> list[torch.Tensor]:
    """plane_args as flat int32 words, as the tensor-core kernels read every plane (Q6_K's fp16 d plane too, whose
    n * blocks those kernels require even)."""
    return [plane.reshape(-1).view(torch.int32) for plane in plane_args(st)]


def type_constexprs(st: GgmlState) -> dict:
    """The constexprs that tell a kernel the weight's type: its decoder (TYPE), axes, center and mins."""
    a, b, c, d = st.layout.axes
    return dict(TYPE=st.layout.id, A=a, B=b, C=c, D=d, CENTER=st.layout.center, HAS_MIN=st.layout.has_min)
