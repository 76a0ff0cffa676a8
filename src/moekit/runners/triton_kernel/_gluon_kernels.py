"""Gluon kernels of the `triton_kernel` runner's Hopper engine (private: wrappers in
`gluon_ops.py`). Needs Triton >= 3.9 (`triton.experimental.gluon`) and an sm_90 GPU.

The two grouped GEMMs of `_kernels.py` over the same work tiles (`routing.py`), written with
explicit warp specialization, which Triton's own compiler does not build for these kernels:

- a producer partition of one warp walks the program's work items and K steps, waits for a free
  shared-memory stage (`empty[s]`), and issues the TMA loads of the activation tile and the
  weight tile(s) into it, which signal `ready[s]`;
- the default partition (two warpgroups, 64 rows each of a BM = 128-row tile) waits for
  `ready[s]`, issues the async wgmma, frees the stage once the step's wgmma has retired, and
  runs the epilogue, while the producer already loads the next item's operands.

The weights always come through TMA. The activation rows: down reads h [P, I] (sorted rows)
through TMA; gate_up either reads xs [P, H] (x's rows copied into sorted order first) through
TMA, or (`gate_up_gather_kernel`) has a producer of four warps copy each tile's rows of x with
cp.async. A tile's rows past its valid ones (the next expert's, out of bounds and zero-filled,
or not gathered) are computed but never stored: the epilogue stores from registers with a row
mask.

  gate_up_kernel         h[row] = act(xs[row] @ w13[e].T + b13[e])   (two accumulators)
  gate_up_gather_kernel  the same from x [T, H] and the sorted pairs
  down_kernel            y[pair(row)] = weight[pair] * (h[row] @ w2[e].T + b2[e]), or (ATOMIC)
                         added into out[token(row)]
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_M = 128  # two consumer warpgroups of 64 rows
NUM_WARPS = 8  # the default (consumer) partition
PRODUCER_REGS = gl.constexpr(40)  # registers of the producer warp (setmaxnreg)
GATHER_WARPS = gl.constexpr(4)  # the producer that gathers x's rows with cp.async
GATHER_REGS = gl.constexpr(88)  # its registers: row pointers and masks of 8 copies a thread
MAX_REGS = 168  # per-thread cap of the 12 warps (3 warpgroups) on one SM's 64K registers


@gluon.constexpr_function
def _acc_layout(BN, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each), one N instruction."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )


@gluon.jit
def _work_item(w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n,
               GROUP_M: gl.constexpr):  # fmt: skip
    """Work item w -> (expert, first sorted row, valid rows, column block). GROUP_M work tiles
    fastest within each column block: the programs running at once read a weight tile once."""
    width = GROUP_M * num_n
    first = (w // width) * GROUP_M
    size = gl.minimum(num_tiles - first, GROUP_M)
    tile = first + (w % width) % size
    pid_n = (w % width) // size
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row0_ptr + tile)
    nrows = gl.load(tile_rows_ptr + tile)
    return expert, row0, nrows, pid_n


@gluon.jit
def _producer(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, tile_expert_ptr,
              tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, b_row_step, b2_row_off,
              TWO_B: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
    """One warp: the TMA loads of every (work item, K step) of this program, at most STAGES
    ahead of the consumer. Weight rows of expert e, column block n0: b_desc at e * b_row_step +
    n0, and (TWO_B) b2_desc at that + b2_row_off."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes * (1 + TWO_B)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, _, pid_n = _work_item(w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                                            num_tiles, num_n, GROUP_M)  # fmt: skip
        b_row = expert * b_row_step + pid_n * BN
        for ki in range(num_k):
            s = count % STAGES
            # stages start free: the first pass waits on the phase before the initial one
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_load(a_desc, [row0, ki * BK], bar, a_bufs.index(s))
            tma.async_load(b_desc, [b_row, ki * BK], bar, b_bufs.index(s))
            if TWO_B:
                tma.async_load(b2_desc, [b_row + b2_row_off, ki * BK], bar, b2_bufs.index(s))
            count += 1


@gluon.jit
def _gather_producer(x_ptr, stride_xm, sorted_pairs_ptr, top_k, b_desc, b2_desc, a_bufs, b_bufs,
                     b2_bufs, ready, empty, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                     num_tiles_ptr, N, K, b_row_step, b2_row_off,
                     GROUP_M: gl.constexpr):  # fmt: skip
    """GATHER_WARPS warps: `_producer` for gate_up without the sorted copy xs: the A tile's rows
    are x's rows of the tile's tokens (token = sorted_pairs[row] // top_k), copied with cp.async
    (16 bytes a thread and copy; rows past the tile's valid ones are zero-filled; K must be a
    multiple of BK and x's row stride of 8), each thread arriving on `ready[s]` when its copies
    land (the barrier counts the threads and the weight tiles' expect-tx arrival)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    nbytes: gl.constexpr = 2 * b_desc.block_type.nbytes
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BK, BK // 8], [GATHER_WARPS, 1],
                                            [1, 0])  # fmt: skip
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        b_row = expert * b_row_step + pid_n * BN
        row_ok = offs_m < nrows
        pair = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=row_ok, other=0)
        row_off = gl.multiple_of((pair // top_k).to(gl.int64) * stride_xm, 8)
        a_rows = x_ptr + row_off[:, None]
        for ki in range(num_k):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_load(b_desc, [b_row, ki * BK], bar, b_bufs.index(s))
            tma.async_load(b2_desc, [b_row + b2_row_off, ki * BK], bar, b2_bufs.index(s))
            cols = gl.max_contiguous(gl.multiple_of(ki * BK + offs_k, 8), 8)
            async_copy.async_load(a_bufs.index(s), a_rows + cols[None, :], mask=row_ok[:, None])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            count += 1


@gluon.jit
def _activate(g, u, alpha, limit, ACT: gl.constexpr):
    """float32 gate g, up u -> act(g) * u: silu, exact-erf gelu, or swiglu_oai (the twin of
    `_triton_common.activate`)."""
    if ACT == 0:
        out = g / (1.0 + gl.exp(-g)) * u
    elif ACT == 1:
        out = 0.5 * g * (1.0 + gl.erf(g * 0.7071067811865476)) * u
    else:
        g = gl.minimum(g, limit)
        u = gl.minimum(gl.maximum(u, -limit), limit)
        out = g / (1.0 + gl.exp(-alpha * g)) * (u + 1.0)
    return out


@gluon.jit
def _gate_up_consumer(a_bufs, b_bufs, b2_bufs, ready, empty, bias_ptr, h_ptr, tile_expert_ptr,
                      tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, stride_be, stride_hm,
                      alpha, limit, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                      INTERLEAVED: gl.constexpr, GROUP_M: gl.constexpr, GATHERED: gl.constexpr,
                      num_warps: gl.constexpr):  # fmt: skip
    """Two accumulators (gate: b_bufs, up: b2_bufs) per work item; epilogue: bias, activation,
    h rows stored from registers. GATHERED: the A tiles were written by the producer's
    cp.async copies (generic proxy), so a proxy fence orders them before the wgmma reads."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = _acc_layout(BN, num_warps)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        acc_g = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        for ki in range(num_k):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            if GATHERED:
                fence_async_shared()
            a = a_bufs.index(s)
            acc_g = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
            # this step's two wgmma groups may run on; the previous step's have retired
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            count += 1
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        n_out = pid_n * BN + offs_n
        col_ok = n_out < N
        if HAS_BIAS:
            b_base = bias_ptr + expert.to(gl.int64) * stride_be
            if INTERLEAVED:  # b13[e] holds gate column n at 2n, up at 2n + 1
                g_col = 2 * n_out
                u_col = g_col + 1
            else:  # gate at n, up at I + n
                g_col = n_out
                u_col = N + n_out
            acc_g += gl.load(b_base + g_col, mask=col_ok, other=0.0).to(gl.float32)[None, :]
            acc_u += gl.load(b_base + u_col, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        out = _activate(acc_g, acc_u, alpha, limit, ACT)
        rows = (row0 + offs_m).to(gl.int64)
        ptrs = h_ptr + rows[:, None] * stride_hm + n_out[None, :]
        gl.store(ptrs, out.to(h_ptr.dtype.element_ty),
                 mask=(offs_m < nrows)[:, None] & col_ok[None, :])  # fmt: skip


@gluon.jit
def gate_up_kernel(xs_desc, w_desc, w_up_desc, bias_ptr, h_ptr, tile_expert_ptr, tile_row0_ptr,
                   tile_rows_ptr, num_tiles_ptr, N, K, b_row_step, up_row_off, stride_be,
                   stride_hm, alpha, limit, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                   INTERLEAVED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   num_warps: gl.constexpr):  # fmt: skip
    """h [P, N = I] = act(xs @ w13[e].T + b13[e]) per sorted row (module docstring). xs_desc:
    xs [P, H], block [BM, BK]; w_desc / w_up_desc: the gate / up weight rows, block [BN, BK]:
    w13 viewed [E * 2I, H] for both (b_row_step 2I, up_row_off I), or, interleaved, the gate
    rows and the up rows each viewed [E * I, H] with row stride 2H (b_row_step I, 0)."""
    dtype: gl.constexpr = xs_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + xs_desc.block_type.shape, xs_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_up_desc.block_type.shape,
                                        w_up_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_gate_up_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, bias_ptr, h_ptr,
                                 tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr,
                                 N, K, stride_be, stride_hm, alpha, limit, ACT, HAS_BIAS,
                                 INTERLEAVED, GROUP_M, False, num_warps)),  # fmt: skip
            (_producer, (xs_desc, w_desc, w_up_desc, a_bufs, b_bufs, b2_bufs, ready, empty,
                         tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K,
                         b_row_step, up_row_off, True, GROUP_M)),  # fmt: skip
        ],
        [1],
        [PRODUCER_REGS],
    )


@gluon.jit
def gate_up_gather_kernel(x_ptr, stride_xm, sorted_pairs_ptr, top_k, w_desc, w_up_desc, bias_ptr,
                          h_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N,
                          K, b_row_step, up_row_off, stride_be, stride_hm, alpha, limit,
                          ACT: gl.constexpr, HAS_BIAS: gl.constexpr, INTERLEAVED: gl.constexpr,
                          STAGES: gl.constexpr, GROUP_M: gl.constexpr, BM: gl.constexpr,
                          A_LAYOUT: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """`gate_up_kernel` reading x [T, H] directly (x_ptr, row stride stride_xm): the producer
    gathers each tile's rows (`_gather_producer`), so no sorted copy xs is made. A_LAYOUT: the
    shared layout of an A tile [BM, BK] (BK = the weight block's)."""
    dtype: gl.constexpr = w_desc.dtype
    BK: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_up_desc.block_type.shape,
                                        w_up_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the weight tiles' expect-tx arrival, and one cp.async arrival per producer thread
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_gate_up_consumer, (a_bufs, b_bufs, b2_bufs, ready, empty, bias_ptr, h_ptr,
                                 tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr,
                                 N, K, stride_be, stride_hm, alpha, limit, ACT, HAS_BIAS,
                                 INTERLEAVED, GROUP_M, True, num_warps)),  # fmt: skip
            (_gather_producer, (x_ptr, stride_xm, sorted_pairs_ptr, top_k, w_desc, w_up_desc,
                                a_bufs, b_bufs, b2_bufs, ready, empty, tile_expert_ptr,
                                tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, b_row_step,
                                up_row_off, GROUP_M)),  # fmt: skip
        ],
        [GATHER_WARPS],
        [GATHER_REGS],
    )


@gluon.jit
def _down_consumer(a_bufs, b_bufs, ready, empty, bias_ptr, y_ptr, topk_weights_ptr,
                   sorted_pairs_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                   num_tiles_ptr, top_k, N, K, stride_be, stride_ym, HAS_BIAS: gl.constexpr,
                   ATOMIC: gl.constexpr, GROUP_M: gl.constexpr,
                   num_warps: gl.constexpr):  # fmt: skip
    """One accumulator per work item; epilogue: bias, routing weight, store by pair (or atomic
    add by token) from registers."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    layout: gl.constexpr = _acc_layout(BN, num_warps)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        for ki in range(num_k):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        n_out = pid_n * BN + offs_n
        col_ok = n_out < N
        if HAS_BIAS:
            acc += gl.load(bias_ptr + expert.to(gl.int64) * stride_be + n_out, mask=col_ok,
                           other=0.0).to(gl.float32)[None, :]  # fmt: skip
        row_ok = offs_m < nrows
        pair = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=row_ok, other=0)
        acc = acc * gl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        if ATOMIC:
            y_rows = (pair // top_k).to(gl.int64)
        else:
            y_rows = pair.to(gl.int64)
        ptrs = y_ptr + y_rows[:, None] * stride_ym + n_out[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if ATOMIC:
            gl.atomic_add(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")
        else:
            gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def down_kernel(h_desc, w_desc, bias_ptr, y_ptr, topk_weights_ptr, sorted_pairs_ptr,
                tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, top_k, N, K,
                stride_be, stride_ym, HAS_BIAS: gl.constexpr, ATOMIC: gl.constexpr,
                STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                num_warps: gl.constexpr):  # fmt: skip
    """y = weight * (h @ w2[e].T + b2[e]) per sorted row (module docstring); N = H, K = I.
    h_desc: h [P, I], block [BM, BK]; w_desc: w2 viewed [E * H, I], block [BN, BK]. y [P, H]
    by pair, or (ATOMIC) out [T, H], zeroed before, by token."""
    dtype: gl.constexpr = h_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (_down_consumer, (a_bufs, b_bufs, ready, empty, bias_ptr, y_ptr, topk_weights_ptr,
                              sorted_pairs_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                              num_tiles_ptr, top_k, N, K, stride_be, stride_ym, HAS_BIAS,
                              ATOMIC, GROUP_M, num_warps)),  # fmt: skip
            (_producer, (h_desc, w_desc, w_desc, a_bufs, b_bufs, b_bufs, ready, empty,
                         tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, N,
                         0, False, GROUP_M)),  # fmt: skip
        ],
        [1],
        [PRODUCER_REGS],
    )
