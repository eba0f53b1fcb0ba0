"""The GGUF container: header, metadata and tensor infos read from a memory map, checked before use.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from quanta.quant.errors import ConfigError, CorruptFileError, UnsupportedError
from quanta.quant.ggml.types import GgmlType, ggml_type

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4                 # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32       # GGUF_DEFAULT_ALIGNMENT, overridden by the `general.alignment` key
MAX_ARRAY_DEPTH = 8          # arrays of arrays: gguf-py writes them, ggml reads none; deeper is damage

# Metadata value types (gguf_type in gguf.h) with fixed-size values, as struct formats.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, numpy-order shape, GGML type and byte range in the file."""

    name: str
    dims: tuple[int, ...]        # outermost first: [N, K] for a matrix (ggml's ne reversed)
    type: GgmlType
    start: int                   # absolute offset of the first data byte
    nbytes: int

    @property
    def end(self) -> int:
        """Offset one past the last data byte."""
        return self.start + self.nbytes


@dataclass(eq=False)
class GgufFile:
    """A parsed GGUF file: metadata (key -> Python value), tensor infos in file order, the memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    size: int
    _map: mmap.mmap

    def read(self, t: TensorInfo) -> np.ndarray:
        """The bytes of tensor `t` as a writable uint8 array over the map, not a copy: the map is private
        (copy-on-write), so a write lands in this process's own page and never in the file, and pages never
        written stay the file's (droppable, shared with the page cache) instead of a second copy in memory."""
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.start)


def read_gguf(path: str | Path, vocabularies: bool = True) -> GgufFile:
    """Parse and check the header of GGUF file `path`.

    Layout (ggml's docs/gguf.md; little-endian; versions 2 and 3 share it):

        magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
        kv_count    x  key string | value_type u32 | value
        tensor_count x name string | n_dims u32 | ne[n_dims] u64 (innermost first) | ggml_type u32 | offset u64
        padding to `general.alignment` (default 32) | tensor data (each offset relative to its start)

    A string is a u64 byte count and that many UTF-8 bytes; an array is an item type u32, a u64 count
    and the items. `read_gguf` walks the header with every read checked against the file size, so a
    truncated or damaged file is reported by where it breaks (the header, metadata entry i and its key,
    tensor info i and its name, or the tensor whose bytes run past the end) before anything is built.
    Only the header is read; a tensor's bytes are copied out of the map when it is asked for. With
    `vocabularies=False` arrays of strings are walked over, not decoded, and left out of `metadata`.

    CorruptFileError names the file and what is wrong (empty, not GGUF, cut or damaged at a stated byte,
    a tensor's data past the end); UnsupportedError for versions and byte orders quanta does not read.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CorruptFileError(f"{path}: the file is empty (0 bytes), not a GGUF file")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the file ({e.strerror or e})") from e
    magic = buf[:4]
    if magic != GGUF_MAGIC:
        raise CorruptFileError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    cur = _Cursor(buf, size, path)
    cur.decode = vocabularies
    cur.pos, cur.where = 4, "the GGUF header (version and counts)"
    version = cur.scalar(4)
    if version & 0xFFFF == 0 and version >> 16:
        raise UnsupportedError(f"{path}: big-endian GGUF files are not supported")
    if version not in VERSIONS:
        raise UnsupportedError(f"{path}: GGUF version {version} is not supported (quanta reads versions "
                               f"{' and '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    metadata = _read_metadata(cur, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptFileError(f"{path}: general.alignment {alignment!r} is not a power of two")
    infos = _read_tensor_infos(cur, n_tensors, alignment)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [TensorInfo(name, dims, t, data_start + offset, nbytes) for name, dims, t, offset, nbytes in infos]
    for t in tensors:
        if t.end > size:
            raise CorruptFileError(f"{path}: truncated: the file ends at byte {size} but tensor {t.name!r} "
                                   f"({t.type.name} {list(t.dims)}) needs bytes up to {t.end}")
    return GgufFile(path=path, version=version, metadata=metadata, tensors=tensors, size=size, _map=buf)


class _Cursor:
    """A read position in the map; every read is checked against the file size and says `where` it is."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path):
        self.buf, self.size, self.path = buf, size, path
        self.pos, self.where, self.decode = 0, "", True

    def take(self, n: int) -> int:
        """Advance over `n` bytes and return where they start; CorruptFileError if the file ends first."""
        start = self.pos
        if n > self.size - start:
            raise CorruptFileError(f"{self.path}: truncated or damaged: the file ends at byte {self.size} but "
                                   f"{self.where} needs bytes up to {start + n} (read from byte {start})")
        self.pos = start + n
        return start

    def scalar(self, value_type: int) -> Any:
        """One fixed-size value of GGUF value type `value_type`."""
        fmt = "<" + SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        """A u64-length-prefixed UTF-8 string."""
        n = self.scalar(10)
        start = self.take(n)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptFileError(f"{self.path}: {self.where}: the string at byte {start} is not valid UTF-8 "
                                   f"(byte {start + e.start})") from None

    def value(self, value_type: int, depth: int = 0) -> Any:
        """A metadata value of `value_type`: a scalar, a string or a (nested) list."""
        if value_type in SCALAR_FORMATS:
            return self.scalar(value_type)
        if value_type == STRING:
            return self.string()
        if value_type != ARRAY:
            raise CorruptFileError(f"{self.path}: {self.where}: unknown metadata value type {value_type}")
        if depth == MAX_ARRAY_DEPTH:
            raise CorruptFileError(f"{self.path}: {self.where}: arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_type, count = self.scalar(4), self.scalar(10)
        if item_type in SCALAR_FORMATS:
            dtype = np.dtype("<" + SCALAR_FORMATS[item_type])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        if item_type == STRING:
            return self.strings(count)
        return [self.value(item_type, depth + 1) for _ in range(count)]

    def strings(self, count: int) -> list[str] | None:
        """`count` strings in a row (a vocabulary) in one tight loop, or None when not decoding; a cut or
        bad string is read again by `string()` for its error."""
        buf, size, pos, decode = self.buf, self.size, self.pos, self.decode
        out, length, done = [], _U64.unpack_from, 0
        try:
            for done in range(count):
                n = length(buf, pos)[0] if size - pos >= 8 else size
                if n > size - pos - 8:
                    break
                if decode:
                    out.append(buf[pos + 8:pos + 8 + n].decode("utf-8"))
                pos += 8 + n
            else:
                done = count
        except UnicodeDecodeError:
            pass
        self.pos = pos
        for _ in range(count - done):
            self.string()                            # raises
        return out if decode else None


def _read_metadata(cur: _Cursor, count: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for i in range(count):
        at = cur.pos
        cur.where = f"metadata entry {i} of {count} (from byte {at})"
        key = cur.string()
        cur.where = f"metadata entry {i} of {count} (key {key!r}, from byte {at})"
        if key in metadata:
            raise CorruptFileError(f"{cur.path}: {cur.where}: the key appears twice")
        value = cur.value(cur.scalar(4))
        if value is not None:                        # None: a vocabulary walked over, not decoded
            metadata[key] = value
    return metadata


def _read_tensor_infos(cur: _Cursor, count: int, alignment: int) -> list[tuple[str, tuple[int, ...], GgmlType,
                                                                             int, int]]:
    infos, seen = [], set()
    for i in range(count):
        at = cur.pos
        cur.where = f"tensor info {i} of {count} (from byte {at})"
        name = cur.string()
        cur.where = f"tensor info {i} of {count} ({name!r}, from byte {at})"
        what = f"{cur.path}: tensor {name!r}"
        if name in seen:
            raise CorruptFileError(f"{what}: the name appears twice in the tensor infos")
        seen.add(name)
        n_dims = cur.scalar(4)
        if n_dims > MAX_DIMS:
            raise CorruptFileError(f"{what}: {n_dims} dimensions (GGUF allows at most {MAX_DIMS}), "
                                   f"tensor info from byte {at}")
        ne = [cur.scalar(10) for _ in range(n_dims)]
        t = ggml_type(cur.scalar(4), what)
        offset = cur.scalar(10)
        row = ne[0] if ne else 1
        if row % t.block_size:
            raise CorruptFileError(f"{what}: rows of {row} elements are not a whole number of {t.name} "
                                   f"blocks of {t.block_size}")
        if offset % alignment:
            raise CorruptFileError(f"{what}: data offset {offset} is not a multiple of the alignment {alignment}")
        nbytes = math.prod(ne) // t.block_size * t.type_size
        infos.append((name, tuple(reversed(ne)), t, offset, nbytes))
    return infos
