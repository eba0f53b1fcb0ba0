"""GGUF header bytes, laid out as gguf-py's GGUFWriter lays them out (so files stay byte-identical to it).

    head = encode_header(metadata, infos)     # magic .. tensor infos, padded to the data alignment

Metadata values take gguf-py's types: bool -> BOOL, int -> UINT32, float -> FLOAT32, str -> STRING, list ->
ARRAY of its items' type (str STRING, float FLOAT32, bool BOOL, int INT32, list ARRAY); empty strings and
lists are left out, as GGUFWriter's add_string / add_array leave them. Arrays are encoded in bulk (numpy for
numbers, one join for strings), the 49k-entry vocabularies of current models included.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from quanta.loaders.gguf.file import ARRAY, GGUF_MAGIC, STRING
from quanta.quant.errors import UnsupportedError

VERSION = 3                   # GGUF_VERSION that gguf-py writes
ALIGNMENT = 32                # GGUF_DEFAULT_ALIGNMENT: GGUFWriter never reads general.alignment
UINT32, INT32, FLOAT32, BOOL = 4, 5, 6, 7
_U64 = struct.Struct("<Q")
_NUMPY = {INT32: "<i4", FLOAT32: "<f4", BOOL: "?"}


def pad(n: int) -> int:
    """`n` rounded up to the data alignment."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def encode_header(metadata: dict[str, Any], infos: list[tuple[str, tuple[int, ...], int, int]]) -> bytes:
    """The file up to its tensor data: header, metadata entries and tensor infos (name, numpy-order dims,
    GGML type id, offset in the data section), zero-padded to the alignment."""
    kv = [_string(key) + _value(key, value) for key, value in metadata.items()
          if not (isinstance(value, (str, list)) and len(value) == 0)]
    ti = [_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *reversed(dims), type_id, offset)
          for name, dims, type_id, offset in infos]
    head = b"".join([GGUF_MAGIC, struct.pack("<IQQ", VERSION, len(infos), len(kv)), *kv, *ti])
    return head + bytes(pad(len(head)) - len(head))


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return _U64.pack(len(b)) + b


def _value(key: str, value: Any) -> bytes:
    """A metadata entry's value type and value (GGUFWriter._add's types for the top-level value)."""
    if isinstance(value, bool):
        return struct.pack("<I?", BOOL, value)
    if isinstance(value, int):
        if not 0 <= value < 1 << 32:
            raise UnsupportedError(f"GGUF writer: metadata {key!r} = {value} does not fit a uint32")
        return struct.pack("<II", UINT32, value)
    if isinstance(value, float):
        return struct.pack("<I", FLOAT32) + _array(key, [value], FLOAT32)
    if isinstance(value, str):
        return struct.pack("<I", STRING) + _string(value)
    if isinstance(value, list):
        return struct.pack("<I", ARRAY) + _items(key, value)
    raise UnsupportedError(f"GGUF writer: metadata {key!r} has an unsupported value {type(value).__name__}")


def _item_type(key: str, cls: type) -> int:
    """gguf-py's GGUFValueType.get_type, for an item's class."""
    for bases, t in (((str, bytes, bytearray), STRING), ((list,), ARRAY), ((float,), FLOAT32), ((bool,), BOOL),
                     ((int,), INT32)):
        if issubclass(cls, bases):
            return t
    raise UnsupportedError(f"GGUF writer: metadata {key!r} holds an unsupported item {cls.__name__}")


def _items(key: str, items: list) -> bytes:
    """An array's item type, count and items; every item must have the first one's type."""
    if not items:
        raise UnsupportedError(f"GGUF writer: metadata {key!r} holds an empty nested array")
    kinds = {_item_type(key, cls) for cls in set(map(type, items))}
    if len(kinds) > 1:
        raise UnsupportedError(f"GGUF writer: metadata {key!r} mixes items of several types")
    kind = kinds.pop()
    if kind == STRING:
        raw = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in items]
        body = [b"\0"] * (2 * len(raw))
        body[0::2] = map(_U64.pack, map(len, raw))
        body[1::2] = raw
        data = b"".join(body)
    elif kind == ARRAY:
        data = b"".join(_items(key, item) for item in items)
    else:
        data = _array(key, items, kind)
    return struct.pack("<IQ", kind, len(items)) + data


def _array(key: str, items: list, kind: int) -> bytes:
    """Numbers as little-endian INT32 / FLOAT32 / BOOL, refusing what struct.pack would refuse."""
    wide = np.asarray(items, dtype=np.int64 if kind == INT32 else np.float64 if kind == FLOAT32 else bool)
    with np.errstate(over="ignore"):
        out = wide.astype(_NUMPY[kind])
    if (kind == INT32 and (out != wide).any()) or (kind == FLOAT32 and (np.isinf(out) != np.isinf(wide)).any()):
        raise UnsupportedError(f"GGUF writer: metadata {key!r} holds a value out of the range of its type")
    return out.tobytes()
