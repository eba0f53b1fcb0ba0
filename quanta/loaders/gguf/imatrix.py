"""llama.cpp's importance-matrix files (what `llama-imatrix` writes, `llama-quantize --imatrix` reads): read into
the per-column weights llama-quantize hands each tensor's quantizer, and written from quanta's own collection.

    weights = read_imatrix("imatrix.gguf")        # {"blk.0.attn_q.weight": float32 [in_features], ...}
    load_imatrix(path).quantize_metadata(str(path))   # the quantize.imatrix.* entries llama-quantize writes
    write_imatrix("imatrix.gguf", {"blk.0.attn_q.weight": (sums, rows), ...}, datasets=["calibration.txt"],
                  chunk_count=32, chunk_size=512)  # llama-imatrix's GGUF layout, which llama-quantize reads

Two layouts, told apart by the magic: the GGUF one (a tensor pair per weight, `<name>.in_sum2` the sums of x^2
and `<name>.counts` the rows summed, one count per expert; weights in_sum2 / count in float32, or 1 where the
count is 0) and the legacy binary one (int32 entry count, then per entry an int32-sized name, int32 ncall,
int32 nval and nval float32 values already scaled by ncall; weights value / ncall).
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from quanta.quant.errors import ConfigError, CorruptFileError

_I32 = struct.Struct("<i")


class ImatrixFile(NamedTuple):
    """An imatrix file's weights (read_imatrix's), its datasets and the chunks it was collected over (0: not
    recorded)."""
    weights: dict[str, torch.Tensor]
    datasets: list[str]
    chunk_count: int

    def quantize_metadata(self, file: str) -> dict[str, str | int]:
        """The entries llama-quantize adds to a model quantized with this file, named `file` as on its command
        line: quantize.imatrix.file, .dataset (the first), .entries_count and .chunks_count (when recorded);
        strings cut at 127 bytes and counts as uint32, as its key-value overrides store them."""
        meta: dict[str, str | int] = {"quantize.imatrix.file": _c_string(file)}
        if self.datasets:
            meta["quantize.imatrix.dataset"] = _c_string(self.datasets[0])
        meta["quantize.imatrix.entries_count"] = len(self.weights)
        if self.chunk_count > 0:
            meta["quantize.imatrix.chunks_count"] = self.chunk_count
        return meta


def _c_string(s: str) -> str:
    """`s` as a 128-byte C buffer holds it (strncpy of 127 bytes)."""
    return s.encode("utf-8")[:127].decode("utf-8", "ignore")


def read_imatrix(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensor name -> float32 weights [values], as llama-quantize normalizes them; CorruptFileError naming the
    entry for a damaged file or non-finite values, ConfigError for a file that cannot be read."""
    return load_imatrix(path).weights


def load_imatrix(path: str | Path) -> ImatrixFile:
    """The file's weights (read_imatrix), datasets and chunk count, errors as read_imatrix's."""
    path = Path(path)
    try:
        head = path.open("rb").read(4)
    except OSError as e:
        raise ConfigError(f"imatrix {path}: cannot read the file ({e.strerror or e})") from e
    found = _read_gguf(path) if head == b"GGUF" else _read_legacy(path)
    if not found.weights:
        raise CorruptFileError(f"imatrix {path}: no entries")
    for name, w in found.weights.items():
        if not torch.isfinite(w).all():
            raise CorruptFileError(f"imatrix {path}: entry {name!r} holds values that are not finite")
    return found


def _read_gguf(path: Path) -> ImatrixFile:
    from quanta.loaders.gguf.file import read_gguf

    f = read_gguf(path)
    pairs: dict[str, dict[str, object]] = {}
    for t in f.tensors:
        for suffix in (".in_sum2", ".counts"):
            if t.name.endswith(suffix):
                if t.type.name.lower() != "f32":
                    raise CorruptFileError(f"imatrix {path}: {t.name} is {t.type.name}, expected F32")
                pairs.setdefault(t.name.removesuffix(suffix), {})[suffix] = t
    weights = {}
    for name, pair in sorted(pairs.items()):
        if len(pair) != 2:
            raise CorruptFileError(f"imatrix {path}: {name} has {' '.join(pair)} but not both .in_sum2 and .counts")
        sums = f.read(pair[".in_sum2"]).view(np.float32)
        raw = f.read(pair[".counts"]).view(np.float32).astype(np.float64)
        counts = (np.sign(raw) * np.floor(np.abs(raw) + 0.5)).astype(np.float32)     # C's lround
        if counts.size == 0 or sums.size % counts.size:
            raise CorruptFileError(f"imatrix {path}: {name} has {sums.size} sums for {counts.size} counts")
        per = sums.reshape(counts.size, -1)
        out = np.where(counts[:, None] > 0, per / np.where(counts > 0, counts, 1)[:, None], np.float32(1))
        weights[name] = torch.from_numpy(out.astype(np.float32).reshape(-1))
    datasets = f.metadata.get("imatrix.datasets", [])
    chunks = f.metadata.get("imatrix.chunk_count", 0)
    return ImatrixFile(weights, [str(d) for d in datasets] if isinstance(datasets, list) else [str(datasets)],
                       int(chunks) if isinstance(chunks, int) else 0)


def _read_legacy(path: Path) -> ImatrixFile:
    data = path.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise CorruptFileError(f"imatrix {path}: cut short in {what} (byte {pos} of {len(data)}); neither a "
                                   f"GGUF imatrix nor a legacy one")
        pos += n
        return data[pos - n:pos]

    n_entries = _I32.unpack(take(4, "the entry count"))[0]
    if n_entries < 1:
        raise CorruptFileError(f"imatrix {path}: {n_entries} entries; neither a GGUF imatrix nor a legacy one")
    weights = {}
    for i in range(n_entries):
        where = f"entry {i}"
        name = take(_I32.unpack(take(4, where))[0], where).decode("utf-8", "replace")
        ncall, nval = struct.unpack("<ii", take(8, f"{where} ({name!r})"))
        values = np.frombuffer(take(4 * nval, f"{where} ({name!r})"), dtype=np.float32)
        if ncall > 0:
            values = values / np.float32(ncall)
        weights[name] = torch.from_numpy(values.astype(np.float32))
    chunks, datasets = 0, []
    if len(data) - pos >= 8:            # newer llama-imatrix appends the last call and the dataset's name
        chunks, size = struct.unpack("<ii", take(8, "the trailer"))
        if 0 <= size <= len(data) - pos:
            datasets = [take(size, "the dataset name").decode("utf-8", "replace")]
    return ImatrixFile(weights, datasets, max(chunks, 0))


def write_imatrix(path: str | Path, entries: dict[str, tuple[torch.Tensor, int]], datasets: list[str],
                  chunk_count: int, chunk_size: int) -> Path:
    """Write llama-imatrix's GGUF layout: per tensor `<name>.in_sum2` (the sums of x^2 per input column, F32) and
    `<name>.counts` (the rows summed, F32 [1]), with the datasets and the chunk count and size; built beside `path`
    and renamed into place."""
    from quanta.loaders.checkpoint_write import atomic_file
    from quanta.loaders.gguf.encode import encode_header, pad
    from quanta.quant.ggml.types import GGML_TYPES_BY_NAME

    f32 = GGML_TYPES_BY_NAME["f32"].id
    blobs, infos, offset = [], [], 0
    for name, (sums, count) in entries.items():
        for suffix, data in ((".in_sum2", sums.detach().cpu().float().numpy()), (".counts", np.float32([count]))):
            raw = np.ascontiguousarray(data, dtype="<f4").tobytes()
            infos.append((name + suffix, (len(raw) // 4,), f32, offset))
            blobs += [raw, bytes(pad(len(raw)) - len(raw))]
            offset += pad(len(raw))
    metadata = {"general.type": "imatrix", "imatrix.datasets": list(datasets), "imatrix.chunk_count": chunk_count,
                "imatrix.chunk_size": chunk_size}
    path = Path(path)
    with atomic_file(path) as tmp, tmp.open("wb") as out:
        out.write(encode_header(metadata, infos))
        out.writelines(blobs)
    return path
