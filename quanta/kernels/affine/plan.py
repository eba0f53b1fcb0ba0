"""Which affine path runs M rows of a weight: one ordered table of paths over a DeviceCaps value.

The first path of PATHS whose `fits(state, caps, m)` returns None runs; each other's answer says why not. Every
choice is computed from the DeviceCaps passed in (QUANTA_DEVICE_CAPS=sm75 plans as a T4 on any GPU) and
cached on the weight's state per M bucket (bucket_edge): within a bucket no rule or config changes. Reasons are
built only when asked (`explain`), never on the hot path.
"""
from __future__ import annotations

import bisect

import torch

from quanta.kernels import activation
from quanta.kernels.affine import cublas, gemv, mma, splitk, wgmma
from quanta.kernels.affine.layout import LUT, AffineState
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.lora_epilogue import MAX_ROWS as LORA_MAX_ROWS
from quanta.kernels.lora_epilogue import LoRAEpilogue
from quanta.kernels.path_table import Choice, Path, PathTable
from quanta.kernels.rotary import RopeStore

# At M <= 2 the GEMV streams the weight with no tensor-core tile to fill. Where the MMA kernel decodes in PTX (sm90)
# it is faster from M = 2, so the GEMV keeps M = 1; table codes the GEMV would gather from memory per code (bf16)
# go to the MMA kernel from M = 1 there, and keep the GEMV for M = 1 only elsewhere.
GEMV_MAX_M = gemv.MAX_ROWS
# The register-operand MMA kernel is faster than the split-K GEMM at every M tried on the Llama shapes, and than
# dequantize + cuBLAS up to M = 512; from M = 1024 cuBLAS is faster on all of them.
MMA_MAX_M = 512
MMA_CAPABILITY = (9, 0)          # where the MMA kernel runs: its register operand is Hopper's wgmma, its large-M
                                 # tiles want sm90's shared memory
# The wgmma kernel takes M = 2..16 from the MMA kernel outright, and M = 17..32 where two waves of its 256-row
# programs would still take 2.5 K tiles each: below (8B o), the MMA kernel's smaller programs fill the SMs better.
WGMMA_ALWAYS_MAX_M = 16
WGMMA_MIN_TILES_EACH = 2.5
# bf16 at M = 1: the GEMV decodes bf16 in fp32 (three instructions a code), so the wgmma kernel is faster where its
# programs have 4 K tiles each or more (from 8B down up), not on the small weights (8B qkv, o).
WGMMA_BF16_M1_MIN_TILES_EACH = 4
# Groups of 32 and 64 (GGUF Q4_0 / Q4_1, AWQ / GPTQ g32, g64) go to the wgmma kernel in fp16 up to M = 256, where it
# was measured faster than the MMA kernel on the Llama shapes; bf16 and larger M keep the MMA kernel's path. 8-bit
# codes (fp16) take it up to the same M: a K tile of half the columns leaves a tile's fixed cost over fewer wgmmas.
WGMMA_NARROW_MAX_M = 256
# 8-bit codes on a weight wider than it is deep (N > K: Llama's qkv, gate_up) leave it for the MMA kernel above this M,
# a program's 128 rows of x (large_m_config), from where the wgmma kernel decodes each weight tile once more for every
# 128 rows: on those weights the MMA kernel was then as fast or faster (8B and 70B shapes), on the deep ones slower.
WGMMA_EIGHT_BIT_WIDE_MAX_M = 128
# Above, dequantize + cuBLAS, whose decode costs the same at any M, is faster on most Llama shapes.
WGMMA_MAX_M = 1024
# An act-order weight whose input arrives in the model's order (o, down: no norm writes it sorted) takes the wgmma
# kernel from here, after a gather of x into its column order: the MMA kernel's gather tile by tile grows with M
# (random columns of x a tile), the gather's launch does not; at M = 2 the launch costs more than it saves.
WGMMA_GATHER_MIN_M = 4
# Where the MMA kernel does not run the split-K GEMM takes M up to 255: at 256 the GEMM is compute-bound and its
# 128x256 tiles lose to cuBLAS on the wider weights (qkv).
CUBLAS_MIN_M = 256


def _mma_runs(st: AffineState, caps: DeviceCaps) -> bool:
    return caps.capability == MMA_CAPABILITY and mma.weight_fits(st)


def _gemv_max_m(st: AffineState, caps: DeviceCaps) -> int:
    """The most rows the GEMV takes (GEMV_MAX_M's rule)."""
    table_gather = st.mode == LUT and not gemv.h2_applies(st)
    if _mma_runs(st, caps) and mma.h2_applies(st):
        return 0 if table_gather else 1
    return 1 if table_gather else GEMV_MAX_M


def _wgmma_fits(st: AffineState, caps: DeviceCaps, m: int) -> str | None:
    if not caps.gluon or wgmma.GLUON_ERROR is not None:
        return f"no Gluon wgmma on {caps.name}" + (f" ({wgmma.GLUON_ERROR})" if wgmma.GLUON_ERROR else "")
    if not wgmma.weight_fits(st):
        return ("takes 4-bit affine codes (fp16 8-bit ones) in groups of 32, 64, a multiple of the K tile or per "
                "channel")
    if st.group_size < wgmma.tile_columns(st) and (st.dtype != torch.float16 or m > WGMMA_NARROW_MAX_M):
        return f"groups of {st.group_size} in {st.dtype} at M={m}: the MMA kernel's"
    if st.bits == 8 and m > WGMMA_NARROW_MAX_M:
        return f"8-bit codes at M={m}: the MMA kernel's"
    if st.bits == 8 and st.n > st.k and m > WGMMA_EIGHT_BIT_WIDE_MAX_M:
        return f"8-bit codes at M={m} on a weight wider ({st.n}) than deep ({st.k}): the MMA kernel's"
    if st.perm is not None and m < WGMMA_GATHER_MIN_M:
        return f"act-order M={m} < {WGMMA_GATHER_MIN_M}: the input would be gathered in a launch of its own"
    if m > WGMMA_MAX_M:
        return f"M={m} > {WGMMA_MAX_M}"
    if m > wgmma.ONE_WARPGROUP_MAX_M:
        if st.dtype == torch.float16:
            return None
        splits = wgmma.grid(st, caps.sm_count, wgmma.large_m_config(st, caps, m), m)[1]
        return None if splits == 1 else f"bf16 M={m}: its K loop would be split in {splits} (float32 partial sums)"
    each = wgmma.k_tiles_each(st, caps.sm_count)
    if m == 1:
        if st.dtype == torch.bfloat16 and each >= WGMMA_BF16_M1_MIN_TILES_EACH:
            return None
        return f"M=1: the GEMV's (fp16, or {each:.1f} K tiles a program)"
    if m <= WGMMA_ALWAYS_MAX_M or each >= WGMMA_MIN_TILES_EACH:
        return None
    return f"M={m}: {each:.1f} K tiles a program, too few to fill the SMs"


def _gemv_fits(st: AffineState, caps: DeviceCaps, m: int) -> str | None:
    top = _gemv_max_m(st, caps)
    return None if m <= top else f"M={m} > {top}"


def _mma_fits(st: AffineState, caps: DeviceCaps, m: int) -> str | None:
    if caps.capability != MMA_CAPABILITY:
        return f"runs on sm90, not {caps.name}"
    if not mma.weight_fits(st):
        return "takes affine or 4-bit table codes"
    return None if m <= MMA_MAX_M else f"M={m} > {MMA_MAX_M}"


def _cublas_fits(st: AffineState, caps: DeviceCaps, m: int) -> str | None:
    return None if st.mode == LUT or m >= CUBLAS_MIN_M else f"M={m} < {CUBLAS_MIN_M}"


def _why_wgmma(st: AffineState, caps: DeviceCaps, m: int) -> str:
    gather = ", the act-order input gathered into the weight's column order first" if st.perm is not None else ""
    return (f"M={m}, {st.bits}-bit affine codes on sm90: one asynchronous wgmma per code, decoded into its register "
            f"operand while the previous ones run (Gluon){gather}")


def _why_gemv(st: AffineState, caps: DeviceCaps, m: int) -> str:
    inner = "packed-half FMAs" if gemv.use_h2(st, caps) else "fp32 FMAs"
    return f"M={m} <= {_gemv_max_m(st, caps)}: bandwidth-bound GEMV without tensor cores ({inner})"


def _why_mma(st: AffineState, caps: DeviceCaps, m: int) -> str:
    return (f"M={m} <= {MMA_MAX_M}: yT = W xT with the decoded weight as the MMA's register operand "
            "(no shared-memory round trip)")


def _why_cublas(st: AffineState, caps: DeviceCaps, m: int) -> str:
    dtype = str(st.dtype).removeprefix("torch.")
    if st.mode == LUT and m < CUBLAS_MIN_M:
        return f"M={m}, table codes: the split-K kernel would gather the table per code; dequantize to {dtype} + cuBLAS"
    return f"M={m} >= {CUBLAS_MIN_M}: compute-bound; dequantize to {dtype} + cuBLAS"


def _why_splitk(st: AffineState, caps: DeviceCaps, m: int) -> str:
    return f"M={m}: split-K tl.dot GEMM with in-register dequantization"


# The paths in order, and what each takes:
#   wgmma   sm90 with Gluon, 4-bit affine codes (8-bit in fp16) with a scale row a K tile (act-order from
#           WGMMA_GATHER_MIN_M):
#           M = 2..16, M = 17..32 where its programs have work enough, M = 33..1024 (bf16 where its K loop is not
#           split), bf16 M = 1 on the larger weights; groups of 32 / 64 in fp16 only, M = 2..256
#   gemv    M <= 2 (M = 1 where the MMA kernel decodes in PTX; none for bf16 table codes there)
#   mma     sm90, affine or 4-bit table codes, M <= 512
#   cublas  table codes above the GEMV where the MMA kernel does not run, and every weight from M = 256
#   splitk  the rest: the split-K tl.dot GEMM
PATHS: tuple[Path, ...] = (
    Path("wgmma", _wgmma_fits, wgmma.default_config, wgmma.matmul, _why_wgmma),
    Path("gemv", _gemv_fits, gemv.default_config, gemv.matmul, _why_gemv),
    Path("mma", _mma_fits, mma.default_config, mma.matmul, _why_mma),
    Path("cublas", _cublas_fits, cublas.default_config, cublas.matmul, _why_cublas),
    Path("splitk", lambda st, caps, m: None, splitk.default_config, splitk.matmul, _why_splitk),
)

# The M at which a rule or a launch config may change: the thresholds above, the row blocks of x up to 64 (16, 32,
# 64: the configs' buckets) and the multiples of 128 above (the large-M programs' rows of x). The bucket of M is the
# first edge >= M; every M of a bucket gets the plan of its edge. Above the last edge, one bucket.
BUCKET_EDGES = tuple(sorted({0, 1, GEMV_MAX_M, WGMMA_GATHER_MIN_M - 1, WGMMA_ALWAYS_MAX_M,
                             wgmma.ONE_WARPGROUP_MAX_M, 64, WGMMA_EIGHT_BIT_WIDE_MAX_M, WGMMA_NARROW_MAX_M,
                             CUBLAS_MIN_M - 1, CUBLAS_MIN_M, MMA_MAX_M, *range(128, WGMMA_MAX_M + 1, 128)}))


def bucket_edge(m: int) -> int:
    """The M whose plan every M of m's bucket shares."""
    i = bisect.bisect_left(BUCKET_EDGES, m)
    return BUCKET_EDGES[i] if i < len(BUCKET_EDGES) else BUCKET_EDGES[-1] + 1


TABLE = PathTable(PATHS, bucket_edge)
decide, choose, explain = TABLE.decide, TABLE.choose, TABLE.explain


def _rows(x: torch.Tensor, st: AffineState) -> torch.Tensor:
    x2 = x.reshape(-1, st.k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _planned(x: torch.Tensor, st: AffineState) -> tuple[torch.Tensor, DeviceCaps, Choice]:
    """x's rows as the kernels take them, the device's caps, and the plan's path for that many rows."""
    x2 = _rows(x, st)
    caps = device_caps(x2.device)
    return x2, caps, choose(st, caps, x2.shape[0])


def matmul(x: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, path: str | None = None,
           caps: DeviceCaps | None = None, lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K] by the planned path; `path` forces one (tests, benchmarks), `caps` plans
    for other caps than the device's (tests). `lora`: adapter products the GEMV adds (lora_fuses must hold)."""
    x2 = _rows(x, st)
    caps = caps or device_caps(x2.device)
    choice = TABLE.pick(st, caps, x2.shape[0], path)
    if lora is not None:
        assert choice.path.name == "gemv", "only the GEMV takes a LoRA epilogue (lora_fuses)"
        y = gemv.matmul(x2, st, bias, choice.config, caps=caps, lora=lora)
    else:
        y = choice.path.run(x2, st, bias, choice.config, caps=caps)
    return y.reshape(*x.shape[:-1], st.n)


def lora_fuses(st: AffineState, m: int) -> bool:
    """Whether the planned path for m rows takes a LoRA epilogue (lora_epilogue.py): the GEMV's."""
    return m <= LORA_MAX_ROWS and choose(st, device_caps(st.packed.device), m).path.name == "gemv"


def matmul_glu(x: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None,
               lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = x @ W.T + bias, W stacking the MLP's gate and up: on the GEMV path its
    epilogue makes it (one launch fewer a decode layer); else the planned path, then activation.silu_and_mul.
    `lora`: as matmul's."""
    x2, caps, choice = _planned(x, st)
    if choice.path.name == "gemv":
        y = gemv.matmul(x2, st, bias, gemv.glu_config(st, caps, choice.config), caps=caps, glu=True, lora=lora)
    else:
        assert lora is None, "only the GEMV takes a LoRA epilogue (lora_fuses)"
        y = activation.silu_and_mul(choice.path.run(x2, st, bias, choice.config, caps=caps))
    return y.reshape(*x.shape[:-1], st.n // 2)


def matmul_rope(x: torch.Tensor, st: AffineState, bias: torch.Tensor | None, rope: RopeStore,
                lora: LoRAEpilogue | None = None) -> torch.Tensor | None:
    """x @ W.T + bias for W stacking [q; k; v], finished by the GEMV's rotary + KV-store epilogue: [..., N] whose
    q columns hold the rotated q (k and v are in the caches). None where the plan's path for x's rows is not a
    GEMV that can (the caller then runs the GEMM, then the rotary kernel). `lora`: as matmul's."""
    x2, caps, choice = _planned(x, st)
    if choice.path.name != "gemv" or not gemv.rope_applies(st, rope, choice.config):
        return None
    return gemv.matmul(x2, st, bias, choice.config, caps=caps, rope=rope, lora=lora).reshape(*x.shape[:-1], st.n)
