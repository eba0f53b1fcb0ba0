"""The wgmma path of the ggml kernels for Q4_K, Q5_K and Q6_K, in Gluon (sm90): the affine wgmma kernel's pipeline
(affine/wgmma.py) over the column-major planes, each of a K step's eight code slices decoded into its own asynchronous
wgmma.

The MMA kernel (mma.py) decodes a whole K step of 128 values into one tl.dot operand and waits for its dot before
the next; here slice i of the step goes to its wgmma while slice i + 1 decodes, as the affine kernel does, and the
code words, scale words and x arrive by cp.async into a ring of shared-memory stages. The decode is the MMA
kernel's (its slice maps, PTX and scales), so the wgmma's K order is not the file's: x is copied into its stage
in the MMA's order (mma._in_mma_order's map), gathered 4 bytes a copy for a few rows, or put in that order before
the kernel (mma_order) from ORDERED_MIN_M rows.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import H2_PAIR_F16
from quanta.kernels.affine.wgmma import GLUON_ERROR, WgmmaConfig, aligned_rows, grid_of
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.ggml import mma
from quanta.kernels.ggml.layout import GgmlState, word_planes
from quanta.kernels.ggml.mma import Q5K_HIGH, Q5K_LOW, Q6K_HIGH, Q6K_LOW, Q6K_SCALE_HIGH, Q6K_SCALE_LOW, SCALE_PAIR
from quanta.kernels.triton_support import gdc_wait, pdl_launch, zero_

TYPES = {"q4_K": 4, "q5_K": 5, "q6_K": 6}     # name -> the kernel's KIND (mma.TYPES, the decoders it shares)
STEP = 128                  # values of a row a K step: half a super-block, 16 code words
ONE_WARPGROUP_MAX_M = 32    # above, two warpgroups share each stage of x (default_config)
# From here x is put in the MMA's column order by a gather of its own before the kernel, which then copies it 16
# bytes a copy: gathered in the kernel, a copy and its address every 4 bytes (32 a thread a K step at 128 rows of x)
# hold the loop back; for a few rows the gather's launch costs more than they do.
ORDERED_MIN_M = ONE_WARPGROUP_MAX_M + 1
LARGE_M_MIN_STEPS = 2

if GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, warpgroup_mma

    from quanta.kernels.affine.wgmma import finish, program_work, retire

    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    STEP_COLS = gl.constexpr(STEP)

    @gluon.jit
    def _half(v, lane: gl.constexpr):
        """Half `lane` (0 low, 1 high) of int32 words as fp16."""
        return ((v >> (16 * lane)) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)

    @gluon.jit
    def _slice_scales(first, second, dm, HIGH: gl.constexpr, cols):
        """(scale, zbias) [rows, 16] in fp16 of the step's slices of nibble HIGH, in operand A's layout: word
        columns 0-7 lie in the step's first chunk (sub-block 2 chunk + HIGH, scale word `first`), 8-15 in the
        next (`second`); first, second, dm [rows] the scale words and the block's (d, dmin) words."""
        SEL: gl.constexpr = 0x5352 if HIGH else 0x5150          # bytes 2, 3 or 0, 1 of the word; c's 0x64
        neg = dm ^ -2147483648                                   # (d, -dmin)
        sel = gl.full(first.shape, SEL, gl.int32, first.type.layout)
        a = gl.inline_asm_elementwise(SCALE_PAIR, "=r,r,r,r", [first, neg, sel], dtype=gl.int32, is_pure=True,
                                      pack=1)
        b = gl.inline_asm_elementwise(SCALE_PAIR, "=r,r,r,r", [second, neg, sel], dtype=gl.int32, is_pure=True,
                                      pack=1)
        pair = gl.where(gl.expand_dims(cols >= 8, 0), gl.expand_dims(b, 1), gl.expand_dims(a, 1))
        return _half(pair, 0), _half(pair, 1)

    @gluon.jit
    def _decode_slice(words, qh, t: gl.constexpr, HIGH: gl.constexpr, s, zb, bit, KIND: gl.constexpr):
        """Weights [rows, 16] fp16 of slice 4 HIGH + t from the step's code words [rows, 16] (operand A's layout):
        column 2q' + e is nibble HIGH of byte 2 (t % 2) + e of word 2q' + t // 2 (mma._q4k_slice's and
        _q6k_slice's maps and PTX). Q5_K: its fifth bits from the qh words at bit `bit`; Q6_K: its top two bits
        from the qh words' field `bit`, s the scales (zb unused)."""
        BYTE: gl.constexpr = 4 * (t // 2) + 2 * (t % 2)
        SEL: gl.constexpr = BYTE | (BYTE << 4) | ((BYTE + 1) << 8) | ((BYTE + 1) << 12)
        shape: gl.constexpr = words.shape
        layout: gl.constexpr = words.type.layout
        sel = gl.full(shape, SEL, gl.int32, layout)
        if KIND == 6:
            return gl.inline_asm_elementwise(Q6K_HIGH if HIGH else Q6K_LOW, "=r,r,r,r,r,r,r,r,r,r",
                                             [words, qh, sel, bit, s], dtype=gl.float16, is_pure=True, pack=2)
        factor = gl.full(shape, 0.0625 if HIGH else 1.0, gl.float32, layout).to(gl.float16)
        addend = gl.full(shape, -64.0 if HIGH else -1024.0, gl.float32, layout).to(gl.float16)
        if KIND == 5:
            return gl.inline_asm_elementwise(Q5K_HIGH if HIGH else Q5K_LOW, "=r" + ",r" * 12,
                                             [words, qh, sel, bit, factor, addend, s, zb], dtype=gl.float16,
                                             is_pure=True, pack=2)
        mask = gl.full(shape, 0x00F000F0 if HIGH else 0x000F000F, gl.int32, layout)
        return gl.inline_asm_elementwise(H2_PAIR_F16, "=r,r,r,r,r,r,r,r,r,r,r",
                                         [words, sel, mask, factor, addend, s, zb], dtype=gl.float16, is_pure=True,
                                         pack=2)

    @gluon.jit
    def _q6k_scales(first, second, d, HIGH: gl.constexpr, cols):
        """Q6_K's scales [rows, 16] in fp16 of the step's slices of nibble HIGH (mma._q6k_scales): pair q' = c // 2
        of column c takes int8 scale (q' % 4) // 2 + 2 (q' // 4) of the step's first four (word `first`) or, for
        the high nibbles, its last four (`second`); d [rows] the block's d bits."""
        c = gl.expand_dims(cols, 0)
        sc = gl.where(c % 2 == 0, gl.expand_dims(first, 1), gl.expand_dims(second, 1))
        shift = (8 * (((c // 2) % 4) // 2 + 2 * (c // 8))).broadcast_to(sc.shape)
        dd = gl.expand_dims(d, 1).broadcast_to(sc.shape)
        return gl.inline_asm_elementwise(Q6K_SCALE_HIGH if HIGH else Q6K_SCALE_LOW, "=r,r,r,r,r,r,r",
                                         [sc, shift, dd], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _issue_weights(p0, p1, p2, p3, w_ring, h_ring, dm_ring, f_ring, s_ring, ring, step, n0, N, pred,
                       KIND: gl.constexpr, BLOCK_N: gl.constexpr):
        """cp.async K step `step`'s planes into stage `ring` (nothing when not pred): its 16 code word rows [16,
        BLOCK_N]; Q5_K's and Q6_K's 8 qh word rows of the step, twice over (operand A's columns c and c + 8 read
        row c % 8); Q4_K's and Q5_K's block (d, dmin) words; the step's two scale words. A type without qh words
        (Q4_K) or (d, dmin) words (Q6_K) has one unused stage of that ring."""
        w_buf = w_ring.index(ring)
        h_buf = h_ring.index(ring if KIND != 4 else 0)
        dm_buf = dm_ring.index(ring if KIND != 6 else 0)
        f_buf = f_ring.index(ring)
        s_buf = s_ring.index(ring)
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, WL))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, WL))
        blk = step // 2
        mask = (n < N)[None, :] & pred
        if KIND == 6:           # ql, qh (16 words a block: 8 a step)
            async_copy.async_copy_global_to_shared(w_buf, p0 + (step * 16 + r)[:, None] * N + n[None, :], mask=mask)
            async_copy.async_copy_global_to_shared(h_buf, p1 + (step * 8 + r % 8)[:, None] * N + n[None, :],
                                                   mask=mask)
        elif KIND == 5:         # code words, qh (8 words a block, both steps')
            async_copy.async_copy_global_to_shared(w_buf, p3 + (step * 16 + r)[:, None] * N + n[None, :], mask=mask)
            async_copy.async_copy_global_to_shared(h_buf, p2 + (blk * 8 + r % 8)[:, None] * N + n[None, :],
                                                   mask=mask)
        else:
            async_copy.async_copy_global_to_shared(w_buf, p2 + (step * 16 + r)[:, None] * N + n[None, :], mask=mask)
        SL: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        ns = n0 + gl.arange(0, BLOCK_N, layout=SL)
        if KIND == 6:
            at = p2 + (blk * 4 + 2 * (step % 2)) * N + ns
        else:
            at = p1 + (blk * 4 + 2 * (step % 2)) * N + ns
            async_copy.async_copy_global_to_shared(dm_buf, p0 + blk * N + ns, mask=(ns < N) & pred)
        async_copy.async_copy_global_to_shared(f_buf, at, mask=(ns < N) & pred)
        async_copy.async_copy_global_to_shared(s_buf, at + N, mask=(ns < N) & pred)

    @gluon.jit
    def _issue_x(x_ptr, x_buf, step, m0, M, stride_xm, pred, KIND: gl.constexpr, BLOCK_M: gl.constexpr,
                 ORDERED: gl.constexpr):
        """cp.async K step `step` of x [BLOCK_M rows, 128] into one stage in the MMA's column order (column
        64 HIGH + 16 t + 2 q' + e holds value 64 (q' // 4) + 32 HIGH + 8 (q' % 4) + 2 t + e; Q6_K's, value
        64 HIGH + 32 (q' // 4) + 8 (q' % 4) + 2 t + e), zeros past M; then commit the stage's group. ORDERED: x
        arrives in that order (mma_order), 16 bytes a copy; else it is gathered here, pairs of adjacent values,
        4 bytes a copy."""
        if ORDERED:
            XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
        else:
            XL: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [gl.num_warps(), 1], [1, 0])
        m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        j = gl.arange(0, STEP_COLS, layout=gl.SliceLayout(0, XL))
        if ORDERED:
            k = step * STEP_COLS + j
        else:
            halves = 32 * (j // 64) + 64 * ((j // 8) % 2) if KIND != 6 else 64 * (j // 64) + 32 * ((j // 8) % 2)
            k = step * STEP_COLS + halves + 8 * ((j // 2) % 4) + 2 * ((j // 16) % 4) + j % 2
        async_copy.async_copy_global_to_shared(x_buf, x_ptr + m[:, None] * stride_xm + k[None, :],
                                               mask=(m < M)[:, None] & pred)
        async_copy.commit_group()

    @gluon.jit
    def _ggml_wgmma_kernel(x_ptr, p0, p1, p2, p3, bias_ptr, y_ptr, M, N, steps_per_split, num_steps, stride_xm,
                           stride_ym, KIND: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr, ATOMIC: gl.constexpr,
                           PDL: gl.constexpr, ORDERED: gl.constexpr = False):
        """y[M, N] (+)= (W[BLOCK_N rows, K steps of split j] @ x[BLOCK_M rows]ᵀ)ᵀ (+ bias with split 0), program
        (output tile, split j), over the column-major planes of mma._ggml_mma_kernel (its docstring lists them by
        type; KIND 4, 5, 6 = Q4_K, Q5_K, Q6_K). affine/wgmma._affine_wgmma_kernel's pipeline and waits (its docstring
        says why): a warpgroup refills the stage its wgmmas just left, STAGES - 1 steps ahead; two share each stage
        of x and refill the stage of two steps ago after the CTA barrier."""
        WARPS: gl.constexpr = gl.num_warps()
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, A)
        m0, n0, s_begin, n_steps = program_work(M, steps_per_split, num_steps, BLOCK_M, BLOCK_N)
        AHEAD: gl.constexpr = STAGES - 1 if WARPS == 4 else STAGES - 2
        REFILL_AFTER: gl.constexpr = LAG - 1 if WARPS == 4 else 0

        WORDS: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], WORDS)
        h_ring = gl.allocate_shared_memory(gl.int32, [STAGES if KIND != 4 else 1, 16, BLOCK_N], WORDS)
        ROW: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        dm_ring = gl.allocate_shared_memory(gl.int32, [STAGES if KIND != 6 else 1, BLOCK_N], ROW)
        f_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], ROW)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], ROW)
        x_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, STEP_COLS],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        for p in gl.static_range(AHEAD):
            _issue_weights(p0, p1, p2, p3, w_ring, h_ring, dm_ring, f_ring, s_ring, p, s_begin + p, n0, N, p < n_steps,
                           KIND, BLOCK_N)
        if PDL:
            gdc_wait()
        for p in gl.static_range(AHEAD):
            _issue_x(x_ptr, x_ring.index(p), s_begin + p, m0, M, stride_xm, p < n_steps, KIND, BLOCK_M, ORDERED)

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        o1 = gl.zeros([BLOCK_N, 16], gl.float16, A)
        o2 = o1
        o3 = o1
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, A))
        rows = n0 + gl.arange(0, BLOCK_N, layout=ROWS)
        # Q5_K: the qh bit of a low nibble's fifth bit in the step's first chunk (2 chunk; columns 8-15 lie in the
        # next); Q6_K: the qh field of a low nibble's top bits (2 (q' // 4))
        field = (2 * (gl.expand_dims(cols, 0) // 8)).broadcast_to([BLOCK_N, 16])
        for i in range(n_steps):
            st = i % STAGES
            step = s_begin + i
            if KIND == 6:       # the block's fp16 d, from global memory (a row of it is 2 bytes a column)
                d = gl.load(p3 + ((step // 2) * N + rows) // 2, mask=rows < N, other=0)
                d = d >> (16 * (((step // 2) * N + rows) % 2))
            async_copy.wait_group(AHEAD - 1)
            _cta_barrier()
            fence_async_shared()
            words = w_ring.index(st).permute((1, 0)).load(A)
            if KIND != 4:
                qh = h_ring.index(st).permute((1, 0)).load(A)
            else:
                qh = words
            first = f_ring.index(st).load(ROWS)
            second = s_ring.index(st).load(ROWS)
            if KIND != 6:
                dm = dm_ring.index(st).load(ROWS)
            xs = x_ring.index(st)
            for c in gl.static_range(8):
                if c % 4 == 0:          # the slices of nibble c // 4: their scales and bits
                    if KIND == 6:
                        sc = _q6k_scales(first, second, d, c // 4, cols)
                        zb = sc
                        bit = field + 4 * (c // 4)
                    else:
                        sc, zb = _slice_scales(first, second, dm, c // 4, cols)
                        bit = field + 4 * (step % 2) + c // 4
                w = _decode_slice(words, qh, c % 4, c // 4, sc, zb, bit, KIND)
                acc = warpgroup_mma(w, xs.slice(c * 16, 16, dim=1).permute((1, 0)), acc, is_async=True)
                acc, o1, o2, o3 = retire(acc, w, o1, o2, o3, LAG)
                if c == REFILL_AFTER:
                    j = i + AHEAD
                    ring = j % STAGES
                    _issue_weights(p0, p1, p2, p3, w_ring, h_ring, dm_ring, f_ring, s_ring, ring, s_begin + j, n0,
                                   N, j < n_steps, KIND, BLOCK_N)
                    _issue_x(x_ptr, x_ring.index(ring), s_begin + j, m0, M, stride_xm, j < n_steps, KIND, BLOCK_M,
                             ORDERED)
        finish(acc, o1, o2, o3, bias_ptr, y_ptr, n0, m0, N, M, stride_ym, s_begin == 0, n_steps > 0, PDL, HAS_BIAS,
               ATOMIC, BLOCK_N, BLOCK_M)


def applies(st: GgmlState, caps: DeviceCaps) -> str | None:
    """None if the kernel runs this weight on a device of these caps, else why not."""
    return GLUON_ERROR or mma.refusal(st, caps, "wgmma")


class TypeTiles(NamedTuple):
    """A type's tile choices: weight rows a program and waves of programs the K split aims at up to M = 16 (one
    warpgroup), rows of x a program and stages from M = 65 (two warpgroups)."""
    m16_rows: int
    m16_waves: float
    large_block_m: int
    large_stages: int


# Q4_K: 256 weight rows up to M = 16 (half the programs, each decoding twice the rows for the same x), 128 rows of x
# in 4 stages from M = 65; Q6_K: 128 rows of x in the 3 stages its qh stage leaves room for, and three waves at M = 16
# (its longer decode a step hides the split's atomics better over more programs); Q5_K: its decode leaves 128 rows
# of x too few registers.
TILES = {"q4_K": TypeTiles(256, 2.0, 128, 4), "q5_K": TypeTiles(128, 2.0, 64, 4),
         "q6_K": TypeTiles(128, 3.0, 128, 3)}


def default_config(st: GgmlState, caps: DeviceCaps, m: int) -> WgmmaConfig:
    """The config of M rows: up to M = 32 one warpgroup, 16 or 32 rows of x, 128 weight rows a program, the K loop
    split for two waves of programs (up to M = 16 the type's TILES rows and waves). Above, two warpgroups share each stage's
    rows of x over 256 weight rows a program, split for whole waves of one program an SM: 64 rows of x in 4 stages,
    from M = 65 the type's."""
    tiles = TILES[st.name]
    if m <= ONE_WARPGROUP_MAX_M:
        if m <= 16:
            return WgmmaConfig(16, 3, tiles.m16_waves, 2, tiles.m16_rows, 2, 4)
        return WgmmaConfig(32, 3, 2.0, 2, 128, 2, 4)
    if m <= 64:
        return WgmmaConfig(64, 4, None, LARGE_M_MIN_STEPS, 256, 2, 8)
    lag = 3 if tiles.large_block_m == 128 else 2
    return WgmmaConfig(tiles.large_block_m, tiles.large_stages, None, LARGE_M_MIN_STEPS, 256, lag, 8)


@functools.lru_cache(maxsize=None)
def mma_order(k: int, kind: int, device: torch.device) -> torch.Tensor:
    """int64 [k]: x[:, mma_order(...)] is x in the MMA's column order of each K step (mma._in_mma_order's
    permutation of a step's 128 columns; Q6_K's, kind 6, its own), as the kernel reads it with ORDERED."""
    dims = (0, 1, 4, 2, 3, 5) if kind == 6 else (0, 2, 4, 1, 3, 5)
    steps = torch.arange(k, device=device).view(k // STEP, 2, 2, 4, 4, 2)
    return steps.permute(dims).reshape(k)


def grid(st: GgmlState, sms: int, config: WgmmaConfig, m: int) -> tuple[int, int, int]:
    """(output tiles, K splits, K steps a split) of a launch of `config` for M rows (affine/wgmma.grid_of's rule)."""
    return grid_of(st.n, st.k // STEP, sms, config, m)


def matmul(x2: torch.Tensor, st: GgmlState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, ordered: bool | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias); `config` (WgmmaConfig's fields) and `ordered` (x put in the MMA's order
    before the kernel; default from ORDERED_MIN_M rows) forced by tests and benchmarks. Split-K partial sums are
    added into a zeroed fp16 output."""
    assert st.name in TYPES and x2.dim() == 2 and x2.shape[1] == st.k and x2.stride(1) == 1
    m = x2.shape[0]
    caps = caps or device_caps(x2.device)
    config = WgmmaConfig(*config) if config else default_config(st, caps, m)
    bm, stages, _, _, bn, lag, warps = config
    assert bm in (16, 32, 64, 128) and 1 <= lag <= 3 and bn % (16 * warps) == 0 and warps in (4, 8) \
        and stages >= (2 if warps == 4 else 3), config
    ordered = m >= ORDERED_MIN_M if ordered is None else ordered
    if ordered:
        x2 = x2.index_select(1, mma_order(st.k, TYPES[st.name], x2.device))
    x2, _ = aligned_rows(x2, st.k)
    tiles, splits, per = grid(st, caps.sm_count, config, m)
    # split-K partial sums are added in fp16, as the affine kernels' are: a float32 sum would take a cast, one launch
    # more, and zero_ keeps the zeroing in the PDL chain
    y = torch.empty(m, st.n, device=x2.device, dtype=torch.float16)
    if splits > 1:
        zero_(y)
    planes = word_planes(st)
    _ggml_wgmma_kernel[(tiles, splits)](
        x2, *planes, bias if bias is not None else x2, y, m, st.n, per, st.k // STEP, x2.stride(0), y.stride(0),
        KIND=TYPES[st.name], HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, LAG=lag,
        ATOMIC=splits > 1, ORDERED=ordered, num_warps=warps, **pdl_launch(caps))
    return y
