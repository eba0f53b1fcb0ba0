"""GGUF native kind: the ggml blocks of a weight exactly as stored, decoded by type.

    data[n] = row n of W: K / block_size blocks of type_size bytes (ggml.types.GGML_TYPES)
    W[n, k] = decode(block k // block_size of row n)[k % block_size]

Blocks run along K inside a row, so rows can be selected or permuted without decoding (`take_rows`).
The legacy types Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 also have an exactly equal `Affine` form, IQ4_NL and IQ4_XS a
`Codebook` one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.quant.chunks import chunk_rows
from quanta.quant.errors import ShapeError, UnsupportedError
from quanta.quant.ggml.blocks import legacy_codes, nibbles
from quanta.quant.ggml.iquants import IQ4_NL_VALUES, iq4_xs_scales
from quanta.quant.ggml.types import GgmlType, ggml_type
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.codebook import Codebook
from quanta.quant.qtensor import AffineScheme, QTensor

# Blocks decoded per pass: bounds the temporaries of the wider decoders (i-quants) to ~100s of MB.
_CHUNK_BLOCKS = 1 << 16
IQ4_TABLE_SCALE = 128.0     # a power of two: moving it from table to scale is exact
CODEBOOK_TYPES = ("iq4_nl", "iq4_xs")       # the types with an exact Codebook form (to_codebook)


@dataclass(eq=False, repr=False)
class Gguf(QTensor, kind="gguf"):
    data: torch.Tensor          # uint8 [N, K / block_size * type_size], the ggml blocks as stored
    ggml_type: int              # GGML type id (GGMLQuantizationType value)
    shape: tuple[int, int]      # (N, K)

    @property
    def type(self) -> GgmlType:
        """The GgmlType (name, block geometry) of this weight."""
        return ggml_type(self.ggml_type, "gguf weight")

    def _validate(self) -> None:
        n, k = self.shape
        t = ggml_type(self.ggml_type, f"gguf weight {list(self.shape)}")
        if k % t.block_size:
            raise ShapeError(f"gguf {t.name}: K={k} is not a multiple of the block size {t.block_size}")
        want = [n, t.row_bytes(k)]
        if self.data.dtype != torch.uint8 or list(self.data.shape) != want:
            raise ShapeError(f"gguf {t.name} {[n, k]}: data must be uint8 {want}, "
                             f"got {self.data.dtype} {list(self.data.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode every block (vectorized, in chunks of blocks) to W [N, K] of `dtype`."""
        t = self.type
        decode = t.decode
        if decode is None:
            raise UnsupportedError(f"gguf {t.name}: dequantization of this GGML type is not supported")
        blocks = self.data.reshape(-1, t.type_size)
        out = torch.empty(blocks.shape[0], t.block_size, dtype=dtype, device=self.data.device)
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            stop = start + _CHUNK_BLOCKS
            out[start:stop] = decode(blocks[start:stop]).to(dtype)
        return out.view(self.shape)

    def to_affine(self) -> Affine | None:
        """The exactly equal Affine form of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (scales, mins kept float16)."""
        t = self.type
        if t.affine is None:
            return None
        bits, zero = t.affine
        n, k = self.shape
        blocks = self.data.reshape(-1, t.type_size)
        codes = torch.empty(blocks.shape[0], 32, dtype=torch.uint8, device=self.data.device)
        step = chunk_rows(32, self.data.device)                 # blocks per pass: bounded int scratch
        for start in range(0, blocks.shape[0], step):
            b = blocks[start:start + step]
            if t.name == "q8_0":
                codes[start:start + step] = b[:, 2:].view(torch.int8).to(torch.int16) + 128
            else:
                codes[start:start + step] = legacy_codes(t.name, b)

        def half(at):
            return blocks[:, at:at + 2].contiguous().view(torch.float16).view(n, k // 32)
        return Affine(codes=codes.view(n, k), scales=half(0), bits=bits, group_size=32,
                      zeros=zero, mins=half(2) if zero is None else None, shape=(n, k))

    def to_codebook(self) -> Codebook | None:
        """The exactly equal Codebook form of IQ4_NL and IQ4_XS (None for other types): ggml's 16 kvalues as the
        table and each block of 32's scale (IQ4_NL's d; IQ4_XS's d * (ls - 32), exact in float32) as its absmax,
        both by IQ4_TABLE_SCALE (kvalues / 128 within [-1, 1], as NF4's table; for IQ4_NL d * 128 still an fp16 value,
        so table[q] * absmax rounds to the same fp16 as d * kvalue); None where a scale times 128 would leave fp16's
        range."""
        if self.type.name not in CODEBOOK_TYPES:
            return None
        n, k = self.shape
        if self.type.name == "iq4_nl":
            blocks = self.data.reshape(-1, self.type.type_size)
            scales = blocks[:, :2].contiguous().view(torch.float16).float().view(-1)
        else:
            d, ls = self.iq4_xs_scales()
            scales = (d.float().unsqueeze(-1) * (ls.float() - 32)).view(-1)
        if not bool((scales.abs() * IQ4_TABLE_SCALE < 65504).all()):
            return None
        table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=self.data.device) / IQ4_TABLE_SCALE
        return Codebook(codes=self.iq4_codes(), table=table, blocksize=32, absmax=scales * IQ4_TABLE_SCALE,
                        shape=(n, k), quant_type=self.type.name)

    def iq4_codes(self) -> torch.Tensor:
        """IQ4_NL / IQ4_XS's 4-bit table indices, uint8 [N, K] (each 16 bytes hold 32 values: low nibbles first)."""
        n, k = self.shape
        qs = self.data.reshape(n * k // self.type.block_size, self.type.type_size)
        qs = qs[:, 2:] if self.type.name == "iq4_nl" else qs[:, 8:]
        codes = torch.empty(n * k // 32, 32, dtype=torch.uint8, device=self.data.device)
        rows = qs.reshape(-1, 16)
        step = chunk_rows(32, self.data.device)                 # blocks of 32 per pass: bounded scratch
        for start in range(0, rows.shape[0], step):
            codes[start:start + step] = nibbles(rows[start:start + step])
        return codes.view(n, k)

    def iq4_xs_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """IQ4_XS's super-block scales: d, fp16 [N, K / 256], and the 6-bit ls of its 8 groups of 32, uint8
        [N, K / 256, 8] (a group's scale is d * (ls - 32))."""
        n, k = self.shape
        d, ls = iq4_xs_scales(self.data.reshape(n * k // 256, self.type.type_size))
        return d.half().view(n, k // 256), ls.to(torch.uint8).view(n, k // 256, 8)

    def affine_scheme(self) -> AffineScheme | None:
        if self.type.affine is None:
            return None
        bits, zero = self.type.affine
        return AffineScheme(bits, 32, self.shape[1] // 32, False, "float" if zero is None else "sym")

    def take_rows(self, index: torch.Tensor | list[int] | slice) -> Gguf:
        """The weight made of rows `index` of this one (blocks copied as they are, no decoding)."""
        data = self.data[index] if isinstance(index, slice) else self.data[torch.as_tensor(index).long()]
        return Gguf(data=data, ggml_type=self.ggml_type, shape=(data.shape[0], self.shape[1]))

    def _cat_rows(self, others: list[QTensor]) -> Gguf | None:
        parts = [self, *others]
        if any(p.ggml_type != self.ggml_type for p in parts):
            return None
        return self._stacked(parts, ("data",))

    @property
    def nbytes(self) -> int:
        """Bytes of the ggml blocks: what the weight costs on disk and on the GPU."""
        return self.data.numel()

    def describe(self) -> str:
        return f"gguf {self.type.name}"

