"""A weight kernel's paths by M: one ordered table over a DeviceCaps value, shared by the affine and ggml plans.

The first path whose `fits(state, caps, m)` returns None runs; each earlier path's answer says why it does not. A
choice is made once per M bucket (the plan's `bucket_edge`: every M of a bucket gets the plan of its edge) and caps,
and cached on the weight's state (`state.plans`).
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from quanta.kernels.device_caps import DeviceCaps
from quanta.quant.errors import UnsupportedError


class Path(NamedTuple):
    """One row of a plan: `fits` None where it runs M rows (else why not), `config` its launch config, `run`
    its launcher run(x2, state, bias, config, caps=caps), `why` the reason it runs, for reports; `glu` whether run
    also takes glu=True (W stacking [gate; up], SwiGLU in its epilogue)."""
    name: str
    fits: Callable[[Any, DeviceCaps, int], str | None]
    config: Callable[[Any, DeviceCaps, int], tuple]
    run: Callable[..., torch.Tensor]
    why: Callable[[Any, DeviceCaps, int], str]
    glu: bool = False


class Choice(NamedTuple):
    """The path that runs an M bucket of a weight, with its named launch config."""
    path: Path
    config: tuple


PLANS = ("quanta.kernels.affine.plan", "quanta.kernels.ggml.plan")     # the modules whose TABLE is a PathTable


@functools.lru_cache(maxsize=8)
def row_classes(limit: int) -> list[int]:
    """Row counts up to `limit` that meet every class of M a launch can compile apart: per class (the bucket of
    every PLANS module's TABLE, whether M divides by 16, whether M is 1: Triton specializes integer arguments so) its
    smallest and its largest M, since a launcher may derive more (the split of K) from M within a bucket."""
    edges = [importlib.import_module(module).TABLE.bucket_edge for module in PLANS]
    ends: dict[tuple, list[int]] = {}
    for m in range(1, limit + 1):
        key = (*(edge(m) for edge in edges), m % 16 == 0, m == 1)
        ends.setdefault(key, [m, m])[1] = m
    return sorted({m for pair in ends.values() for m in pair})          # (cached: every engine start asks)


class PathTable:
    """`paths` in order, and `bucket_edge(m)`: the M whose plan every M of m's bucket shares."""

    def __init__(self, paths: tuple[Path, ...], bucket_edge: Callable[[int], int]):
        self.paths, self.bucket_edge = paths, bucket_edge
        self.by_name = {p.name: p for p in paths}

    def decide(self, st, caps: DeviceCaps, m: int) -> Choice:
        """The first path that fits M rows, with its config (uncached)."""
        if not caps.supports_dtype(st.dtype):
            raise UnsupportedError(f"{caps.name} does not compute in {st.dtype}")
        path = next(p for p in self.paths if p.fits(st, caps, m) is None)
        return Choice(path, path.config(st, caps, m))

    def choose(self, st, caps: DeviceCaps, m: int) -> Choice:
        """decide() for M's bucket, cached on the state."""
        key = (caps, self.bucket_edge(m))
        choice = st.plans.get(key)
        if choice is None:
            choice = st.plans[key] = self.decide(st, caps, key[1])
        return choice

    def pick(self, st, caps: DeviceCaps, m: int, path: str | None = None) -> Choice:
        """choose() for M rows, or the path named `path` with its config at M (tests and benchmarks force one)."""
        if path is None:
            return self.choose(st, caps, m)
        forced = self.by_name[path]
        return Choice(forced, forced.config(st, caps, m))

    def explain(self, st, caps: DeviceCaps, m: int) -> tuple[str, str]:
        """(the path that runs M rows, why; and why each path before it does not)."""
        chosen = self.choose(st, caps, m).path
        passed = [f"not {p.name}: {p.fits(st, caps, m)}" for p in self.paths[: self.paths.index(chosen)]]
        return chosen.name, "; ".join([chosen.why(st, caps, m)] + passed)
