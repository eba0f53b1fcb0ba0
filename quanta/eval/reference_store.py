"""A reference model's next-token distributions kept on disk, so that a large reference runs once and
is never loaded beside the model under test (llama.cpp's --kl-divergence-base, with top-k in place of
its full compressed vocabulary).

Layout: MAGIC, a little-endian uint64 header length, the JSON header, then one fixed-size record per
window, in window order: token ids int32 [P, k], log-probabilities float32 [P, k], tail log-mass
float64 [P], true-token log-probability float64 [P] (P scored positions a window, scoring.TopK).
The header names the windows (their token-id fingerprints), so a comparison on other text, context,
scoring or tokenizer is refused instead of silently compared.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from quanta.eval.scoring import TopK
from quanta.eval.windows import TokenWindows
from quanta.quant.errors import ConfigError, CorruptFileError

MAGIC = b"QUANTA-REFERENCE-LOGPROBS\n"
VERSION = 1


def is_reference_file(path) -> bool:
    """Whether `path` is a stored-reference file (by its magic bytes)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (OSError, TypeError):
        return False


def _record_bytes(positions: int, k: int) -> int:
    return positions * k * (4 + 4) + positions * (8 + 8)


class ReferenceWriter:
    """Writes the file window by window to a temporary name in the destination folder; renamed into
    place only when every window is in (close()), removed on error (abort())."""

    def __init__(self, path: str | Path, windows: TokenWindows, *, model: str, top_k: int, vocab_size: int,
                 text: str):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ConfigError(f"cannot write reference log-probabilities to {self.path}: "
                              f"folder {self.path.parent} does not exist")
        spec = windows.spec
        self.header = {"version": VERSION, "model": model, "text": text, "ctx": spec.ctx, "stride": spec.stride,
                       "score": spec.score, "top_k": min(top_k, vocab_size), "vocab_size": vocab_size,
                       "positions": windows.scored_per_window, "windows": windows.fingerprints()}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "wb")
        blob = json.dumps(self.header).encode()
        self.file.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
        self.written = 0

    def add(self, record: TopK) -> None:
        """Append the next window's record."""
        p, k = self.header["positions"], self.header["top_k"]
        assert tuple(record.ids.shape) == (p, k), (tuple(record.ids.shape), p, k)
        for t, dtype in ((record.ids, np.int32), (record.logprobs, np.float32), (record.tail, np.float64),
                         (record.true_logprob, np.float64)):
            self.file.write(t.numpy().astype(dtype, copy=False).tobytes())
        self.written += 1

    def close(self) -> Path:
        """Finish: the file appears at its path only now, complete."""
        assert self.written == len(self.header["windows"]), (self.written, len(self.header["windows"]))
        self.file.close()
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class ReferenceLogprobs:
    """A stored reference, read one window at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise CorruptFileError(f"{self.path} is not a quanta reference log-probability file")
            try:
                (length,) = struct.unpack("<Q", f.read(8))
                self.header = json.loads(f.read(length))
            except (struct.error, ValueError) as e:
                raise CorruptFileError(f"{self.path}: unreadable header ({e})") from None
        self.offset = len(MAGIC) + 8 + length
        h = self.header
        if h.get("version") != VERSION:
            raise CorruptFileError(f"{self.path}: version {h.get('version')!r}, this quanta reads {VERSION}")
        self.positions, self.top_k = h["positions"], h["top_k"]
        self.record_bytes = _record_bytes(self.positions, self.top_k)
        expected = self.offset + len(h["windows"]) * self.record_bytes
        if self.path.stat().st_size != expected:
            raise CorruptFileError(f"{self.path}: {self.path.stat().st_size} bytes, the header implies "
                                   f"{expected} (truncated?)")

    @property
    def model(self) -> str:
        return self.header["model"]

    @property
    def vocab_size(self) -> int:
        return self.header["vocab_size"]

    def check(self, windows: TokenWindows) -> None:
        """ConfigError unless `windows` are (the first of) the windows this file was made on."""
        spec, h = windows.spec, self.header
        asked = {"ctx": spec.ctx, "stride": spec.stride, "score": spec.score}
        stored = {key: h[key] for key in asked}
        if asked != stored:
            raise ConfigError(f"{self.path} was made with {stored}, this evaluation asks {asked}")
        if len(windows.windows) > len(h["windows"]):
            raise ConfigError(f"{self.path} holds {len(h['windows'])} windows, {len(windows.windows)} asked for")
        for i, (ours, theirs) in enumerate(zip(windows.fingerprints(), h["windows"])):
            if ours != theirs:
                raise ConfigError(f"{self.path}: window {i} holds other tokens than this evaluation's: a "
                                  f"different text ({h['text']}) or tokenizer than the reference {h['model']}")

    def record(self, i: int) -> TopK:
        """Window i's record."""
        p, k = self.positions, self.top_k
        raw = np.fromfile(self.path, dtype=np.uint8, count=self.record_bytes, offset=self.offset + i * self.record_bytes)
        parts, at = [], 0
        for dtype, count in ((np.int32, p * k), (np.float32, p * k), (np.float64, p), (np.float64, p)):
            size = np.dtype(dtype).itemsize * count
            parts.append(torch.from_numpy(raw[at:at + size].view(dtype).copy()))
            at += size
        return TopK(parts[0].view(p, k), parts[1].view(p, k), parts[2], parts[3])
