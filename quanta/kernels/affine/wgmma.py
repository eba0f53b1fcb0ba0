"""The wgmma path of the affine kernels, in Gluon (sm90): one asynchronous wgmma per code, decoded into its
register operand.

For 4-bit affine codes (AWQ, GPTQ, RTN, GGUF Q4_0 / Q4_1; fp16 or bf16) and fp16 8-bit ones (GGUF Q8_0, RTN w8) it
computes, like the MMA kernel (mma.py), yᵀ = W · xᵀ with the decoded weight as wgmma's register operand A, but with
a wgmma per code where the MMA kernel has one tl.dot per K tile (_affine_wgmma_kernel says why and how). No weight
layout of its own: it reads layout.py's packed words. An act-order weight's input is gathered into its sorted column
order first (one gather of M x K values), not per tile. Which M it takes is the plan's (plan.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from quanta.kernels.affine.layout import (
    AFFINE,
    H2_PAIR_BF16,
    H2_PAIR_BF16_HIGH,
    H2_PAIR_F16,
    AffineState,
    R,
    split_k_output,
)
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.triton_support import (
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    pdl_launch,
    split_k,
    wave_steps,
    whole_wave_split_k,
)

ONE_WARPGROUP_MAX_M = 32     # the largest M of one warpgroup a program (16 or 32 rows of x); above, large_m_config
try:                                 # Gluon's Hopper API: Triton >= 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    GLUON_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - older Triton: the plan keeps the MMA kernel
    GLUON_ERROR = f"Gluon's Hopper API is not importable ({exc})"

LARGE_M_MIN_TILES = 2        # least K tiles a split above M = 32 (two warpgroups a program)
TILE_K_COLUMNS = (32 // 4) * R  # columns a K tile of 4-bit codes: 8 codes of R word rows (8-bit: 4 codes, half)
# Blocks of R word rows a K tile of 8-bit codes takes: 2 gives it 128 columns and 8 codes, as a 4-bit tile, so that
# the tile's fixed cost (the stage's wait and barrier, its scales) is spread over twice the wgmmas.
EIGHT_BIT_BLOCKS = 1
SHARED_MEMORY = 227 * 1024   # the most shared memory an sm90 program may take

if GLUON_ERROR is None:
    # a CTA barrier: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    R_ROWS = gl.constexpr(R)

    @gluon.jit
    def _decode_code(words, i: gl.constexpr, s, zb, ZERO: gl.constexpr, HAS_ZB: gl.constexpr, DT: gl.constexpr,
                     BITS: gl.constexpr):
        """Weights [rows, 16] in DT of code i of the words [rows, 16] (operand A's layout): columns 16 i + r, two
        an instruction by layout.H2_PAIR_* (mma._h2_codes explains the constants; 8-bit codes in fp16 only)."""
        BYTE: gl.constexpr = i // 2 if BITS == 4 else i
        SEL: gl.constexpr = BYTE | (BYTE << 4) | ((4 + BYTE) << 8) | ((4 + BYTE) << 12)
        HIGH: gl.constexpr = BITS == 4 and i % 2 == 1
        F16: gl.constexpr = DT == gl.float16
        MASK: gl.constexpr = 0x00F000F0 if HIGH and F16 else (0x000F000F if BITS == 4 else 0x00FF00FF)
        FACTOR: gl.constexpr = 0.0625 if HIGH and F16 else 1.0
        Z: gl.constexpr = 0 if HAS_ZB else ZERO
        ADDEND: gl.constexpr = -(128.0 + Z) if not F16 else (-(64.0 + Z) if HIGH else -(1024.0 + Z))
        shape: gl.constexpr = words.shape
        layout: gl.constexpr = words.type.layout
        if HAS_ZB:
            addend = zb
        else:                                # -0 by its bits: a float -0.0 constant reaches ptxas as +0
            addend = gl.full(shape, -32768, gl.int16, layout).to(DT, bitcast=True)
        args = [words, gl.full(shape, SEL, gl.int32, layout), gl.full(shape, MASK, gl.int32, layout),
                gl.full(shape, FACTOR, gl.float32, layout).to(DT), gl.full(shape, ADDEND, gl.float32, layout).to(DT),
                s, addend]
        # pack 2: columns 2q and 2q + 1 are one 32-bit register; dtype a literal (Triton 3.6 refuses a constexpr)
        w = gl.inline_asm_elementwise(H2_PAIR_F16 if F16 else (H2_PAIR_BF16_HIGH if HIGH else H2_PAIR_BF16),
                                      "=r,r,r,r,r,r,r,r,r,r,r", args, dtype=gl.float16 if F16 else gl.bfloat16,
                                      is_pure=True, pack=2)
        return w

    @gluon.jit
    def operand_scales(v, g, HAS_ZB: gl.constexpr, DT: gl.constexpr, BLOCK_N: gl.constexpr):
        """(scale, zbias) [BLOCK_N, 16] in DT, broadcast over a code's 16 columns, of group g from its scale words v
        [BLOCK_N] (operand A's rows): (scale, zbias) a word, or without zero points group g's half of the word of
        groups 2j, 2j + 1."""
        if HAS_ZB:
            sc = (v & 0xFFFF).to(gl.int16).to(DT, bitcast=True)
            zb = (v >> 16).to(gl.int16).to(DT, bitcast=True)
        else:
            sc = ((v >> ((g % 2) * 16)) & 0xFFFF).to(gl.int16).to(DT, bitcast=True)
            zb = sc
        return (gl.expand_dims(sc, 1).broadcast_to([BLOCK_N, 16]),
                gl.expand_dims(zb, 1).broadcast_to([BLOCK_N, 16]))

    @gluon.jit
    def _issue_weights(w_ptr, sz_ptr, w_buf, s_ring, stage, t, n0, N, word_rows, pred,
                       GS: gl.constexpr, HAS_ZB: gl.constexpr, SROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                       TILE_K: gl.constexpr, WROWS: gl.constexpr):
        """cp.async K tile t's WROWS rows of words [WROWS, BLOCK_N] and its SROWS rows of scale words [BLOCK_N] (the
        kernel says how many) into stage `stage` (16-byte copies along the rows); nothing when not pred. A tile of
        two word blocks may end past the weight's word_rows: its second block, and the scale rows of the groups in
        it, exist or not as a whole (the first block always does), and are zeros where not."""
        WL: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
        r = t * WROWS + gl.arange(0, R_ROWS, layout=gl.SliceLayout(1, WL))
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, WL))
        w_ptrs = w_ptr + r[:, None] * N + n[None, :]
        w_mask = (n < N)[None, :] & pred
        TWO: gl.constexpr = WROWS > R_ROWS
        second = pred & (t * WROWS + R_ROWS < word_rows)
        if TWO:
            async_copy.async_copy_global_to_shared(w_buf.slice(0, R_ROWS, dim=0), w_ptrs, mask=w_mask)
            async_copy.async_copy_global_to_shared(w_buf.slice(R_ROWS, R_ROWS, dim=0), w_ptrs + R_ROWS * N,
                                                   mask=(n < N)[None, :] & second)
        else:
            async_copy.async_copy_global_to_shared(w_buf, w_ptrs, mask=w_mask)
        SL: gl.constexpr = gl.BlockedLayout([4], [32], [gl.num_warps()], [0])
        ns = n0 + gl.arange(0, BLOCK_N, layout=SL)
        g = (t * TILE_K) // GS
        srow = g if HAS_ZB else g // 2       # without zbias a word holds the scales of groups 2j and 2j + 1
        for row in gl.static_range(SROWS):
            s_pred = pred
            if TWO and row * (GS if HAS_ZB else 2 * GS) >= TILE_K // 2:   # its groups begin in the second block
                s_pred = second
            async_copy.async_copy_global_to_shared(s_ring.index(stage * SROWS + row), sz_ptr + (srow + row) * N + ns,
                                                   mask=(ns < N) & s_pred)

    @gluon.jit
    def _issue_x(x_ptr, x_buf, t, m0, M, K, stride_xm, pred, BLOCK_M: gl.constexpr, TILE_K: gl.constexpr):
        """cp.async K tile t of x, [BLOCK_M rows, TILE_K columns], into one stage (zeros past M and K), then commit
        the stage's group; nothing copied when not pred."""
        LANES_K: gl.constexpr = TILE_K // 8          # 16-byte copies: 8 columns a lane
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_K, LANES_K], [gl.num_warps(), 1], [1, 0])
        m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
        k = t * TILE_K + gl.arange(0, TILE_K, layout=gl.SliceLayout(0, XL))
        async_copy.async_copy_global_to_shared(x_buf, x_ptr + m[:, None] * stride_xm + k[None, :],
                                               mask=(m < M)[:, None] & (k < K)[None, :] & pred)
        async_copy.commit_group()

    @gluon.jit
    def _issue_tile(x_ptr, w_ptr, sz_ptr, x_ring, w_ring, s_ring, j, t_begin, n_tiles, STAGES: gl.constexpr, n0, m0,
                    M, N, K, word_rows, stride_xm, GS: gl.constexpr, HAS_ZB: gl.constexpr,
                    SROWS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TILE_K: gl.constexpr,
                    WROWS: gl.constexpr):
        """cp.async the split's tile j (weights, scales, x) into stage j % STAGES; nothing past the split."""
        s = j % STAGES
        pred = j < n_tiles
        _issue_weights(w_ptr, sz_ptr, w_ring.index(s), s_ring, s, t_begin + j, n0, N, word_rows, pred, GS, HAS_ZB,
                       SROWS, BLOCK_N, TILE_K, WROWS)
        _issue_x(x_ptr, x_ring.index(s), t_begin + j, m0, M, K, stride_xm, pred, BLOCK_M, TILE_K)

    @gluon.jit
    def program_work(M, per_split, num_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(m0, n0, first K tile, K tiles) of this program: program (output tile, split). The programs of one weight
        block are adjacent (x's blocks vary fastest), so at large M a block is read from DRAM once while x stays in
        L2."""
        tile = gl.program_id(0)
        m_blocks = gl.cdiv(M, BLOCK_M)
        begin = gl.program_id(1) * per_split
        return ((tile % m_blocks) * BLOCK_M, (tile // m_blocks) * BLOCK_N, begin,
                gl.minimum(begin + per_split, num_tiles) - begin)

    @gluon.jit
    def retire(acc, w, p1, p2, p3, LAG: gl.constexpr):
        """After code slice w's wgmma is issued: wait until LAG wgmmas are left in flight (which frees the oldest
        operand), then (acc, the operands in flight, newest first: w, p1, p2)."""
        if LAG == 1:
            acc, p1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, p1))
        elif LAG == 2:
            acc, p2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, p2))
        else:
            acc, p3 = warpgroup_mma_wait(num_outstanding=3, deps=(acc, p3))
        return acc, w, p1, p2

    @gluon.jit
    def finish(acc, p1, p2, p3, bias_ptr, y_ptr, n0, m0, N, M, stride_ym, first_split, has_work, PDL: gl.constexpr,
               HAS_BIAS: gl.constexpr, ATOMIC: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """The end of a program: the wgmmas still in flight (operands p1..p3) and the copies drained, the next
        kernel let launch (PDL), then y[m0.., n0..] (+)= the accumulator [BLOCK_N, BLOCK_M]ᵀ (+ bias where
        first_split), in y's column order (8 adjacent columns a thread, so stores and atomics are vectors); nothing
        where not has_work."""
        acc, p1, p2, p3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p1, p2, p3))
        async_copy.wait_group(0)
        if PDL:
            gdc_launch_dependents()
        OUT: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [1, gl.num_warps()], [0, 1])
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, OUT))
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT))
        out = gl.convert_layout(acc, OUT)
        if HAS_BIAS:
            if first_split:
                b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                out += gl.expand_dims(b.to(gl.float32), 1)
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :] & has_work
        if ATOMIC:
            gl.atomic_add(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")
        else:
            gl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _affine_wgmma_kernel(x_ptr, w_ptr, sz_ptr, bias_ptr, y_ptr, M, N, K, tiles_per_split, num_tiles,
                             word_rows, stride_xm, stride_ym, BITS: gl.constexpr, BLOCKS: gl.constexpr,
                             GS: gl.constexpr, SROWS: gl.constexpr, ZERO: gl.constexpr,
                             HAS_ZB: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr,
                             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr, ATOMIC: gl.constexpr,
                             PDL: gl.constexpr):
        """y[M, N] (+)= (W[BLOCK_N rows, K tiles of split j] @ x[BLOCK_M rows]ᵀ)ᵀ (+ bias with split 0), program
        (output tile, split j); LAG wgmmas (1..3) left in flight behind each code's.

        Triton waits for every wgmma of a tl.dot before the next instruction, so the MMA kernel joins the 8 codes of
        a K tile into one [rows, 128] operand and holds it in registers until its dot completes: 254 registers a
        thread, 2 programs of 4 warps an SM, the issue slots mostly idle. Gluon gives the waits to the kernel: code
        i's [rows, 16] slice goes to its own wgmma while code i + 1 decodes, and a wait for all but the LAG newest
        frees the older slices (191 registers at 256 rows a program, 115 at 128). The words, scales and x come in by
        cp.async into a ring of STAGES shared-memory stages.

        Up to M = 32 a program is one warpgroup (4 warps) with 16 or 32 rows of x, and refills the stage its own
        wgmmas just left, STAGES - 1 tiles ahead. Above, a program is two warpgroups sharing each stage's 64 or 128
        rows of x (large_m_config): 251 registers, one program an SM, each wgmma m64n128k16 at 128 rows of x. A
        warpgroup may then still read a stage the other has left, so the refill waits for the CTA barrier at the top
        of each K tile and takes the stage of two tiles ago (STAGES - 2 ahead).

        Word row r of a K tile holds columns 16 i + r (i = 0..7; 8-bit codes: i = 0..3, a K tile of 64 columns,
        code i in byte i, decoded the same way with the byte's mask; with BLOCKS = 2 a K tile holds two such blocks
        of word rows, 128 columns, the second block's words loaded at its first code). The words of a block are
        loaded from shared memory as [rows, 16] int32 in operand A's layout (lane (g, q) of warp w holds rows
        16 w + g (+ 8) of each 64 and word columns 2q, 2q + 1, 2q + 8, 2q + 9), which is also the layout of every
        code's [rows, 16] weights: code i of those words is columns 16 i + 2q, ... So code i is decoded in place, two
        columns an instruction, by the PTX of the H2 pairs (layout.H2_PAIR_*: prmt, lop3, two f16x2 / bf16x2 fma),
        and multiplies x's columns 16 i .. 16 i + 15: a [BLOCK_M, 16] slice along K of the x stage [BLOCK_M,
        TILE_K], operand B."""
        DT: gl.constexpr = x_ptr.dtype.element_ty
        WARPS: gl.constexpr = gl.num_warps()    # the launch's (a parameter of that name would take its place)
        PER_BLOCK: gl.constexpr = 32 // BITS    # codes a block of R word rows
        CODES: gl.constexpr = PER_BLOCK * BLOCKS
        TILE_K: gl.constexpr = CODES * R_ROWS
        WROWS: gl.constexpr = R_ROWS * BLOCKS
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        m0, n0, t_begin, n_tiles = program_work(M, tiles_per_split, num_tiles, BLOCK_M, BLOCK_N)
        # the refill of a stage: one warpgroup refills the stage its own wgmmas just left, STAGES - 1 tiles ahead,
        # once the previous tile's wgmmas are done (after code LAG - 1). With two, the other may still read it, so
        # the refill takes the stage of two tiles ago (free since the CTA barrier), STAGES - 2 ahead, once code 0's
        # wgmma is in flight, so that the copies overlap code 0's wgmma rather than delay it
        AHEAD: gl.constexpr = STAGES - 1 if WARPS == 4 else STAGES - 2
        REFILL_AFTER: gl.constexpr = LAG - 1 if WARPS == 4 else 0

        # words [WROWS, BLOCK_N] swizzled so that operand A's loads (rows g, word columns 2q..) hit 32 banks
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, WROWS, BLOCK_N],
                                           gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
        # a stage's SROWS rows of scale words (scale_rows says how many)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES * SROWS, BLOCK_N],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        # x in wgmma's 128-byte swizzle (an x stage laid out as 8 slices of [BLOCK_M, 16] in the 32-byte swizzle
        # was slower at every M)
        x_ring = gl.allocate_shared_memory(DT, [STAGES, BLOCK_M, TILE_K],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        for p in gl.static_range(AHEAD):
            _issue_weights(w_ptr, sz_ptr, w_ring.index(p), s_ring, p, t_begin + p, n0, N, word_rows, p < n_tiles,
                           GS, HAS_ZB, SROWS, BLOCK_N, TILE_K, WROWS)
        # under programmatic dependent launch the weight's first stages are issued before the wait for the
        # previous kernel (x and y are that kernel's); the next kernel may launch once the main loop is done
        if PDL:
            gdc_wait()
        for p in gl.static_range(AHEAD):
            _issue_x(x_ptr, x_ring.index(p), t_begin + p, m0, M, K, stride_xm, p < n_tiles, BLOCK_M, TILE_K)

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        # the operands of the LAG newest wgmmas (p1 the newest), alive until their wgmmas complete
        p1 = gl.zeros([BLOCK_N, 16], DT, A)
        p2 = p1
        p3 = p1
        for i in range(n_tiles):
            t = t_begin + i
            s = i % STAGES
            async_copy.wait_group(AHEAD - 1)
            _cta_barrier()
            fence_async_shared()
            words = w_ring.index(s).slice(0, R_ROWS, dim=0).permute((1, 0)).load(A)
            g0 = (t * TILE_K) // GS
            sc, zb = operand_scales(s_ring.index(s * SROWS).load(gl.SliceLayout(1, A)), g0, HAS_ZB, DT, BLOCK_N)
            xs = x_ring.index(s)
            for c in gl.static_range(CODES):
                if GS < TILE_K and c > 0 and (c * 16) % GS == 0:   # code c begins a group narrower than the tile
                    row = (c * 16) // GS if HAS_ZB else (c * 16) // GS // 2
                    v = s_ring.index(s * SROWS + row).load(gl.SliceLayout(1, A))
                    # the tile's first group is even here (groups of 32 / 64): the parity is the code's, known
                    sc, zb = operand_scales(v, (c * 16) // GS, HAS_ZB, DT, BLOCK_N)
                if c > 0 and c % PER_BLOCK == 0:                    # a tile's second block of word rows
                    words = w_ring.index(s).slice(c // PER_BLOCK * R_ROWS, R_ROWS, dim=0).permute((1, 0)).load(A)
                w = _decode_code(words, c % PER_BLOCK, sc, zb, ZERO, HAS_ZB, DT, BITS)
                acc = warpgroup_mma(w, xs.slice(c * 16, 16, dim=1).permute((1, 0)), acc, is_async=True)
                acc, p1, p2, p3 = retire(acc, w, p1, p2, p3, LAG)
                if c == REFILL_AFTER:
                    _issue_tile(x_ptr, w_ptr, sz_ptr, x_ring, w_ring, s_ring, i + AHEAD, t_begin, n_tiles, STAGES,
                                n0, m0, M, N, K, word_rows, stride_xm, GS, HAS_ZB, SROWS, BLOCK_M,
                                BLOCK_N, TILE_K, WROWS)
        finish(acc, p1, p2, p3, bias_ptr, y_ptr, n0, m0, N, M, stride_ym, t_begin == 0, n_tiles > 0, PDL, HAS_BIAS,
               ATOMIC, BLOCK_N, BLOCK_M)


class WgmmaConfig(NamedTuple):
    """A wgmma launch: BLOCK_M rows of x and `rows` weight rows a program, the K loop split for about `waves`
    programs an SM (None: whole waves of one an SM), `lag` wgmmas left in flight behind each code's."""
    block_m: int
    stages: int
    waves: float | None
    min_tiles: int              # least K tiles a split
    rows: int
    lag: int
    warps: int                  # 4 (one warpgroup) or 8 (two sharing each stage of x)


def weight_fits(st: AffineState) -> bool:
    """Whether the kernel computes this weight: affine codes in groups of a multiple of the K tile's columns (one
    scale row a K tile: 128 for 4-bit codes, 64 for 8-bit), per channel, or of 32 or 64 columns (GGUF Q4_0 / Q4_1
    / Q8_0, AWQ / GPTQ g32, g64: a scale row a group, or a pair of groups, each applied from the code where its
    group begins); 4-bit codes in fp16 or bf16, 8-bit codes in fp16 (bf16's 7-bit mantissa holds no 8-bit code
    beside the decode's magic number: mma.h2_applies); act-order too, its input gathered first (matmul)."""
    groups_fit = st.group_size % tile_columns(st) == 0 or st.group_size in (32, 64) or st.group_size >= st.k_pad
    dtype_fits = st.dtype in ((torch.float16, torch.bfloat16) if st.bits == 4 else (torch.float16,))
    return st.mode == AFFINE and st.bits in (4, 8) and groups_fit and dtype_fits


def word_blocks(st: AffineState) -> int:
    """Blocks of R word rows a kernel K tile of this weight takes (EIGHT_BIT_BLOCKS for 8-bit codes, else 1)."""
    return EIGHT_BIT_BLOCKS if st.bits == 8 else 1


def tile_columns(st: AffineState) -> int:
    """Input columns a kernel K tile of this weight holds: 128 for 4-bit codes, 64 a word block for 8-bit."""
    return st.tile_k * word_blocks(st)


def kernel_tiles(st: AffineState) -> int:
    """The weight's K tiles as the kernel walks them (layout's tiles joined by word_blocks)."""
    return cdiv(st.num_tiles, word_blocks(st))


def scale_rows(st: AffineState) -> int:
    """Rows of scale words a K tile's stage holds (the kernel's SROWS): one where a group spans the tile, else one a
    group, or one a pair of groups without zero points (a word holds both halves)."""
    columns = tile_columns(st)
    return 1 if st.group_size >= columns else columns // st.group_size // (1 if st.has_zb else 2)


def shared_bytes(st: AffineState, config: WgmmaConfig) -> int:
    """Shared memory the kernel's ring takes under `config`: each stage's x [BLOCK_M, tile columns] in 16 bits, its
    word rows and scale rows of `rows` int32 words (the epilogue's layout change reuses it)."""
    return config.stages * (config.block_m * tile_columns(st) * 2
                            + (R * word_blocks(st) + scale_rows(st)) * config.rows * 4)


def k_tiles_each(st: AffineState, sms: int) -> float:
    """K tiles a program would take if two waves of programs (two an SM) shared the weight's blocks of 256 rows:
    how much work a program has when M is small, the measure of whether the wider programs fill the SMs."""
    return cdiv(st.n, 256) * kernel_tiles(st) / (2 * sms)


def default_config(st: AffineState, caps: DeviceCaps, m: int) -> WgmmaConfig:
    """The config of M rows.

    M <= 32: one warpgroup (4 warps); 256 weight rows a program where 2 waves of them would take enough K tiles
    each (fp16: 4; bf16: 9, and a K of 64 tiles or more), else 128: fewer, wider programs leave SMs idle on the
    smaller weights (8B o), and bf16's costlier decode wants 128 rows on all the 8B shapes.

    M > 32 (large_m_config): two warpgroups, 64 or 128 rows of x, one program an SM."""
    if m > ONE_WARPGROUP_MAX_M:
        return large_m_config(st, caps, m)
    each = k_tiles_each(st, caps.sm_count)
    if st.dtype == torch.float16:
        wide = m > 16 or each >= 4
    else:
        wide = each >= 9 and kernel_tiles(st) >= 64
    return WgmmaConfig(16 if m <= 16 else 32, 3, 2.0, 2, 256 if wide else 128, 2, 4)


ROW_STEP_COST = {256: 1.0, 128: 0.57}   # the time of a K tile of a 128-row program against a 256-row one, both at
                                        # 128 rows of x (fit on the H100 at M = 1024; below it, 70B qkv at M = 256
                                        # would take 128-row programs split in 4, slower than 256 split in 3)


def grid(st: AffineState, sms: int, config: WgmmaConfig, m: int) -> tuple[int, int, int]:
    """(output tiles, K splits, K tiles a split) of a launch of `config` for M rows (grid_of)."""
    return grid_of(st.n, kernel_tiles(st), sms, config, m)


def grid_of(n: int, k_tiles: int, sms: int, config: WgmmaConfig, m: int) -> tuple[int, int, int]:
    """(output tiles, K splits, K tiles a split) of a launch of `config` for M rows over N weight rows and K tiles:
    the K loop split for about `waves` programs an SM (triton_support.split_k), or with waves None for whole waves
    of one an SM (whole_wave_split_k)."""
    tiles = cdiv(n, config.rows) * cdiv(m, config.block_m)
    splits, per = (whole_wave_split_k(tiles, k_tiles, sms, config.min_tiles) if config.waves is None
                   else split_k(tiles, k_tiles, sms, config.waves, config.min_tiles))
    return tiles, splits, per


def large_m_config(st: AffineState, caps: DeviceCaps, m: int) -> WgmmaConfig:
    """The config above M = 32: two warpgroups (8 warps, 251 registers: one program an SM) share each stage of
    x, 64 rows of it up to M = 64 (256 weight rows a program: 128 leave the decode too little work to hide), else
    128 (each wgmma m64n128k16, 3 in flight), in 4 stages (3 where a 128-row x stage sits beside two word blocks:
    four would pass SHARED_MEMORY); 256 weight rows a program, or 128 where triton_support.wave_steps, weighted by
    ROW_STEP_COST, expects the smaller programs to fill the waves better (8B o at M = 128..512); the K loop split
    for whole waves (waves None)."""
    bm, lag = (64, 2) if m <= 64 else (128, 3)
    stages = 3 if bm == 128 and word_blocks(st) > 1 else 4

    def config(rows: int) -> WgmmaConfig:
        return WgmmaConfig(bm, stages, None, LARGE_M_MIN_TILES, rows, lag, 8)

    def cost(rows: int) -> float:
        tiles, splits, _ = grid(st, caps.sm_count, config(rows), m)
        return wave_steps(tiles, kernel_tiles(st), caps.sm_count, splits) * ROW_STEP_COST[rows]

    return config(256 if bm == 64 else min(ROW_STEP_COST, key=cost))


def aligned_rows(x2: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """(x2, K) as the wgmma kernels' cp.async copies of x need them (16 bytes here, the ggml kernel's permuted
    pairs 4): K and the row stride multiples of 16 elements (Triton's divisibility hint; a copy of less than 4 bytes
    does not compile), 16-byte aligned rows. Otherwise a copy of x, zero past K, and K rounded up to 16 (the padded
    codes meet zeros)."""
    if k % 16 == 0 and x2.stride(0) % 16 == 0 and x2.data_ptr() % 16 == 0:
        return x2, k
    k16 = cdiv(k, 16) * 16
    padded = x2.new_zeros(x2.shape[0], k16)
    padded[:, :k] = x2
    return padded, k16


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias); `config` (WgmmaConfig's fields) and `maxnreg` (a register cap, so that
    more programs fit an SM) are forced by tests and benchmarks; `caps` defaults to the device's. Split-K over
    programs (triton_support.split_k; above M = 32 whole_wave_split_k), partial sums added to a zeroed output
    (fp16, or float32 for bf16). An act-order weight reads x[:, perm], gathered here."""
    assert weight_fits(st) and x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    m = x2.shape[0]
    x2 = st.in_weight_order(x2)
    caps = caps or device_caps(x2.device)
    config = WgmmaConfig(*config) if config else default_config(st, caps, m)
    bm, stages, _, _, bn, lag, warps = config
    assert bm in (16, 32, 64, 128, 256) and 1 <= lag <= 3 and bn % (16 * warps) == 0 and warps in (4, 8) \
        and stages >= (2 if warps == 4 else 3) and shared_bytes(st, config) <= SHARED_MEMORY, config
    tiles, splits, per = grid(st, caps.sm_count, config, m)
    atomic = splits > 1
    y = split_k_output(m, st, atomic, x2.device)
    options = {"maxnreg": maxnreg} if maxnreg else {}
    xa, k = aligned_rows(x2, st.k)
    _affine_wgmma_kernel[(tiles, splits)](
        xa, st.packed, st.sz, bias if bias is not None else xa, y, m, st.n, k, per, kernel_tiles(st),
        st.packed.shape[0], xa.stride(0), y.stride(0), BITS=st.bits, BLOCKS=word_blocks(st),
        GS=st.group_size, SROWS=scale_rows(st), ZERO=st.zero, HAS_ZB=st.has_zb, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, LAG=lag, ATOMIC=atomic, num_warps=warps, **options,
        **pdl_launch(caps))
    return y.to(st.dtype)
