"""Which ggml path runs M rows of a weight: one ordered table of paths over a DeviceCaps value.

The first path of PATHS whose `fits(state, caps, m)` returns None runs; each other's answer says why not. The
choice is cached on the weight's state per M bucket (the GEMM and MMA configs' buckets) and caps.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels import activation
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml import cublas, gemm, gemv, gemv_cols, gemv_dp4a, gemv_iq4, mma, wgmma
from quanta.kernels.ggml.layout import GgmlState
from quanta.kernels.path_table import Path, PathTable
from quanta.kernels.rotary import RopeStore

# The GEMV decodes the weight once per activation row, the GEMM once per tile of up to 16 rows: the GEMV's single
# decode without a trip through shared memory wins at one row, its second decode loses at two (Q4_K and Q6_K at
# Llama-3-8B shapes on the H200).
GEMV_MAX_M = 1
# From here decoding the weight once into a transient copy for cuBLAS costs less than the GEMM, which decodes every
# weight tile again for each tile of rows, in float32, and hands it to the tensor cores through shared memory: its
# time grows with M from a few tiles of rows on, where the copy's decode is paid once at any M.
CUBLAS_MIN_M = 65


class TypeRule(NamedTuple):
    """A ggml type's M thresholds: dequantize + cuBLAS from `cublas_min_m` rows; the wgmma path up to `wgmma_max_m`
    and the MMA path (where wgmma cannot run) up to `mma_max_m` (0: the plan does not give it that path)."""
    cublas_min_m: int = CUBLAS_MIN_M
    mma_max_m: int = 0
    wgmma_max_m: int = 0


# One row per type that differs from the default, from the crossovers on the Llama-3-8B shapes on the H200.
# - cuBLAS sooner: Q6_K and Q3_K assemble each code from two planes, so the copy for cuBLAS is as fast from a single
#   tile of rows (17); IQ4's GEMM gathers its table per code, so from 2 rows.
# - The MMA path decodes each weight tile once per tile of rows, as the GEMM does, but in packed fp16 straight into
#   the tensor cores' register operand: faster than the GEMM at every M and than dequantize + cuBLAS up to a
#   hundred-odd rows (Q4_K), where the decode repeated for each tile of rows costs more than the copy's one decode;
#   Q6_K's decode (two planes a code) costs more, so its copy wins from fewer rows; Q5_K's (Q4_K's and a fifth bit)
#   still beats the copy to 128 rows.
# - The wgmma path (Gluon, sm90) decodes as the MMA path but overlaps each slice's decode with the previous slice's
#   wgmma: faster than the MMA path at every M and than the copy up to 128 rows for all three; with x put in its
#   order before the kernel (wgmma.ORDERED_MIN_M), up to 384 for Q4_K and 256 for Q6_K (on 128 rows of x), not
#   further for Q5_K, whose decode (a fifth bit from a plane of its own) leaves 128 rows of x too few registers.
RULES = {"q4_K": TypeRule(mma_max_m=128, wgmma_max_m=384), "q5_K": TypeRule(mma_max_m=128, wgmma_max_m=128),
         "q6_K": TypeRule(17, mma_max_m=64, wgmma_max_m=256),
         "q3_K": TypeRule(17), "iq4_nl": TypeRule(2), "iq4_xs": TypeRule(2)}
LOWEST_CUBLAS_MIN_M = min(CUBLAS_MIN_M, *(r.cublas_min_m for r in RULES.values()))


def _rule(st: GgmlState) -> TypeRule:
    return RULES.get(st.name, TypeRule())


def mma_max_m(st: GgmlState) -> int:
    """The most rows the plan gives the MMA path for this weight (0: none)."""
    return _rule(st).mma_max_m


def wgmma_max_m(st: GgmlState) -> int:
    """The most rows the plan gives the wgmma path for this weight (0: none)."""
    return _rule(st).wgmma_max_m


def cublas_min_m(st: GgmlState) -> int:
    """The fewest rows from which the weight is dequantized for cuBLAS."""
    return _rule(st).cublas_min_m


# The types a dp4a GEMV takes at one row, on 8-bit activations. IQ4's on every weight: the table GEMV it replaces
# gathers a float per code (in fp16 the registry gives IQ4 the codebook kernels, so this is bf16's path). Not Q2_K's
# or Q3_K's: in the decode chain their dp4a GEMV was no faster than the packed-half one (benchmarks/dp4a_decode.sh);
# were they planned, only their large weights (DP4A_MIN_VALUES values and more): the small weights' GEMVs are
# latency-bound, and x's quantization would lengthen their chain.
DP4A_TYPES: tuple[str, ...] = ("iq4_nl", "iq4_xs")
DP4A_MIN_VALUES = gemv_cols.LARGE_WEIGHT


def _one_row_fits(kernel, dp4a: bool = False, large_only: bool = False):
    """fits() of a PTX GEMV path: one row, on CUDA; for a dp4a path (`dp4a`) a type planned there (DP4A_TYPES), with
    large_only a weight of DP4A_MIN_VALUES values or more; where kernel.applies runs it."""
    def fits(st: GgmlState, caps: DeviceCaps, m: int) -> str | None:
        if m > GEMV_MAX_M:
            return f"M={m} > {GEMV_MAX_M}"
        if not caps.is_cuda:
            return "not CUDA (PTX)"
        if dp4a and st.name not in DP4A_TYPES:
            return f"{st.name}: not planned on the dp4a path"
        if large_only and st.n * st.k < DP4A_MIN_VALUES:
            return (f"{st.n}x{st.k} < {DP4A_MIN_VALUES} values (latency-bound: x's quantization would add to its "
                    "chain)")
        return kernel.applies(st, caps)
    return fits


def _why_gemv_dp4a(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return (f"M={m} <= {GEMV_MAX_M}: GEMV over column-major words against x rounded to int8 in blocks of 32, "
            f"{st.name} codes four a dp4a")


def _why_gemv_iq4(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return (f"M={m} <= {GEMV_MAX_M}: GEMV over row-major words against x rounded to int8 in blocks of 32, "
            f"{st.name} codes to table values by byte permutes, four a dp4a")


def _why_gemv_cols(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return (f"M={m} <= {GEMV_MAX_M}: bandwidth-bound GEMV over column-major words, {st.name} code words to packed "
            "halves, packed-half FMAs")


def _gemv_fits(st: GgmlState, caps: DeviceCaps, m: int) -> str | None:
    return None if m <= GEMV_MAX_M else f"M={m} > {GEMV_MAX_M}"


def _why_gemv(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return f"M={m} <= {GEMV_MAX_M}: bandwidth-bound GEMV, {st.name} blocks decoded in registers, fp32 FMAs"


def _fits_to_max_m(name: str, max_m, kernel):
    """fits() of a tensor-core path: the rows its rule gives it (max_m(st); none where 0), on CUDA, where
    kernel.applies runs the weight."""
    def fits(st: GgmlState, caps: DeviceCaps, m: int) -> str | None:
        if not max_m(st):
            return f"{st.name}: not planned on the {name} path"
        if m > max_m(st):
            return f"M={m} > {max_m(st)}"
        return "not CUDA (PTX)" if not caps.is_cuda else kernel.applies(st, caps)
    return fits


def _why_wgmma(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return f"M={m}: Gluon wgmma, {st.name} code slices decoded in PTX, each into its own asynchronous wgmma"


def _why_mma(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return f"M={m}: tensor-core GEMM, {st.name} code words decoded in PTX into the MMA's register operand"


def _cublas_fits(st: GgmlState, caps: DeviceCaps, m: int) -> str | None:
    return None if m >= cublas_min_m(st) else f"M={m} < {cublas_min_m(st)}"


def _why_cublas(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return f"M={m} >= {cublas_min_m(st)}: {st.name} dequantized once to {str(st.dtype).removeprefix('torch.')} " \
           "+ cuBLAS"


def _why_gemm(st: GgmlState, caps: DeviceCaps, m: int) -> str:
    return f"M={m}: tl.dot GEMM, {st.name} tiles decoded in registers to {str(st.dtype).removeprefix('torch.')}"


# The paths in order:
#   gemv_dp4a M <= GEMV_MAX_M, the large weights of fp16 Q2_K / Q3_K in DP4A_TYPES on CUDA: integer dot products
#             against x rounded to int8 over column-major words
#   gemv_iq4  M <= GEMV_MAX_M, 16-bit IQ4_NL / IQ4_XS in DP4A_TYPES on CUDA: the same over row-major words, codes
#             turned into the table's int8 values by byte permutes
#   gemv_cols M <= GEMV_MAX_M, fp16 Q2_K .. Q6_K on CUDA: dot products (packed halves in PTX; float32 for Q2_K,
#             Q3_K) over column-major words, a thread's columns walking K
#   gemv    M <= GEMV_MAX_M: one program row per activation row, no tensor cores
#   wgmma   M <= wgmma_max_m(st), fp16 Q4_K / Q5_K / Q6_K on sm90 with Gluon: mma's decode, a wgmma a slice of 16
#   mma     M <= mma_max_m(st), fp16 Q4_K / Q5_K / Q6_K on sm90: the code words decoded into wgmma's register operand
#   cublas  M >= cublas_min_m(st): the weight dequantized for the length of the call, then cuBLAS
#   gemm    the rest: the tiled tl.dot GEMM (split-K for small M)
PATHS: tuple[Path, ...] = (
    Path("gemv_dp4a", _one_row_fits(gemv_dp4a, dp4a=True, large_only=True), gemv_dp4a.default_config,
         gemv_dp4a.matmul, _why_gemv_dp4a, glu=True),
    Path("gemv_iq4", _one_row_fits(gemv_iq4, dp4a=True), gemv_iq4.default_config, gemv_iq4.matmul, _why_gemv_iq4,
         glu=True),
    Path("gemv_cols", _one_row_fits(gemv_cols), gemv_cols.default_config, gemv_cols.matmul, _why_gemv_cols,
         glu=True),
    Path("gemv", _gemv_fits, gemv.default_config, gemv.matmul, _why_gemv),
    Path("wgmma", _fits_to_max_m("wgmma", wgmma_max_m, wgmma), wgmma.default_config, wgmma.matmul, _why_wgmma),
    Path("mma", _fits_to_max_m("MMA", mma_max_m, mma), mma.default_config, mma.matmul, _why_mma),
    Path("cublas", _cublas_fits, cublas.default_config, cublas.matmul, _why_cublas),
    Path("gemm", lambda st, caps, m: None, gemm.default_config, gemm.matmul, _why_gemm),
)


# the tops of the GEMM's and the MMA kernels' config buckets (the last MMA bucket is open), and the MMA paths' ends
BUCKET_TOPS = sorted({top for top, _ in gemm.GEMM_CONFIGS} | {top for top, _ in mma.MMA_CONFIGS[:-1]}
                     | {r.mma_max_m for r in RULES.values() if r.mma_max_m}
                     | {r.wgmma_max_m for r in RULES.values() if r.wgmma_max_m})


def bucket_edge(m: int) -> int:
    """The M whose plan every M of m's bucket shares: m itself up to the GEMV's limit, then the GEMM and MMA
    configs' bucket tops; above the last, one bucket."""
    if m <= GEMV_MAX_M:
        return m
    return next((top for top in BUCKET_TOPS if m <= top), max(CUBLAS_MIN_M, BUCKET_TOPS[-1] + 1))


TABLE = PathTable(PATHS, bucket_edge)
decide, choose, explain = TABLE.decide, TABLE.choose, TABLE.explain


def matmul(x: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, path: str | None = None,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K] by the planned path; `path` forces one (tests, benchmarks), `caps` plans
    for other caps than the device's (tests)."""
    x2 = x.reshape(-1, st.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], st.n)
    caps = caps or device_caps(x2.device)
    choice = TABLE.pick(st, caps, x2.shape[0], path)
    y = choice.path.run(x2, st, bias, choice.config, caps=caps)
    return y.reshape(*x.shape[:-1], st.n)


def _planned(x: torch.Tensor, st: GgmlState):
    """(x as [M, K] rows with unit stride, the device's caps, the plan's choice for M)."""
    x2 = x.reshape(-1, st.k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    caps = device_caps(x2.device)
    return x2, caps, TABLE.pick(st, caps, x2.shape[0], None)


def matmul_glu(x: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for [gate | up] = x @ W.T + bias, W stacking the MLP's gate and up: made in the GEMVs'
    epilogue where they run (packed-half or dp4a: one launch fewer a decode layer); else the planned path,
    then silu_and_mul."""
    if x.numel() == 0:
        return x.new_empty(*x.shape[:-1], st.n // 2)
    x2, caps, choice = _planned(x, st)
    if choice.path.glu:
        y = choice.path.run(x2, st, bias, choice.config, caps=caps, glu=True)
    else:
        y = activation.silu_and_mul(choice.path.run(x2, st, bias, choice.config, caps=caps))
    return y.reshape(*x.shape[:-1], st.n // 2)


def matmul_rope(x: torch.Tensor, st: GgmlState, bias: torch.Tensor | None, rope: RopeStore) -> torch.Tensor | None:
    """x @ W.T + bias for W stacking [q; k; v], finished by the column-major GEMV's rotary + KV-store epilogue:
    [..., N] whose q columns hold the rotated q. None where the plan's path is not that GEMV or it cannot."""
    if x.numel() == 0:
        return None
    x2, caps, choice = _planned(x, st)
    if choice.path.name != "gemv_cols" or not gemv_cols.rope_applies(st, rope, choice.config):
        return None
    return gemv_cols.matmul(x2, st, bias, choice.config, caps=caps, rope=rope).reshape(*x.shape[:-1], st.n)


def matmul_pair(x: torch.Tensor, a: GgmlState, b: GgmlState, bias: torch.Tensor | None = None,
                rope: RopeStore | None = None) -> torch.Tensor | None:
    """x @ [A; B].T + bias in one launch for weights of two types over one input (a mixed file's q, k in one type
    and v in another), with the rotary + KV-store epilogue where `rope` is given: the column-major GEMV where the
    plan gives both that path (one row) and it can stack them (gemv_cols.pair_applies); else None, and the caller
    runs each."""
    if x.numel() == 0:
        return None
    x2, caps, choice = _planned(x, a)
    if choice.path.name != "gemv_cols" or TABLE.pick(b, caps, x2.shape[0], None).path.name != "gemv_cols":
        return None
    config = gemv_cols.pair_config(a, b)
    if gemv_cols.pair_applies(a, b, config) is not None or \
            (rope is not None and not gemv_cols.rope_applies(a, rope, config, b)):
        return None
    y = gemv_cols.matmul(x2, a, bias, config, caps=caps, rope=rope, second=b)
    return y.reshape(*x.shape[:-1], a.n + b.n)
