"""QTensor: a quantized 2-D weight W[n, k] (n = output row, k = input column) in one canonical kind.

Every checkpoint format maps INTO one of a few kinds losslessly (see quant/kinds/), every kernel
consumes those kinds, and `dequantize()` in torch is the oracle for all of them.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import torch

from quanta.quant.errors import ShapeError


class AffineScheme(NamedTuple):
    """The geometry of an affine weight, enough for a kernel to decide whether it can run it."""
    bits: int
    group_size: int
    num_groups: int
    act_order: bool
    zero: str          # "sym" (one integer zero for all), "int" (integer per group), "float" (mins)


class QTensor:
    """Base of the canonical quantized kinds; subclasses register themselves by `kind=`.

    A subclass is a dataclass whose tensor fields hold the quantized data. It implements
    `dequantize()` and `_validate()`; the base gives it device moves, byte counts and the registry.
    """

    kind: ClassVar[str]
    kinds: ClassVar[dict[str, type[QTensor]]] = {}
    shape_of: ClassVar[str | None] = None      # the [N, K] tensor field that gives `shape` when it is None
    shape: tuple[int, int]

    def __init_subclass__(cls, kind: str | None = None, shape_of: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if kind is not None:
            assert kind not in QTensor.kinds, f"kind {kind!r} registered twice"
            cls.kind = kind
            QTensor.kinds[kind] = cls
        if shape_of is not None:
            cls.shape_of = shape_of

    def __post_init__(self):
        if self.shape is None and self.shape_of is not None:
            self.shape = tuple(getattr(self, self.shape_of).shape)
        self.shape = tuple(int(s) for s in self.shape)
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ShapeError(f"{self.kind}: shape must be (out_features, in_features), got {self.shape}")
        self._validate()

    # --- what each kind implements -----------------------------------------------------------
    def _validate(self) -> None:
        """Check that the tensors agree with each other and with `shape`; raise ShapeError if not."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision weight [N, K] (computed in float32, then cast to `dtype`)."""
        raise NotImplementedError

    def to_affine(self):
        """This weight as an exactly equal `Affine`, or None where the kind has no affine form."""
        return None

    def affine_scheme(self) -> AffineScheme | None:
        """What `to_affine()` would give (bits, groups, zero form) without building it; None if no form."""
        return None

    def _cat_rows(self, others: list[QTensor]) -> QTensor | None:
        """[self; *others] (same kind, same K) as one weight of N = sum of theirs, or None when their
        formats differ; see `cat_rows`. Kinds whose rows are independent implement it with `_stacked`."""
        return None

    def _stacked(self, parts: list[QTensor], row_fields: tuple[str, ...], **fields) -> QTensor:
        """This weight's format holding the parts' row-wise tensor fields concatenated (and `fields` set)."""
        cat = {f: cat_field(parts, f) for f in row_fields}
        return dataclasses.replace(self, **cat, **fields, shape=(sum(p.shape[0] for p in parts), self.shape[1]))

    # --- shared -------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields of this QTensor by name (None fields left out)."""
        return {f.name: v for f in dataclasses.fields(self)
                if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str) -> QTensor:
        """A copy with every tensor moved to `device` (dtypes kept)."""
        moved = {name: t.to(device) for name, t in self.tensors().items()}
        return dataclasses.replace(self, **moved)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors().values())).device

    @property
    def nbytes(self) -> int:
        """Bytes this weight takes as stored on disk in its source format (what a kernel must read)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / self.numel

    def describe(self) -> str:
        """A short human-readable scheme name, e.g. 'affine int4 g128 asym'."""
        return self.kind

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()}, shape={self.shape}, {self.bits_per_weight:.3f} bpw)"


def cat_rows(weights: list) -> torch.Tensor | QTensor | None:
    """Weights [N_i, K] over the same input (q/k/v, gate/up) stacked along N into one weight, exactly
    (its dequantization is the concatenation of theirs), or None when they cannot share one format."""
    first = weights[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(w, torch.Tensor) and w.dtype == first.dtype and w.shape[1:] == first.shape[1:]
               for w in weights):
            return torch.cat(weights)
        return None
    if not all(type(w) is type(first) and w.shape[1] == first.shape[1] for w in weights):
        return None
    return first._cat_rows(list(weights[1:]))


def same(parts: list, key) -> bool:
    """True when key(part) is equal for every part (tensors compared by value)."""
    ref = key(parts[0])
    for p in parts[1:]:
        v = key(p)
        if isinstance(ref, torch.Tensor) or isinstance(v, torch.Tensor):
            if not (isinstance(ref, torch.Tensor) and isinstance(v, torch.Tensor) and ref.shape == v.shape
                    and torch.equal(ref.cpu(), v.cpu())):
                return False
        elif v != ref:
            return False
    return True


def cat_field(parts: list, name: str) -> torch.Tensor | None:
    """torch.cat of one tensor field over the parts along dim 0 (None when the field is None)."""
    first = getattr(parts[0], name)
    return None if first is None else torch.cat([getattr(p, name) for p in parts])
