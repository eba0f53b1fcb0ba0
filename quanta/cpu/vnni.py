"""4- and 8-bit affine weights on the CPU with 8-bit activations and integer dot products (vnni_matmul.c: AVX512-VNNI,
else AVX2), as llama.cpp computes GGUF's Q4_0, Q4_1 and Q8_0: GGUF's legacy types, AWQ / GPTQ groups and 8-bit
GPTQ held at their own bytes, float32 activations in and out (no bfloat16 round trip a GEMM).

The weight is laid out once in tiles of 16 rows whose codes interleave so that one vector holds four codes of
each row; a product is then 8 `vpdpbusd` a block of 32 columns for 16 rows at once, the rows in the lanes, so
no lane sum is ever taken. Each activation row is quantized to blocks of 32 (the C file says how) and the
result is W times those blocks, summed in one fixed order whatever the batch: the kernel is batch-invariant.
Scales (and mins) stay float16, as the checkpoints hold them; a weight whose scales float16 cannot hold exactly,
or a CPU with neither instruction set, goes to the next kernel in the registry's order.
"""
from __future__ import annotations

import ctypes
import functools
import pathlib
from dataclasses import dataclass, field

import torch

from quanta.cpu import affine as cpu_affine
from quanta.cpu.affine import reference  # noqa: F401  (the oracle)
from quanta.cpu.ggml import FLAG_SETS
from quanta.quant import native_build
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import Gguf
from quanta.quant.qtensor import QTensor

NAME = "cpu_vnni"
SOURCE = pathlib.Path(__file__).with_name("vnni_matmul.c")
TILE = 16                   # weight rows a tile: the int32 lanes of a 512-bit vector
BLOCK = 32                  # columns an activation block
ZERO_ONE, ZERO_GROUPS, MINS = 0, 1, 2       # how W's offset is held (vnni_matmul.c's modes)
GGUF_TYPES = ("q4_0", "q4_1", "q8_0")      # the 4- and 8-bit ggml types with an affine form (Q4_K's is float32)
ISA = {512: "AVX512-VNNI", 256: "AVX2"}    # the instruction set of each vector width vnni_matmul.c builds for
MAX_PAD = 0.03              # the most a weight's padding to whole tiles may add to what it holds


@dataclass
class State:
    codes: torch.Tensor         # uint8, tiles of 16 rows interleaved (vnni_matmul.c)
    scales: torch.Tensor        # float16 [tiles, groups, 16]
    offsets: torch.Tensor | None    # uint8 zeros or float16 mins [tiles, groups, 16]; None for one zero
    bits: int
    group_blocks: int
    mode: int
    zero: int
    in_features: int
    out_features: int
    scheme: str                 # the weight's describe(), for what reads rows of it (a tied embedding)
    weight_args: tuple = field(init=False, repr=False)     # the C call's weight arguments, made once

    def __post_init__(self) -> None:
        self.weight_args = (self.codes.data_ptr(), self.bits, self.scales.data_ptr(), self.group_blocks, self.mode,
                            self.zero, None if self.offsets is None else self.offsets.data_ptr(), self.scales.shape[0])

    def describe(self) -> str:
        return self.scheme

    def take_rows(self, ids: torch.Tensor) -> Affine:
        """Rows `ids` of the weight as an Affine of their own codes, scales and offsets (its dequantize() gives
        the weight's values exactly): what a tied embedding looks up instead of holding the table twice."""
        t, r = ids // TILE, ids % TILE
        codes = self.codes[t, :, :, r]                          # [len, blocks, vectors, 4]
        if self.bits == 4:                                      # vector u: columns 8u + i low, 8u + 4 + i high
            codes = torch.stack([codes & 15, codes >> 4], dim=-2)
        scales = self.scales[t, :, r].float()
        offsets = None if self.offsets is None else self.offsets[t, :, r]
        group = self.group_blocks * BLOCK
        if self.mode == MINS:
            kw = {"mins": offsets.float()}
        else:
            kw = {"zeros": offsets if self.mode == ZERO_GROUPS else self.zero}
        return Affine(codes=codes.reshape(len(ids), -1), scales=scales, bits=self.bits, group_size=group,
                      shape=(len(ids), self.in_features), **kw)


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    scheme, why_not = cpu_affine.cpu_scheme(weight, device, dtype)
    if why_not is not None:
        return why_not
    n, k = weight.shape
    if -n % TILE > MAX_PAD * n:
        return f"N={n}: its last 16-row tile's padding would hold {-n % TILE / n:.0%} more than the weight"
    if scheme.bits not in (4, 8) or scheme.act_order:
        return f"needs plain 4- or 8-bit groups, weight is {weight.describe()}"
    if k % BLOCK or scheme.group_size % BLOCK or k % scheme.group_size:
        return f"groups of {scheme.group_size} with K={k} (needs multiples of {BLOCK} dividing K)"
    if (why := native_build.missing(_library)) is not None:
        return why
    if not _library().quanta_vnni_available():
        return "this CPU or build has neither AVX512-VNNI nor AVX2 with FMA and F16C"
    if isinstance(weight, Gguf):            # the legacy types' scales and mins are float16 in the file
        return None if weight.type.name in GGUF_TYPES else f"{weight.type.name}: scales float16 does not hold"
    a = cpu_affine.affine_form(weight)      # an Affine's own (to_affine returns itself)
    if a.post_scale is not None:
        return "a post-scale (bnb's) is not held by the kernel"
    if not _exact_half(a.scales) or (a.mins is not None and not _exact_half(a.mins)):
        return "scales (or mins) that float16 does not hold exactly"
    return None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """int8: the products are integer ones, of the activations' 8-bit blocks (made from float32 rows)."""
    return torch.int8


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    a = cpu_affine.affine_form(weight)
    n, k = a.shape
    pad = -n % TILE
    tiles, blocks, groups = (n + pad) // TILE, k // BLOCK, a.num_groups
    codes = torch.nn.functional.pad(a.codes, (0, 0, 0, pad))
    if a.bits == 4:         # [t, r, j, u, half, i] -> byte (r, i) of vector u: column 8u + i low, 8u + 4 + i high
        codes = codes.view(tiles, TILE, blocks, 4, 2, 4)
        codes = codes[:, :, :, :, 0] | (codes[:, :, :, :, 1] << 4)
    else:                   # [t, r, j, u, i]: column 4u + i
        codes = codes.view(tiles, TILE, blocks, 8, 4)
    codes = codes.permute(0, 2, 3, 1, 4).contiguous()

    def per_tile(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        v = torch.nn.functional.pad(v.to(dtype), (0, 0, 0, pad))
        return v.view(tiles, TILE, groups).transpose(1, 2).contiguous()

    if a.mins is not None:
        mode, zero, offsets = MINS, 0, per_tile(a.mins, torch.float16)
    elif isinstance(a.zeros, torch.Tensor):
        mode, zero, offsets = ZERO_GROUPS, 0, per_tile(a.zeros, torch.uint8)
    else:
        mode, zero, offsets = ZERO_ONE, int(a.zeros), None
    return State(codes, per_tile(a.scales, torch.float16), offsets, a.bits, a.group_size // BLOCK, mode, zero, k, n,
                 weight.describe())


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, state.in_features).float().contiguous()
    y = torch.empty(rows.shape[0], state.out_features)
    if rows.shape[0]:
        done = _library().quanta_vnni_matmul(rows.data_ptr(), rows.shape[0], state.in_features, *state.weight_args,
                                             y.data_ptr(), state.out_features, torch.get_num_threads())
        assert done == 0, (state.bits, state.in_features)          # supports() admitted only what it takes
    return cpu_affine.finish(y, x.shape[:-1], state.out_features, x.dtype, bias)


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    return NAME, (f"{state.bits}-bit codes in 16-row tiles, activations to 8-bit blocks of {BLOCK}, integer dot "
                  f"products ({ISA[_library().quanta_vnni_available()]})")


def _exact_half(v: torch.Tensor) -> bool:
    return bool(torch.equal(v.float().half().float(), v.float()))


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    lib = native_build.load(SOURCE, FLAG_SETS, "the native VNNI matmul")
    if lib is not None:
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.quanta_vnni_available.restype = i
        lib.quanta_vnni_available.argtypes = []
        lib.quanta_vnni_matmul.restype = i
        lib.quanta_vnni_matmul.argtypes = [p, i64, i64, p, i, p, i64, i, i, p, i64, p, i64, i]
    return lib
