"""The GGML tensor types: one literal table, in the manner of ggml's `type_traits`.

Each row is a type's whole description: name and id, block geometry (a row of K elements is
K / block_size blocks of type_size bytes), the torch decoder of its blocks, and where they exist its
exact affine form (the legacy 32-element types) or its plain torch dtype (f32, f16, bf16). Ids are
the values stored in a GGUF tensor info (`ggml_type` in ggml.h, `GGMLQuantizationType` in gguf-py).
Ids that llama.cpp has retired keep a tombstone row whose `retired` message says what to use instead.
Block byte layouts and the decoders live in blocks.py and iquants.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from quanta.quant.ggml import blocks as b
from quanta.quant.ggml import iquants as iq
from quanta.quant.errors import UnsupportedError
from quanta.quant.ggml.blocks import Decoder

QK_K = 256   # elements in a K-quant / i-quant super-block


class AffineForm(NamedTuple):
    """A legacy type's exact affine reading: `bits`-bit codes, group 32, scale d (f16) at byte 0, and
    either one integer `zero` for every group (value (q - zero) * d) or, for zero None, a float min m
    (f16) at byte 2 (value q * d + m)."""
    bits: int
    zero: int | None


@dataclass(frozen=True, slots=True)
class GgmlType:
    """One GGML type: `block_size` elements stored in `type_size` bytes, and how to read them."""

    name: str
    id: int
    block_size: int
    type_size: int
    decode: Decoder | None = None            # uint8 blocks [nb, type_size] -> float32 [nb, block_size]
    affine: AffineForm | None = None         # the exactly equal affine form, for the legacy types
    float_dtype: torch.dtype | None = None   # plain float types: the torch dtype of the stored values
    retired: str | None = None               # why this id is no longer readable, and what replaces it

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` elements; k must be a multiple of block_size."""
        assert k % self.block_size == 0, (self.name, k)
        return k // self.block_size * self.type_size


def _retired(name: str, id: int, instead: str) -> GgmlType:
    return GgmlType(name, id=id, block_size=0, type_size=0, retired=instead)


_REPACK = "was an interleaved CPU repacking of {0}, removed from GGUF files; requantize to {0} " \
          "(llama.cpp repacks {0} at load time)"

GGML_TYPES: dict[int, GgmlType] = {t.id: t for t in (
    GgmlType("f32", id=0, block_size=1, type_size=4, decode=b.f32_blocks, float_dtype=torch.float32),
    GgmlType("f16", id=1, block_size=1, type_size=2, decode=b.f16_blocks, float_dtype=torch.float16),
    GgmlType("q4_0", id=2, block_size=32, type_size=2 + 16, decode=b.q4_0, affine=AffineForm(4, 8)),
    GgmlType("q4_1", id=3, block_size=32, type_size=2 + 2 + 16, decode=b.q4_1, affine=AffineForm(4, None)),
    _retired("q4_2", 4, "was removed from ggml with file format v2; requantize to q4_0 or q4_K"),
    _retired("q4_3", 5, "was removed from ggml with file format v2; requantize to q4_1 or q4_K"),
    GgmlType("q5_0", id=6, block_size=32, type_size=2 + 4 + 16, decode=b.q5_0, affine=AffineForm(5, 16)),
    GgmlType("q5_1", id=7, block_size=32, type_size=2 + 2 + 4 + 16, decode=b.q5_1, affine=AffineForm(5, None)),
    GgmlType("q8_0", id=8, block_size=32, type_size=2 + 32, decode=b.q8_0, affine=AffineForm(8, 128)),
    # q8_1 is ggml's activation type (d, s f16; 36 bytes per ggml-common.h static_assert); gguf-py 0.19's
    # GGML_QUANT_SIZES still says 40 from when d and s were f32.
    GgmlType("q8_1", id=9, block_size=32, type_size=2 + 2 + 32, decode=b.q8_1),
    GgmlType("q2_K", id=10, block_size=QK_K, type_size=QK_K // 16 + QK_K // 4 + 2 + 2, decode=b.q2_k),
    GgmlType("q3_K", id=11, block_size=QK_K, type_size=QK_K // 8 + QK_K // 4 + 12 + 2, decode=b.q3_k),
    GgmlType("q4_K", id=12, block_size=QK_K, type_size=2 + 2 + 12 + QK_K // 2, decode=b.q4_k),
    GgmlType("q5_K", id=13, block_size=QK_K, type_size=2 + 2 + 12 + QK_K // 8 + QK_K // 2, decode=b.q5_k),
    GgmlType("q6_K", id=14, block_size=QK_K, type_size=QK_K // 2 + QK_K // 4 + QK_K // 16 + 2, decode=b.q6_k),
    GgmlType("q8_K", id=15, block_size=QK_K, type_size=4 + QK_K + QK_K // 16 * 2, decode=b.q8_k),
    GgmlType("iq2_xxs", id=16, block_size=QK_K, type_size=2 + QK_K // 4, decode=iq.iq2_xxs),
    GgmlType("iq2_xs", id=17, block_size=QK_K, type_size=2 + QK_K // 4 + QK_K // 32, decode=iq.iq2_xs),
    GgmlType("iq3_xxs", id=18, block_size=QK_K, type_size=2 + QK_K // 4 + QK_K // 8, decode=iq.iq3_xxs),
    GgmlType("iq1_s", id=19, block_size=QK_K, type_size=2 + QK_K // 8 + QK_K // 16, decode=iq.iq1_s),
    GgmlType("iq4_nl", id=20, block_size=32, type_size=2 + 16, decode=iq.iq4_nl),
    GgmlType("iq3_s", id=21, block_size=QK_K, type_size=2 + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64,
             decode=iq.iq3_s),
    GgmlType("iq2_s", id=22, block_size=QK_K, type_size=2 + QK_K // 4 + QK_K // 32 + QK_K // 32, decode=iq.iq2_s),
    GgmlType("iq4_xs", id=23, block_size=QK_K, type_size=2 + 2 + QK_K // 64 + QK_K // 2, decode=iq.iq4_xs),
    GgmlType("i8", id=24, block_size=1, type_size=1),
    GgmlType("i16", id=25, block_size=1, type_size=2),
    GgmlType("i32", id=26, block_size=1, type_size=4),
    GgmlType("i64", id=27, block_size=1, type_size=8),
    GgmlType("f64", id=28, block_size=1, type_size=8),
    GgmlType("iq1_m", id=29, block_size=QK_K, type_size=QK_K // 8 + QK_K // 16 + QK_K // 32, decode=iq.iq1_m),
    GgmlType("bf16", id=30, block_size=1, type_size=2, decode=b.bf16_blocks, float_dtype=torch.bfloat16),
    _retired("q4_0_4_4", 31, _REPACK.format("q4_0")),
    _retired("q4_0_4_8", 32, _REPACK.format("q4_0")),
    _retired("q4_0_8_8", 33, _REPACK.format("q4_0")),
    GgmlType("tq1_0", id=34, block_size=QK_K, type_size=(QK_K - 4 * QK_K // 64) // 5 + QK_K // 64 + 2,
             decode=b.tq1_0),
    GgmlType("tq2_0", id=35, block_size=QK_K, type_size=QK_K // 4 + 2, decode=b.tq2_0),
    _retired("iq4_nl_4_4", 36, _REPACK.format("iq4_nl")),
    _retired("iq4_nl_4_8", 37, _REPACK.format("iq4_nl")),
    _retired("iq4_nl_8_8", 38, _REPACK.format("iq4_nl")),
    GgmlType("mxfp4", id=39, block_size=32, type_size=1 + 16, decode=b.mxfp4),
    GgmlType("nvfp4", id=40, block_size=64, type_size=4 + 32, decode=b.nvfp4),
    GgmlType("q1_0", id=41, block_size=128, type_size=2 + 16, decode=b.q1_0),
)}

GGML_TYPES_BY_NAME: dict[str, GgmlType] = {t.name: t for t in GGML_TYPES.values()}


def ggml_type(type_id: int, what: str = "tensor") -> GgmlType:
    """The live GgmlType of `type_id`; UnsupportedError naming `what` for unknown or retired ids."""
    t = GGML_TYPES.get(int(type_id))
    if t is None:
        raise UnsupportedError(f"{what}: unknown GGML type id {type_id} (known: 0..{max(GGML_TYPES)})")
    if t.retired:
        raise UnsupportedError(f"{what}: GGML type {t.name} (id {t.id}) {t.retired}")
    return t
