"""The warp-specialized form of the wgmma kernel of 4-bit affine codes (sm90, Gluon) for M above 32: a producer warp
feeds a ring of shared-memory stages by TMA, two consumer warpgroups decode the codes in registers and run the
wgmmas, their registers raised by setmaxnreg to what the producer gives up.

In wgmma.py each of a program's 256 threads computes addresses and masks for a stage's cp.async copies every K tile.
Here one warp issues the stage's four TMA copies (words, scale row, x in two 64-column halves) against a `ready`
mbarrier; the consumers wait on it and free a stage through an `empty` mbarrier once the wgmmas that read it have
completed. The decode, the wgmma per code and the epilogue are wgmma.py's. The plan does not route to it: it has not
been faster than wgmma.py's kernel, whose copies were not its cost (benchmarks/wgmma_ws_sweep.py compares them).
"""
from __future__ import annotations

import torch

from quanta.kernels.affine import wgmma
from quanta.kernels.affine.layout import AffineState, R, split_k_output
from quanta.kernels.device_caps import DeviceCaps, device_caps
from quanta.kernels.triton_support import gdc_wait, pdl_launch

X_HALF = 64                 # columns of x a TMA copy: 128 bytes of fp16 / bf16, the 128-byte swizzle's width
WS_REGISTERS = 168          # the launch's register cap: 12 warps (8 consumers, the producer's warpgroup) an SM
PRODUCER_REGISTERS = 24     # the producer warp's registers (it holds only scalars); the consumers get the rest

if wgmma.GLUON_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    R_ROWS = gl.constexpr(R)
    TILE_K = gl.constexpr(wgmma.TILE_K_COLUMNS)
    HALF = gl.constexpr(X_HALF)
    PRODUCER_REGS = gl.constexpr(PRODUCER_REGISTERS)

    @gluon.jit
    def _producer(w_desc, s_desc, x_desc, w_ring, s_ring, x_ring, ready, empty, t_begin, n_tiles, n0, m0,
                  GS: gl.constexpr, HAS_ZB: gl.constexpr, PDL: gl.constexpr):
        """One warp: for each K tile of the split, wait until its stage is free, then TMA its words [16, BLOCK_N],
        scale row [1, BLOCK_N] and x [BLOCK_M, 128] (two halves) into it, completing on the stage's `ready`.
        Under PDL the first tile's weights are requested before the wait for the previous kernel (x is its)."""
        STAGES: gl.constexpr = w_ring.shape[0]
        nbytes: gl.constexpr = (w_desc.block_type.nbytes + s_desc.block_type.nbytes
                                + 2 * x_desc.block_type.nbytes)
        for i in range(n_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)   # a fresh barrier's phase 1 counts as done
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            t = t_begin + i
            g = (t * TILE_K) // GS
            tma.async_copy_global_to_shared(w_desc, [t * R_ROWS, n0], bar, w_ring.index(s))
            tma.async_copy_global_to_shared(s_desc, [g if HAS_ZB else g // 2, n0], bar, s_ring.index(s))
            if PDL:
                if i == 0:
                    gdc_wait()
            tma.async_copy_global_to_shared(x_desc, [m0, t * TILE_K], bar, x_ring.index(2 * s))
            tma.async_copy_global_to_shared(x_desc, [m0, t * TILE_K + HALF], bar, x_ring.index(2 * s + 1))

    @gluon.jit
    def _consumers(w_ring, s_ring, x_ring, ready, empty, bias_ptr, y_ptr, t_begin, n_tiles, n0, m0, M, N, stride_ym,
                   GS: gl.constexpr, ZERO: gl.constexpr, HAS_ZB: gl.constexpr, HAS_BIAS: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, LAG: gl.constexpr, ATOMIC: gl.constexpr,
                   PDL: gl.constexpr):
        """Two warpgroups (the default partition, 8 warps): each K tile's words and scales to registers once its
        stage is ready, then wgmma.py's decode and wgmma per code with LAG in flight. Once code LAG - 1's wgmma is
        issued the previous tile's have all completed (wgmma.retire), so both warpgroups meet at a barrier and
        one thread frees that tile's stage. Then the epilogue (wgmma.finish)."""
        STAGES: gl.constexpr = w_ring.shape[0]
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                      instr_shape=[16, BLOCK_M, 16])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        p1 = gl.zeros([BLOCK_N, 16], x_ring.dtype, A)
        p2 = p1
        p3 = p1
        for i in range(n_tiles):
            s = i % STAGES
            t = t_begin + i
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            words = w_ring.index(s).permute((1, 0)).load(A)
            v = s_ring.index(s).reshape([BLOCK_N]).load(gl.SliceLayout(1, A))
            sc, zb = wgmma.operand_scales(v, (t * TILE_K) // GS, HAS_ZB, x_ring.dtype, BLOCK_N)
            for c in gl.static_range(8):
                w = wgmma._decode_code(words, c, sc, zb, ZERO, HAS_ZB, x_ring.dtype, 4)
                xs = x_ring.index(2 * s + c // 4).slice((c % 4) * 16, 16, dim=1)
                acc = warpgroup_mma(w, xs.permute((1, 0)), acc, is_async=True)
                acc, p1, p2, p3 = wgmma.retire(acc, w, p1, p2, p3, LAG)
                if c == LAG - 1:
                    if i > 0:
                        wgmma._cta_barrier()
                        mbarrier.arrive(empty.index((i - 1) % STAGES))
        wgmma.finish(acc, p1, p2, p3, bias_ptr, y_ptr, n0, m0, N, M, stride_ym, t_begin == 0, n_tiles > 0, PDL,
                     HAS_BIAS, ATOMIC, BLOCK_N, BLOCK_M)

    @gluon.jit
    def _w4_ws_kernel(w_desc, s_desc, x_desc, bias_ptr, y_ptr, M, N, tiles_per_split, num_tiles, stride_ym,
                      GS: gl.constexpr, ZERO: gl.constexpr, HAS_ZB: gl.constexpr, HAS_BIAS: gl.constexpr,
                      STAGES: gl.constexpr, LAG: gl.constexpr, ATOMIC: gl.constexpr, PDL: gl.constexpr):
        """y[M, N] (+)= (W[BLOCK_N rows, K tiles of split j] @ x[BLOCK_M rows]ᵀ)ᵀ (+ bias with split 0), program
        (output tile, split j), as wgmma._affine_wgmma_kernel, with its copies in a producer warp (module docstring).
        BLOCK_N and BLOCK_M are the descriptors' blocks. TMA fills zeros past M and K."""
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        m0, n0, t_begin, n_tiles = wgmma.program_work(M, tiles_per_split, num_tiles, BLOCK_M, BLOCK_N)
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, R_ROWS, BLOCK_N], w_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], s_desc.layout)
        x_ring = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BLOCK_M, HALF], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumers, (w_ring, s_ring, x_ring, ready, empty, bias_ptr, y_ptr, t_begin, n_tiles, n0, m0, M, N,
                          stride_ym, GS, ZERO, HAS_ZB, HAS_BIAS, BLOCK_M, BLOCK_N, LAG, ATOMIC, PDL)),
            (_producer, (w_desc, s_desc, x_desc, w_ring, s_ring, x_ring, ready, empty, t_begin, n_tiles, n0, m0, GS,
                         HAS_ZB, PDL)),
        ], [1], [PRODUCER_REGS])


def weight_fits(st: AffineState) -> bool:
    """Whether the kernel computes this weight: wgmma.weight_fits' with one scale row a K tile (groups of a multiple
    of 128 columns, or per channel) and rows of whole 16-byte TMA boxes (N a multiple of 4 words)."""
    return wgmma.weight_fits(st) and st.bits == 4 and st.group_size % wgmma.TILE_K_COLUMNS == 0 and st.n % 4 == 0


def default_config(st: AffineState, caps: DeviceCaps, m: int) -> wgmma.WgmmaConfig:
    """wgmma.large_m_config's program shape and split, in the stages that fit shared memory beside the epilogue's
    scratch: 3 at 128 rows of x (49 KB a stage), 4 at 64."""
    config = wgmma.large_m_config(st, caps, m)
    return config._replace(stages=3 if config.block_m == 128 else 4)


def descriptors(x2: torch.Tensor, st: AffineState, block_m: int, block_n: int) -> tuple:
    """The TMA descriptors (words, scale rows, x) of a launch: words [tiles x 16, N] in blocks [16, BLOCK_N] and x
    [M, K] in [BLOCK_M, 64], both in the 128-byte swizzle (operand A's loads and wgmma's operand B read them
    without bank conflicts); a scale row [1, BLOCK_N] unswizzled."""
    words = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    scales = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    xs = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return (TensorDescriptor.from_tensor(st.packed, [R, block_n], words),
            TensorDescriptor.from_tensor(st.sz, [1, block_n], scales),
            TensorDescriptor.from_tensor(x2, [block_m, X_HALF], xs))


def matmul(x2: torch.Tensor, st: AffineState, bias: torch.Tensor | None = None, config: tuple | None = None, *,
           caps: DeviceCaps | None = None) -> torch.Tensor:
    """y[M, N] = x2[M, K] @ W.T (+ bias) on the warp-specialized kernel; `config` (wgmma.WgmmaConfig's fields, warps
    8) is forced by tests and benchmarks, else default_config's. The grid and split-K are wgmma.py's."""
    assert weight_fits(st) and x2.dim() == 2 and x2.shape[1] == st.k and x2.dtype == st.dtype and x2.stride(1) == 1
    m = x2.shape[0]
    x2 = st.in_weight_order(x2)
    caps = caps or device_caps(x2.device)
    config = wgmma.WgmmaConfig(*config) if config else default_config(st, caps, m)
    bm, stages, _, _, bn, lag, warps = config
    assert bm in (64, 128, 256) and 1 <= lag <= 3 and bn in (128, 256) and warps == 8 and stages >= 2, config
    tiles, splits, per = wgmma.grid(st, caps.sm_count, config, m)
    atomic = splits > 1
    y = split_k_output(m, st, atomic, x2.device)
    xa, _ = wgmma.aligned_rows(x2, st.k)
    w_desc, s_desc, x_desc = descriptors(xa, st, bm, bn)
    _w4_ws_kernel[(tiles, splits)](
        w_desc, s_desc, x_desc, bias if bias is not None else xa, y, m, st.n, per, st.num_tiles, y.stride(0),
        GS=st.group_size, ZERO=st.zero, HAS_ZB=st.has_zb, HAS_BIAS=bias is not None, STAGES=stages, LAG=lag,
        ATOMIC=atomic, num_warps=8, maxnreg=WS_REGISTERS, **pdl_launch(caps))
    return y.to(st.dtype)
