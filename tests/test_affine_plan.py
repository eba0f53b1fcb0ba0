"""The affine plan (quanta.kernels.affine.plan) with fake DeviceCaps: which path runs M rows on each chip.

No monkeypatching: a chip is a DeviceCaps value (the presets, or one with another SM count), and a weight at a
real shape is a small prepared state with its geometry replaced (the plan reads the geometry, not the codes).
tests/fixtures/affine_plan_paths.json holds the path of every M = 1..2100 that the plan made before the kernels
became a package (affine_gemm.plan() over fake sm90/sm89/sm80/sm75 devices), for 10 shapes x 10 weight kinds x
fp16/bf16: the plan must reproduce it exactly.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from kernel_util import DEVICE  # noqa: I001  (sets TRITON_INTERPRET)
from quanta.kernels import affine, codebook_gemm, fp8_gemm
from quanta.kernels.affine import gemv, plan, wgmma
from quanta.kernels.device_caps import PRESETS, DeviceCaps
from quanta.quant.errors import UnsupportedError
from test_affine_gemm import make_affine
from test_codebook_gemm import make_codebook
from test_fp8_gemm import make_fp8

RECORD = json.loads((Path(__file__).parent / "fixtures" / "affine_plan_paths.json").read_text())
SM90_NO_GLUON = dataclasses.replace(PRESETS["sm90"], name="sm90-no-gluon", gluon=False)


def small_state(kind: str, dtype: torch.dtype):
    """A prepared 64 x 256 weight of one of the recorded kinds."""
    if kind == "nf4b64":
        return codebook_gemm.prepare(make_codebook(64, 256, 64, "nf4", True, device="cpu"), "cpu", dtype)
    if kind.startswith("fp8"):
        w = make_fp8(64, 256, "e4m3" if "e4m3" in kind else "e5m2", "channel" if "chan" in kind else "block",
                     device="cpu")
        return fp8_gemm.prepare(w, "cpu", dtype)                      # weight-only on the CPU
    bits = 8 if kind.startswith("w8") else 4
    group = -1 if "chan" in kind else (32 if "g32" in kind else 128)
    zero = "sym" if "sym" in kind or "act" in kind or "chan" in kind else ("fmin" if "fmin" in kind else "asym")
    return affine.prepare(make_affine(64, 256, bits, group, zero, act_order="act" in kind, device="cpu"), "cpu", dtype)


def at_shape(st, n: int, k: int):
    """The state as the plan sees an [n, k] weight of the same kind."""
    k_pad = -(-k // st.tile_k) * st.tile_k
    group = k_pad if st.group_size >= st.k_pad else st.group_size
    perm = None if st.perm is None else torch.arange(k, dtype=torch.int32)
    return dataclasses.replace(st, n=n, k=k, k_pad=k_pad, group_size=group, perm=perm)


def recorded(key: str):
    caps, kind, dtype, shape = key.split("|")
    n, k = map(int, shape.split("x"))
    return PRESETS[caps], at_shape(small_state(kind, getattr(torch, dtype)), n, k)


def paths(st, caps, ms) -> list[str]:
    return [plan.choose(st, caps, m).path.name for m in ms]


def recorded_path(key: str, m: int) -> str:
    """The path RECORD holds for M rows of key's weight."""
    return next(name for lo, hi, name in RECORD[key] if lo <= m <= hi)


def expected_path(key: str, m: int) -> str:
    """The recorded path, but for the decisions changed since: on sm90 an act-order weight takes, from
    WGMMA_GATHER_MIN_M, the path of the same weight without act-order (its input gathered for the wgmma kernel);
    fp16 groups of 32 and fp16 8-bit codes take the wgmma kernel's M up to WGMMA_NARROW_MAX_M (8-bit codes on weights
    wider than deep up to WGMMA_EIGHT_BIT_WIDE_MAX_M), which the MMA kernel had (M = 2..16 always, 17..32 where the
    programs get WGMMA_MIN_TILES_EACH K tiles, as for groups of 128)."""
    if key.startswith("sm90|w4g128act|") and m >= plan.WGMMA_GATHER_MIN_M:
        return recorded_path(key.replace("w4g128act", "w4g128sym"), m)
    path = recorded_path(key, m)
    if key.startswith(("sm90|w4g32", "sm90|w8")) and "|float16|" in key and path == "mma" and m <= plan.WGMMA_NARROW_MAX_M:
        caps, st = recorded(key)
        if st.bits == 8 and st.n > st.k and m > plan.WGMMA_EIGHT_BIT_WIDE_MAX_M:
            return path
        if m <= plan.WGMMA_ALWAYS_MAX_M or m > wgmma.ONE_WARPGROUP_MAX_M \
                or wgmma.k_tiles_each(st, caps.sm_count) >= plan.WGMMA_MIN_TILES_EACH:
            return "wgmma"
    return path


@pytest.mark.parametrize("chip", ["sm90", "sm89", "sm80", "sm75"])
def test_every_m_maps_to_the_path_it_mapped_to_before(chip):
    """Each recorded M range, every M of it, on the chip's caps: the refactor changed no decision but
    expected_path's."""
    keys = [key for key in RECORD if key.startswith(chip + "|")]
    assert len(keys) == (100 if chip == "sm75" else 200)
    for key in keys:
        caps, st = recorded(key)
        lo, hi = RECORD[key][0][0], RECORD[key][-1][1]
        got = paths(st, caps, range(lo, hi + 1))
        want = [expected_path(key, m) for m in range(lo, hi + 1)]
        bad = [(m, g, w) for m, g, w in zip(range(lo, hi + 1), got, want) if g != w]
        assert not bad, (key, bad[:3], len(bad))


@pytest.mark.parametrize("key", ["sm90|w4g128sym|bfloat16|4096x4096", "sm90|w4g128asym|float16|28672x4096",
                                 "sm90|nf4b64|bfloat16|8192x28672", "sm90|w8chan|float16|6144x4096",
                                 "sm90|w4g128sym|bfloat16|10240x8192", "sm80|w4g32fmin|float16|4096x14336",
                                 "sm89|fp8e5m2b128|bfloat16|57344x8192", "sm75|w4chan|float16|72x256"])
def test_a_bucket_shares_its_edges_plan(key):
    """choose() computes the plan once per M bucket: for every M, path and config equal decide()'s for that very M
    (the buckets end where a threshold or a config's block of rows changes)."""
    caps, st = recorded(key)
    for m in range(0, 1100):
        assert plan.choose(st, caps, m) == plan.decide(st, caps, m), (key, m)
    assert len(st.plans) == len(plan.BUCKET_EDGES) + 1                     # and the one above the last edge


def test_sm90_gemv_at_m1_wgmma_above_and_cublas_past_1024():
    """W4A16 g128 fp16 on an H100 (8B gate_up): the GEMV at M = 1, the wgmma kernel from 2 to 1024, then
    dequantize + cuBLAS; bf16 at M = 1 goes to the wgmma kernel too (its GEMV decodes in fp32)."""
    caps = PRESETS["sm90"]
    st = at_shape(small_state("w4g128sym", torch.float16), 28672, 4096)
    assert paths(st, caps, (1, 2, 16, 17, 32, 33, 256, 1024, 1025)) == ["gemv"] + ["wgmma"] * 7 + ["cublas"]
    bf16 = at_shape(small_state("w4g128sym", torch.bfloat16), 28672, 4096)
    assert paths(bf16, caps, (1, 2)) == ["wgmma", "wgmma"]
    small_bf16 = at_shape(small_state("w4g128sym", torch.bfloat16), 4096, 4096)        # 8B o: too little work
    assert paths(small_bf16, caps, (1, 16, 17, 1024)) == ["gemv", "wgmma", "mma", "wgmma"]
    assert paths(small_bf16, caps, (513, 640)) == ["cublas", "cublas"]     # bf16 with the K loop split


def test_sm90_groups_of_32_take_the_wgmma_kernel_in_fp16_up_to_m256():
    """Groups of 32 (GGUF Q4_0, GPTQ g32) on an H100, 8B gate_up: the GEMV at M = 1, the wgmma kernel from 2 to
    WGMMA_NARROW_MAX_M in fp16, then the MMA kernel up to 512 and cuBLAS; bf16 keeps the MMA kernel."""
    caps = PRESETS["sm90"]
    f16 = at_shape(small_state("w4g32fmin", torch.float16), 28672, 4096)
    assert paths(f16, caps, (1, 2, 16, 33, 256, 257, 512, 513)) == ["gemv"] + ["wgmma"] * 4 + ["mma"] * 2 + ["cublas"]
    bf16 = at_shape(small_state("w4g32fmin", torch.bfloat16), 28672, 4096)
    assert set(paths(bf16, caps, (2, 16, 256))) == {"mma"}


@pytest.mark.parametrize("chip", ["sm75", "sm80", "sm89"])
def test_older_chips_plan_only_what_they_run(chip):
    """No wgmma (Gluon) and no MMA kernel (sm90's register operand) off sm90; no PDL in any launch config; on sm75
    no bf16 at all: the plan refuses it, as the registry does."""
    caps = PRESETS[chip]
    assert not caps.gluon and not caps.pdl
    for kind in ("w4g128sym", "w4g32fmin", "w8chan", "nf4b64", "fp8e4m3chan"):
        for dtype in (torch.float16, torch.bfloat16):
            st = at_shape(small_state(kind, dtype), 28672, 4096)
            if chip == "sm75" and dtype == torch.bfloat16:
                with pytest.raises(UnsupportedError, match="sm75"):
                    plan.choose(st, caps, 1)
                continue
            assert set(paths(st, caps, range(1, 1100))) <= {"gemv", "splitk", "cublas"}, (kind, dtype)
            no_pdl = gemv.GEMV_CONFIGS_TABLE + gemv.GEMV_CONFIGS           # the tables without PDL (table codes', all)
            assert gemv.default_config(st, caps) in [c for _, c in no_pdl]


def test_on_sm90_without_gluon_the_mma_kernel_takes_wgmmas_share():
    """The MMA kernel where it runs (sm90): M = 2 from the GEMV where it decodes in PTX (fp16 affine codes, bf16
    4-bit ones, table codes in either dtype), and M = 1 too for bf16 table codes (the GEMV would gather them per
    code), up to M = 512."""
    caps = SM90_NO_GLUON
    f16, bf16 = small_state("w4g128sym", torch.float16), small_state("w4g128sym", torch.bfloat16)
    assert paths(f16, caps, (1, 2, 512, 513)) == ["gemv", "mma", "mma", "cublas"]
    assert paths(bf16, caps, (1, 2, 3)) == ["gemv", "mma", "mma"]
    bf16_w8 = small_state("w8chan", torch.bfloat16)
    assert paths(bf16_w8, caps, (1, 2, 3)) == ["gemv", "gemv", "mma"]                 # decoded per element
    nf4 = {dt: small_state("nf4b64", dt) for dt in (torch.float16, torch.bfloat16)}
    assert paths(nf4[torch.float16], caps, (1, 2, 512, 513)) == ["gemv", "mma", "mma", "cublas"]
    assert paths(nf4[torch.bfloat16], caps, (1, 513)) == ["mma", "cublas"]           # no bf16 lookup GEMV
    fp8 = small_state("fp8e4m3chan", torch.float16)
    assert paths(fp8, caps, (1, 2, 3, 255, 256)) == ["gemv", "gemv", "splitk", "splitk", "cublas"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_wgmma_m_range_follows_the_work_a_program_gets(dtype):
    """With 4 SMs a 1024 x 1024 weight (4 blocks x 8 K tiles) gives its programs work enough: M = 2..1024 (bf16
    M = 1 too) go to the wgmma kernel; with 132 SMs M = 17..32 go to the MMA kernel, and bf16 above M = 32 too
    (its K loop would be split); act-order weights from WGMMA_GATHER_MIN_M, where the plain weight does."""
    st = small_state("w4g128sym", dtype)
    st = at_shape(st, 1024, 1024)
    few = dataclasses.replace(PRESETS["sm90"], sm_count=4)
    m1 = "gemv" if dtype == torch.float16 else "wgmma"
    assert paths(st, few, (1, 2, 32, 33, 1024, 1025)) == [m1] + ["wgmma"] * 4 + ["cublas"]
    m33 = "wgmma" if dtype == torch.float16 else "mma"
    assert paths(st, PRESETS["sm90"], (1, 2, 16, 17, 32, 33)) == ["gemv", "wgmma", "wgmma", "mma", "mma", m33]
    act_order = at_shape(small_state("w4g128act", dtype), 1024, 1024)
    ms = range(1, 1100)
    below = {1: "gemv"}                       # under the gather's threshold: the GEMV, then the MMA kernel
    want = [p if m >= plan.WGMMA_GATHER_MIN_M else below.get(m, "mma") for m, p in zip(ms, paths(st, few, ms))]
    assert paths(act_order, few, ms) == want


def test_wgmma_bf16_above_m32_only_with_its_k_loop_whole():
    """bf16 above M = 32: the wgmma kernel only where its K loop is not split (float32 partial sums); fp16 always."""
    caps = PRESETS["sm90"]

    def runs(m, n, k, dtype):
        return plan.choose(at_shape(small_state("w4g128sym", dtype), n, k), caps, m).path.name == "wgmma"

    assert runs(1024, 28672, 4096, torch.bfloat16) and runs(1024, 57344, 8192, torch.bfloat16)    # 896, 1792 blocks
    assert not runs(1024, 10240, 8192, torch.bfloat16) and runs(1024, 10240, 8192, torch.float16)  # 320: K split
    assert not runs(1025, 28672, 4096, torch.float16)


def test_configs_are_named_and_follow_the_caps():
    """Each path's config is a NamedTuple computed from the caps: PDL launch tables only where the caps have PDL,
    and the split-K tiles cut to the shared memory of sm86/sm89."""
    st = at_shape(small_state("w4g128sym", torch.float16), 28672, 4096)
    on90 = plan.choose(st, PRESETS["sm90"], 1).config
    assert isinstance(on90, gemv.GemvConfig) and on90 in dict(gemv.GEMV_CONFIGS_PDL).values()
    assert plan.choose(st, PRESETS["sm80"], 1).config in dict(gemv.GEMV_CONFIGS).values()
    assert plan.choose(st, PRESETS["sm90"], 16).config.rows == 256                      # wgmma.WgmmaConfig
    assert plan.choose(st, PRESETS["sm80"], 200).config == (128, 256, 8, 3, 1.0)
    assert plan.choose(st, PRESETS["sm89"], 200).config == (64, 128, 4, 2, 1.0)
    assert plan.choose(st, PRESETS["sm90"], 4096).config == (128, 4)                    # the dequantize launch


def test_explain_names_the_path_and_why_the_earlier_ones_did_not_run():
    st = at_shape(small_state("w4g128sym", torch.float16), 4096, 4096)
    name, reason = plan.explain(st, PRESETS["sm90"], 1)
    assert name == "gemv" and reason.startswith("M=1 <= 1: bandwidth-bound GEMV") and "not wgmma: M=1" in reason
    name, reason = plan.explain(st, PRESETS["sm75"], 300)
    assert name == "cublas" and "not mma: runs on sm90, not sm75" in reason and "not wgmma: no Gluon" in reason
    assert st.plans and all(isinstance(c, plan.Choice) for c in st.plans.values())    # the cache holds no strings


def test_glu_plans_once_and_module_paths_name_the_kernel():
    """apply_glu plans one bucket (the GEMV's epilogue or the planned path, no second plan); every module's
    path(state, m) names NAME/path on the state's own device."""
    st = affine.prepare(make_affine(64, 256, 4, 128, "sym"), DEVICE, torch.float16)
    affine.apply_glu(torch.randn(1, 256).to(DEVICE, torch.float16), st)
    assert len(st.plans) == 1
    assert affine.path(st, 1)[0] == "triton_affine/" + next(iter(st.plans.values())).path.name
    nf4 = codebook_gemm.prepare(make_codebook(64, 256), DEVICE, torch.float16)
    assert codebook_gemm.path(nf4, 300)[0] == "triton_codebook/cublas"


def test_wgmma_never_without_gluon_whatever_the_chip():
    st = small_state("w4g128sym", torch.float16)
    for caps in (PRESETS["cpu"], SM90_NO_GLUON, DeviceCaps("odd", (9, 0), 132, gluon=False, pdl=True)):
        assert plan._wgmma_fits(st, caps, 2) is not None
    assert wgmma.weight_fits(st)


def test_sm90_eight_bit_codes_on_wide_weights_leave_the_wgmma_kernel_above_its_one_warpgroup_rows():
    """fp16 8-bit codes (GGUF Q8_0, RTN w8) on an H100: a weight wider than deep (8B gate_up) takes the wgmma kernel
    up to WGMMA_EIGHT_BIT_WIDE_MAX_M, then the MMA kernel; a deep one (8B down) keeps it up to WGMMA_NARROW_MAX_M."""
    caps, top = PRESETS["sm90"], plan.WGMMA_EIGHT_BIT_WIDE_MAX_M
    assert top < plan.WGMMA_NARROW_MAX_M
    wide = at_shape(small_state("w8chan", torch.float16), 28672, 4096)
    assert paths(wide, caps, (2, top, top + 1, plan.WGMMA_NARROW_MAX_M)) == ["wgmma", "wgmma", "mma", "mma"]
    deep = at_shape(small_state("w8chan", torch.float16), 4096, 14336)
    assert paths(deep, caps, (2, top + 1, plan.WGMMA_NARROW_MAX_M, plan.WGMMA_NARROW_MAX_M + 1)) == \
        ["wgmma", "wgmma", "wgmma", "mma"]
