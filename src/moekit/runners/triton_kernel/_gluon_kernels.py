"""Gluon kernels of the `triton_kernel` runner's Hopper engine (private: wrappers in
`gluon_ops.py`). Needs Triton >= 3.9 (`triton.experimental.gluon`) and an sm_90 GPU.

The two grouped GEMMs of `_kernels.py` over the same work tiles (`routing.py`), written with
explicit warp specialization, which Triton's own compiler does not build for these kernels:

- a producer partition of one warp walks the program's work items and K steps, waits for a free
  shared-memory stage (`empty[s]`), and issues the TMA loads of the activation tile and the
  weight tile(s) into it, which signal `ready[s]`;
- the default partition (two warpgroups, 64 rows each of a BM = 128-row tile) waits for
  `ready[s]`, issues the async wgmma, frees the stage once the step's wgmma has retired, and
  runs the epilogue, while the producer already loads the next item's operands;
- or (CONSUMERS = 2) each of those warpgroups is a partition of its own (the default one and a
  worker, 4 warps each, M_OFF its first row of the tile): each frees a stage alone (`empty[s]`
  counts both), where one partition of 8 warps arrives after a barrier over all of them, which
  holds the two in step. That matters for SCALED, whose wgmma retire every K step.

The weights always come through TMA. The activation rows: down reads h [P, I] (sorted rows)
through TMA; gate_up either reads xs [P, H] (x's rows copied into sorted order first) through
TMA, or (`gate_up_gather_kernel`) has a producer of four warps copy each tile's rows of x with
cp.async. A tile's rows past its valid ones (the next expert's, out of bounds and zero-filled,
or not gathered) are computed but never stored: the epilogue stores from registers with a row
mask.

  gate_up_kernel         h[row] = act(xs[row] @ w13[e].T + b13[e])   (two accumulators; may
                         zero down's ATOMIC output on the way, a piece a K step)
  gate_up_gather_kernel  the same from x [T, H] and the sorted pairs (FUSED: gate and up tiles
                         side by side, one wgmma; SCALED: fp8 x and w13 with block scales)
  down_kernel            y[pair(row)] = weight[pair] * (h[row] @ w2[e].T + b2[e]), or (ATOMIC)
                         added into out[token(row)]   (SCALED: fp8 h and w2 with block scales)

SCALED (fp8, 128 x 128 weight blocks, activation groups of 128 = BK): each K step's products
land in fresh accumulators, retire, and are added into the sums times the rows' activation
scales and the tile's weight scale.

FOLD (> 0; CONSUMERS = 1, not SCALED, not FUSED): a work tile may hold up to FOLD rows past BM,
an expert's last rows (`routing.route(..., fold)`). The producer loads them as a [FOLD, BK]
side tile each K step, and the consumer multiplies the stage's weight tile(s) by it with the
operands swapped (weight rows in wgmma's M, the side rows in N: a [BN, FOLD] product, issued
before the main wgmma so that the step's wait retires it), then stores those rows after the
tile's own. So an expert's few last rows cost one small wgmma a step, not a work item that
streams the weight tiles again for them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import (
    CachePolicy,
    FractionalEvictionPolicy,
    async_copy,
)
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

BLOCK_M = 128  # two consumer warpgroups of 64 rows
NUM_WARPS = 8  # the default (consumer) partition
PRODUCER_REGS = gl.constexpr(40)  # registers of the producer warp (setmaxnreg)
GATHER_WARPS = gl.constexpr(4)  # the producer that gathers x's rows with cp.async
GATHER_REGS = gl.constexpr(88)  # its registers: row pointers and masks of 8 copies a thread
MAX_REGS = 168  # per-thread cap of the 12 warps (3 warpgroups) on one SM's 64K registers
CONSUMER_REGS = gl.constexpr(208)  # the second consumer warpgroup's (CONSUMERS = 2)
# EVICT_W: the weight tiles of an expert with one work tile are read once: they are loaded to
# be evicted from L2 first, so that they do not push out the activation rows, which every
# column block of a work tile reads again (spread over the time the programs take for them).
WEIGHTS_EVICT_FIRST = gl.constexpr(CachePolicy(l2=FractionalEvictionPolicy("evict_first", 1.0)))


@gluon.constexpr_function
def _acc_layout(BN, num_warps, dtype):
    """wgmma accumulator layout: warps stacked along M (16 rows each), one N instruction of
    32 bytes of K (16 for 16-bit operands, 32 for fp8)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BN, 256 // dtype.primitive_bitwidth],
    )


@gluon.jit
def _side_rows(acc):
    """A side product [BN, FOLD] (weight rows by side rows, a wgmma layout) -> [FOLD, BN] in a
    blocked layout, rows first: the form the epilogues take."""
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [16, 2], [gl.num_warps(), 1], [0, 1])
    return gl.convert_layout(acc, layout).permute((1, 0))


@gluon.jit
def _work_tile(w, num_tiles, num_n, GROUP_M: gl.constexpr):
    """Work item w -> (work tile, column block): GROUP_M work tiles fastest within each column
    block, so that the programs running at once read a weight tile once."""
    width = GROUP_M * num_n
    first = (w // width) * GROUP_M
    size = gl.minimum(num_tiles - first, GROUP_M)
    return first + (w % width) % size, (w % width) // size


@gluon.jit
def _work_item(w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n,
               GROUP_M: gl.constexpr, M_OFF: gl.constexpr = 0):  # fmt: skip
    """Work item w -> (expert, first sorted row, valid rows, column block, work tile)
    (`_work_tile`). M_OFF: the calling partition's first row of the tile (rows and count
    counted from it)."""
    tile, pid_n = _work_tile(w, num_tiles, num_n, GROUP_M)
    expert = gl.load(tile_expert_ptr + tile)
    row0 = gl.load(tile_row0_ptr + tile)
    nrows = gl.load(tile_rows_ptr + tile)
    return expert, row0 + M_OFF, nrows - M_OFF, pid_n, tile


@gluon.jit
def _stage_rows(a_bufs, s, M_OFF: gl.constexpr, BM: gl.constexpr):
    """Stage s's A tile, or its BM rows from M_OFF where the calling partition takes fewer rows
    than the tile has (CONSUMERS = 2)."""
    a = a_bufs.index(s)
    if BM != a_bufs.type.shape[1]:
        a = a.slice(M_OFF, BM)
    return a


@gluon.jit
def _evict_weights(tile, expert, tile_expert_ptr, num_tiles, EVICT_W: gl.constexpr):
    """EVICT_W and work tile `tile` is its expert's only one (an expert's tiles are adjacent);
    False without EVICT_W."""
    if EVICT_W:
        before = gl.load(tile_expert_ptr + tile - 1, mask=tile > 0, other=-1)
        after = gl.load(tile_expert_ptr + tile + 1, mask=tile + 1 < num_tiles, other=-1)
        return (before != expert) & (after != expert)
    else:
        return False


@gluon.jit
def _load_weights(desc, coord, bar, dst, evict):
    """TMA load of a weight tile; evict: L2 evict-first (WEIGHTS_EVICT_FIRST)."""
    if evict:
        tma.async_load(desc, coord, bar, dst, cache_policy=WEIGHTS_EVICT_FIRST)
    else:
        tma.async_load(desc, coord, bar, dst)


@gluon.jit
def _producer(args, TWO_B: gl.constexpr, GROUP_M: gl.constexpr, FOLD: gl.constexpr,
              EVICT_W: gl.constexpr):  # fmt: skip
    """One warp: the TMA loads of every (work item, K step) of this program, at most STAGES
    ahead of the consumer. Weight rows of expert e, column block n0: b_desc at e * b_row_step +
    n0, and (TWO_B) b2_desc at that + b2_row_off. FOLD: a tile of more than BM rows also loads
    its rows from BM on through side_desc (block [FOLD, BK]) into side_bufs."""
    (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, tile_expert_ptr, tile_row0_ptr,
     tile_rows_ptr, num_tiles_ptr, N, K, b_row_step, b2_row_off, side_desc, side_bufs) = args  # fmt: skip
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes * (1 + TWO_B)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n, tile = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        b_row = expert * b_row_step + pid_n * BN
        evict = _evict_weights(tile, expert, tile_expert_ptr, num_tiles, EVICT_W)
        for ki in range(num_k):
            s = count % STAGES
            # stages start free: the first pass waits on the phase before the initial one
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            if FOLD > 0:
                mbarrier.expect(bar, nbytes + side_desc.block_type.nbytes, pred=nrows > BM)
                mbarrier.expect(bar, nbytes, pred=nrows <= BM)
                tma.async_load(side_desc, [row0 + BM, ki * BK], bar, side_bufs.index(s),
                               pred=nrows > BM)  # fmt: skip
            else:
                mbarrier.expect(bar, nbytes)
            tma.async_load(a_desc, [row0, ki * BK], bar, a_bufs.index(s))
            _load_weights(b_desc, [b_row, ki * BK], bar, b_bufs.index(s), evict)
            if TWO_B:
                _load_weights(b2_desc, [b_row + b2_row_off, ki * BK], bar, b2_bufs.index(s),
                              evict)  # fmt: skip
            count += 1


@gluon.jit
def _gathered_rows(x_ptr, stride_xm, sorted_pairs_ptr, top_k, row0, offs, ok, VEC: gl.constexpr):
    """Pointers to x's rows of sorted rows row0 + offs (token = sorted_pairs[row] // top_k;
    rows where not ok point at row 0)."""
    pair = gl.load(sorted_pairs_ptr + row0 + offs, mask=ok, other=0)
    row_off = gl.multiple_of((pair // top_k).to(gl.int64) * stride_xm, VEC)
    return x_ptr + row_off[:, None]


@gluon.jit
def _gather_producer(args, GROUP_M: gl.constexpr, FUSED: gl.constexpr, FOLD: gl.constexpr,
                     EVICT_W: gl.constexpr):  # fmt: skip
    """GATHER_WARPS warps: `_producer` for gate_up without the sorted copy xs: the A tile's rows
    are x's rows of the tile's tokens (token = sorted_pairs[row] // top_k), copied with cp.async
    (16 bytes a thread and copy; rows past the tile's valid ones and columns past K are
    zero-filled; x's row stride a multiple of 16 bytes), each thread arriving on `ready[s]` when
    its copies land (the barrier counts the threads and the weight tiles' expect-tx arrival).
    FUSED: b_bufs [2 * STAGES, BN, BK] takes stage s's gate tile at 2s, its up tile at 2s + 1
    (b2_bufs unused). FOLD: a tile's rows from BM on are copied into side_bufs [STAGES, FOLD,
    BK] the same way."""
    (x_ptr, stride_xm, sorted_pairs_ptr, top_k, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready,
     empty, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, b_row_step,
     b2_row_off, side_bufs) = args  # fmt: skip
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    VEC: gl.constexpr = 128 // a_bufs.dtype.primitive_bitwidth  # elements of a 16-byte copy
    nbytes: gl.constexpr = 2 * b_desc.block_type.nbytes
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BK, BK // VEC],
                                            [GATHER_WARPS, 1], [1, 0])  # fmt: skip
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n, tile = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        b_row = expert * b_row_step + pid_n * BN
        evict = _evict_weights(tile, expert, tile_expert_ptr, num_tiles, EVICT_W)
        row_ok = offs_m < nrows
        a_rows = _gathered_rows(x_ptr, stride_xm, sorted_pairs_ptr, top_k, row0, offs_m, row_ok,
                                VEC)  # fmt: skip
        if FOLD > 0:
            offs_s = gl.arange(0, FOLD, layout=gl.SliceLayout(1, layout))
            side_ok = offs_s < nrows - BM
            side_rows = _gathered_rows(x_ptr, stride_xm, sorted_pairs_ptr, top_k, row0 + BM,
                                       offs_s, side_ok, VEC)  # fmt: skip
        for ki in range(num_k):
            s = count % STAGES
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            if FUSED:
                b_dst = b_bufs.index(2 * s)
                b2_dst = b_bufs.index(2 * s + 1)
            else:
                b_dst = b_bufs.index(s)
                b2_dst = b2_bufs.index(s)
            _load_weights(b_desc, [b_row, ki * BK], bar, b_dst, evict)
            _load_weights(b2_desc, [b_row + b2_row_off, ki * BK], bar, b2_dst, evict)
            cols = gl.max_contiguous(gl.multiple_of(ki * BK + offs_k, VEC), VEC)
            # a partial last step is zero-filled (K is a multiple of VEC: whole 16-byte copies)
            col_ok = gl.max_constancy(cols < K, VEC)
            mask = row_ok[:, None] & col_ok[None, :]
            async_copy.async_load(a_bufs.index(s), a_rows + cols[None, :], mask=mask)
            if FOLD > 0:
                if nrows > BM:
                    async_copy.async_load(side_bufs.index(s), side_rows + cols[None, :],
                                          mask=side_ok[:, None] & col_ok[None, :])  # fmt: skip
            async_copy.mbarrier_arrive(bar, increment_count=False)
            count += 1


@gluon.constexpr_function
def _piece(dtype, num_warps):
    """Elements of a `_zero_piece`: 16 bytes a thread of num_warps warps."""
    return 128 // dtype.primitive_bitwidth * 32 * num_warps


@gluon.jit
def _zero_piece(zero_ptr, zero_numel, i):
    """Zeros over piece i of this program's share of zero_ptr [zero_numel] (a piece: 16 bytes a
    thread of the calling partition; this program's pieces are p, p + programs, ...); nothing
    once past zero_numel (a multiple of 16 bytes)."""
    VEC: gl.constexpr = 128 // zero_ptr.dtype.element_ty.primitive_bitwidth
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [gl.num_warps()], [0])
    PIECE: gl.constexpr = _piece(zero_ptr.dtype.element_ty, gl.num_warps())
    start = (gl.program_id(0) + i * gl.num_programs(0)).to(gl.int64) * PIECE
    if start < zero_numel:
        offs = start + gl.arange(0, PIECE, layout=layout)
        gl.store(zero_ptr + offs, gl.zeros([PIECE], zero_ptr.dtype.element_ty, layout),
                 mask=gl.max_constancy(offs < zero_numel, VEC))  # fmt: skip


@gluon.jit
def _zero_rest(zero_ptr, zero_numel, done):
    """This program's pieces from `done` on (`_zero_piece`): after its work items, whose K steps
    each zeroed one."""
    pieces = gl.cdiv(zero_numel, _piece(zero_ptr.dtype.element_ty, gl.num_warps()))
    for i in range(done, gl.cdiv(pieces - gl.program_id(0), gl.num_programs(0))):
        _zero_piece(zero_ptr, zero_numel, i)


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
def _scale_rows(a_scale_ptr, stride_as, sorted_pairs_ptr, top_k, row0, offs_m, row_ok,
                BY_TOKEN: gl.constexpr):  # fmt: skip
    """Pointers to each tile row's activation scales (SCALED): the token's row of x's scales
    (BY_TOKEN: gate_up's gathered rows) or the sorted row's of h's."""
    if BY_TOKEN:
        pair = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=row_ok, other=0)
        rows = (pair // top_k).to(gl.int64)
    else:
        rows = (row0 + offs_m).to(gl.int64)
    return a_scale_ptr + rows * stride_as


@gluon.jit
def _store_rows(out, y_ptr, stride_ym, row0, nrows, n0, N, sorted_pairs_ptr,
                BY_PAIR: gl.constexpr, MAX_W: gl.constexpr = 128, ATOMIC: gl.constexpr = False,
                top_k=1, pairs=None):  # fmt: skip
    """Store a tile out [BM, W] (y's dtype, any layout) at columns n0 ... of y's rows: tile row
    m to y's row row0 + m, or (BY_PAIR) sorted_pairs[row0 + m], or (ATOMIC) added into y's row
    sorted_pairs[row0 + m] // top_k (the pair's token); rows m >= nrows and columns >= N are
    left alone. Through shared memory into a layout of 16 bytes a thread and row
    first: a wgmma accumulator row holds 4-byte pieces, whose stores write half of each
    32-byte sector (W > MAX_W: in halves, which share the shared memory; FOLD's tiles take
    64, so that the side tiles fit beside the stages; a side tile of a few rows goes whole).
    pairs: sorted_pairs[row0 + m] [BM] already loaded (any layout), else loaded here."""
    BM: gl.constexpr = out.shape[0]
    W: gl.constexpr = out.shape[1]
    if W > MAX_W:
        lo, hi = out.reshape([BM, 2, W // 2]).permute((0, 2, 1)).split()
        _store_rows(lo, y_ptr, stride_ym, row0, nrows, n0, N, sorted_pairs_ptr, BY_PAIR, MAX_W,
                    ATOMIC, top_k, pairs)  # fmt: skip
        _store_rows(hi, y_ptr, stride_ym, row0, nrows, n0 + W // 2, N, sorted_pairs_ptr, BY_PAIR,
                    MAX_W, ATOMIC, top_k, pairs)  # fmt: skip
    else:
        VEC: gl.constexpr = 128 // out.dtype.primitive_bitwidth
        TN: gl.constexpr = min(W // VEC, 32)
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // TN, TN], [gl.num_warps(), 1],
                                                [1, 0])  # fmt: skip
        out = gl.convert_layout(out, layout)
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        # n0 is a multiple of W, y's row stride one of VEC (the engine's H and I rules)
        cols = gl.max_contiguous(gl.multiple_of(n0 + gl.arange(0, W, layout=gl.SliceLayout(
            0, layout)), VEC), VEC)
        row_ok = offs_m < nrows
        if BY_PAIR or ATOMIC:
            if pairs is None:
                rows = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=row_ok, other=0)
            else:
                rows = gl.convert_layout(pairs, gl.SliceLayout(1, layout))
            if ATOMIC:
                rows = rows // top_k
            rows = rows.to(gl.int64)
        else:
            rows = (row0 + offs_m).to(gl.int64)
        row_off = gl.multiple_of(rows * stride_ym, VEC)
        ptrs = y_ptr + row_off[:, None] + cols[None, :]
        mask = row_ok[:, None] & gl.max_constancy(cols < N, VEC)[None, :]
        if ATOMIC:
            gl.atomic_add(ptrs, out, mask=mask, sem="relaxed")
        else:
            gl.store(ptrs, out, mask=mask)


@gluon.jit
def _gate_up_scale_ptrs(w_scale_ptr, stride_wse, stride_wsn, expert, pid_n, N,
                        BN: gl.constexpr, INTERLEAVED: gl.constexpr):  # fmt: skip
    """Pointers to the weight scales (one per K block) of a gate_up work item's gate and up
    tiles: w_scale [E, cdiv(2I, 128), cdiv(H, 128)]; BN = 64 keeps each tile in one 128-row
    block."""
    if INTERLEAVED:  # gate row 2n, up row 2n + 1: one row block of 2 * BN rows
        g_blk = pid_n * BN * 2 // 128
        u_blk = g_blk
    else:  # gate row n, up row N + n
        g_blk = pid_n * BN // 128
        u_blk = (N + pid_n * BN) // 128
    base = w_scale_ptr + expert.to(gl.int64) * stride_wse
    return base + g_blk * stride_wsn, base + u_blk * stride_wsn


@gluon.jit
def _gate_up_store(g, u, expert, row0, nrows, pid_n, bias_ptr, h_ptr, N, stride_be, stride_hm,
                   alpha, limit, BN: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                   INTERLEAVED: gl.constexpr, MAX_W: gl.constexpr = 128):  # fmt: skip
    """Epilogue of gate_up: gate g and up u [BM, BN] (float32, any distributed layout) of a
    work item -> bias, activation, h rows stored (`_store_rows`; rows past nrows left alone)."""
    offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, g.type.layout))
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
        g += gl.load(b_base + g_col, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        u += gl.load(b_base + u_col, mask=col_ok, other=0.0).to(gl.float32)[None, :]
    out = _activate(g, u, alpha, limit, ACT)
    _store_rows(out.to(h_ptr.dtype.element_ty), h_ptr, stride_hm, row0, nrows, pid_n * BN, N,
                h_ptr, False, MAX_W)  # fmt: skip


@gluon.jit
def _gate_up_fused_consumer(args, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                            INTERLEAVED: gl.constexpr, GROUP_M: gl.constexpr,
                            SCALED: gl.constexpr, M_OFF: gl.constexpr,
                            num_warps: gl.constexpr):  # fmt: skip
    """`_gate_up_consumer` (gathered A) with a stage's gate and up tiles the two halves of one
    [2 * BN, BK] buffer (bb_bufs): one wgmma of 2 * BN columns a step (A is read once), the
    accumulator split into gate and up in registers for the epilogue. SCALED: the weight
    scale of each half applied per column."""
    (a_bufs, bb_bufs, ready, empty, bias_ptr, h_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
     num_tiles_ptr, N, K, stride_be, stride_hm, alpha, limit, sorted_pairs_ptr, top_k, a_scale_ptr,
     stride_as, w_scale_ptr, stride_wse, stride_wsn, zero_ptr, zero_numel) = args  # fmt: skip
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = 16 * num_warps  # this partition's rows of a tile, from M_OFF
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN2: gl.constexpr = bb_bufs.type.shape[1]
    BN: gl.constexpr = BN2 // 2
    layout: gl.constexpr = _acc_layout(BN2, num_warps, a_bufs.dtype)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    is_gate = gl.arange(0, BN2, layout=gl.SliceLayout(0, layout)) < BN
    zero = gl.zeros((BM, BN2), dtype=gl.float32, layout=layout)
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n, _ = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M, M_OFF
        )
        row_ok = offs_m < nrows
        acc = zero
        if SCALED:
            a_s_rows = _scale_rows(a_scale_ptr, stride_as, sorted_pairs_ptr, top_k, row0, offs_m,
                                   row_ok, True)  # fmt: skip
            g_s_ptr, u_s_ptr = _gate_up_scale_ptrs(w_scale_ptr, stride_wse, stride_wsn, expert,
                                                   pid_n, N, BN, INTERLEAVED)  # fmt: skip
        for ki in range(num_k):
            s = count % STAGES
            a = _stage_rows(a_bufs, s, M_OFF, BM)
            if SCALED:
                a_s = gl.load(a_s_rows + ki, mask=row_ok, other=0.0)
                col_s = gl.where(is_gate, gl.load(g_s_ptr + ki), gl.load(u_s_ptr + ki))
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            fence_async_shared()  # the gathered A tile: generic-proxy writes
            b = bb_bufs.index(s).permute((1, 0))
            if SCALED:
                p = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                mbarrier.arrive(empty.index(s))
                acc += p * (a_s[:, None] * col_s[None, :])
            else:
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            if M_OFF == 0:  # while the step's wgmma runs
                _zero_piece(zero_ptr, zero_numel, count)
            count += 1
        if not SCALED:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        g, u = acc.reshape([BM, 2, BN]).permute((0, 2, 1)).split()
        _gate_up_store(g, u, expert, row0, nrows, pid_n, bias_ptr, h_ptr, N, stride_be,
                       stride_hm, alpha, limit, BN, ACT, HAS_BIAS, INTERLEAVED)  # fmt: skip
    if M_OFF == 0:
        _zero_rest(zero_ptr, zero_numel, count)


@gluon.jit
def _gate_up_consumer(args, ACT: gl.constexpr, HAS_BIAS: gl.constexpr, INTERLEAVED: gl.constexpr,
                      GROUP_M: gl.constexpr, GATHERED: gl.constexpr, SCALED: gl.constexpr,
                      M_OFF: gl.constexpr, FOLD: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """Two accumulators (gate: b_bufs, up: b2_bufs) per work item; epilogue: bias, activation,
    h rows stored from registers. GATHERED: the A tiles were written by the producer's
    cp.async copies (generic proxy), so a proxy fence orders them before the wgmma reads.
    SCALED (fp8 with 128 x 128 weight blocks and activation groups of 128 = BK): each K step's
    products land in fresh accumulators, which are added in scaled by the step's activation
    scale (per row: x's scales [T, cdiv(H, 128)] by token) and weight scale (one per gate / up
    tile: w_scale [E, cdiv(2I, 128), cdiv(H, 128)]; BN = 64 keeps a tile in one row block).
    FOLD: the side rows (module docstring) in side_bufs."""
    (a_bufs, b_bufs, b2_bufs, ready, empty, bias_ptr, h_ptr, tile_expert_ptr, tile_row0_ptr,
     tile_rows_ptr, num_tiles_ptr, N, K, stride_be, stride_hm, alpha, limit, sorted_pairs_ptr,
     top_k, a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, zero_ptr, zero_numel,
     side_bufs) = args  # fmt: skip
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = 16 * num_warps  # this partition's rows of a tile, from M_OFF
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    STORE_W: gl.constexpr = 64 if FOLD > 0 else 128  # `_store_rows`' MAX_W
    layout: gl.constexpr = _acc_layout(BN, num_warps, a_bufs.dtype)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    zero = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    if FOLD > 0:
        side_zero = gl.zeros((BN, FOLD), dtype=gl.float32,
                             layout=_acc_layout(FOLD, num_warps, a_bufs.dtype))  # fmt: skip
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n, _ = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M, M_OFF
        )
        row_ok = offs_m < nrows
        acc_g = zero
        acc_u = zero
        if FOLD > 0:  # accumulator-typed across the loop: the steps' waits leave them alone
            side_g = warpgroup_mma_init(side_zero)
            side_u = warpgroup_mma_init(side_zero)
        if SCALED:
            a_s_rows = _scale_rows(a_scale_ptr, stride_as, sorted_pairs_ptr, top_k, row0, offs_m,
                                   row_ok, True)  # fmt: skip
            g_s_ptr, u_s_ptr = _gate_up_scale_ptrs(w_scale_ptr, stride_wse, stride_wsn, expert,
                                                   pid_n, N, BN, INTERLEAVED)  # fmt: skip
        for ki in range(num_k):
            s = count % STAGES
            a = _stage_rows(a_bufs, s, M_OFF, BM)
            if SCALED:  # the step's scales load while its operands arrive
                a_s = gl.load(a_s_rows + ki, mask=row_ok, other=0.0)
                g_s = a_s * gl.load(g_s_ptr + ki)
                u_s = a_s * gl.load(u_s_ptr + ki)
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            if GATHERED:
                fence_async_shared()
            if SCALED:
                # fresh products, retired before they are scaled in (ptxas serializes wgmma
                # whose accumulators other instructions read while later ones run); the other
                # warpgroup's wgmma keeps the tensor cores busy meanwhile, if it is not held
                # in step with this one (CONSUMERS = 2)
                p_g = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)  # fmt: skip
                p_u = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)  # fmt: skip
                p_g, p_u = warpgroup_mma_wait(num_outstanding=0, deps=(p_g, p_u))
                mbarrier.arrive(empty.index(s))
                acc_g += p_g * g_s[:, None]
                acc_u += p_u * u_s[:, None]
            else:
                if FOLD > 0:
                    if nrows > BM:  # before the main wgmma: the wait below retires them
                        side = side_bufs.index(s).permute((1, 0))
                        side_g = warpgroup_mma(b_bufs.index(s), side, side_g, is_async=True)
                        side_u = warpgroup_mma(b2_bufs.index(s), side, side_u, is_async=True)
                acc_g = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), acc_u, is_async=True)
                # this step's two wgmma groups may run on; the previous step's have retired
                acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            if M_OFF == 0:  # while the step's wgmma runs
                _zero_piece(zero_ptr, zero_numel, count)
            count += 1
        if not SCALED:
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        _gate_up_store(acc_g, acc_u, expert, row0, nrows, pid_n, bias_ptr, h_ptr, N, stride_be,
                       stride_hm, alpha, limit, BN, ACT, HAS_BIAS, INTERLEAVED,
                       STORE_W)  # fmt: skip
        if FOLD > 0:
            side_g, side_u = warpgroup_mma_wait(num_outstanding=0, deps=(side_g, side_u))
            if nrows > BM:
                _gate_up_store(_side_rows(side_g), _side_rows(side_u), expert, row0 + BM,
                               nrows - BM, pid_n, bias_ptr, h_ptr, N, stride_be, stride_hm,
                               alpha, limit, BN, ACT, HAS_BIAS, INTERLEAVED, BN)  # fmt: skip
    if M_OFF == 0:
        _zero_rest(zero_ptr, zero_numel, count)


@gluon.jit
def gate_up_kernel(xs_desc, side_desc, w_desc, w_up_desc, bias_ptr, h_ptr, tile_expert_ptr,
                   tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, b_row_step, up_row_off,
                   stride_be, stride_hm, alpha, limit, zero_ptr, zero_numel, ACT: gl.constexpr,
                   HAS_BIAS: gl.constexpr, INTERLEAVED: gl.constexpr, STAGES: gl.constexpr,
                   GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, FOLD: gl.constexpr,
                   EVICT_W: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """h [P, N = I] = act(xs @ w13[e].T + b13[e]) per sorted row (module docstring). xs_desc:
    xs [P, H], block [BM, BK]; side_desc: xs, block [FOLD, BK] (FOLD > 0); w_desc / w_up_desc:
    the gate / up weight rows, block [BN, BK]: w13 viewed [E * 2I, H] for both (b_row_step 2I,
    up_row_off I), or, interleaved, the gate rows and the up rows each viewed [E * I, H] with
    row stride 2H (b_row_step I, 0). zero_ptr [zero_numel]: zeroed on the way, a piece each
    K step of the (first) consumer partition (`_zero_piece`; down's output where it adds into
    it); zero_numel 0: nothing."""
    dtype: gl.constexpr = xs_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + xs_desc.block_type.shape, xs_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    b2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_up_desc.block_type.shape,
                                        w_up_desc.layout)  # fmt: skip
    side_bufs = a_bufs  # unused without FOLD
    if FOLD > 0:
        side_bufs = gl.allocate_shared_memory(dtype, [STAGES] + side_desc.block_type.shape,
                                              side_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    consumer = (a_bufs, b_bufs, b2_bufs, ready, empty, bias_ptr, h_ptr, tile_expert_ptr,
                tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, stride_be, stride_hm, alpha,
                limit, tile_expert_ptr, 1, bias_ptr, 0, bias_ptr, 0, 0, zero_ptr, zero_numel,
                side_bufs)  # fmt: skip
    producer = (xs_desc, w_desc, w_up_desc, a_bufs, b_bufs, b2_bufs, ready, empty,
                tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, b_row_step,
                up_row_off, side_desc, side_bufs)  # fmt: skip
    if CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, False, False,
                                     0, FOLD, num_warps)),
                (_producer, (producer, True, GROUP_M, FOLD, EVICT_W)),
            ],
            [1],
            [PRODUCER_REGS],
        )
    else:  # a partition per consumer warpgroup (module docstring); no FOLD
        gl.warp_specialize(
            [
                (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, False, False,
                                     0, 0, num_warps)),
                (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, False, False,
                                     16 * num_warps, 0, num_warps)),
                (_producer, (producer, True, GROUP_M, 0, EVICT_W)),
            ],
            [num_warps, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


@gluon.jit
def gate_up_gather_kernel(x_ptr, stride_xm, sorted_pairs_ptr, top_k, w_desc, w_up_desc, bias_ptr,
                          h_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N,
                          K, b_row_step, up_row_off, stride_be, stride_hm, alpha, limit,
                          zero_ptr, zero_numel, x_scale_ptr, stride_xs, w_scale_ptr, stride_wse,
                          stride_wsn, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                          INTERLEAVED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                          BM: gl.constexpr, A_LAYOUT: gl.constexpr, SCALED: gl.constexpr,
                          FUSED: gl.constexpr, BB_LAYOUT: gl.constexpr, CONSUMERS: gl.constexpr,
                          FOLD: gl.constexpr, EVICT_W: gl.constexpr,
                          num_warps: gl.constexpr):  # fmt: skip
    """`gate_up_kernel` reading x [T, H] directly (x_ptr, row stride stride_xm): the producer
    gathers each tile's rows (`_gather_producer`), so no sorted copy xs is made. A_LAYOUT: the
    shared layout of an A tile [BM, BK] (BK = the weight block's). SCALED: x and w13 are fp8
    with block scales (`_gate_up_consumer`): x_scale [T, cdiv(H, 128)] (row stride stride_xs),
    w_scale [E, cdiv(2I, 128), cdiv(H, 128)] (strides stride_wse, stride_wsn). FUSED: a stage's
    gate and up tiles are adjacent, read as one [2 * BN, BK] tile of shared layout BB_LAYOUT
    (`_gate_up_fused_consumer`; the same swizzle as the weight tiles': 128-byte rows). FOLD
    (CONSUMERS = 1, neither SCALED nor FUSED): side rows (module docstring), stored in
    A_LAYOUT's swizzle. zero_ptr, zero_numel: as in `gate_up_kernel`."""
    dtype: gl.constexpr = w_desc.dtype
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_LAYOUT)
    side_bufs = a_bufs  # unused without FOLD
    if FOLD > 0:
        side_bufs = gl.allocate_shared_memory(dtype, [STAGES, FOLD, BK], A_LAYOUT)
    if FUSED:  # stage s's gate tile at 2s, up at 2s + 1: together one [2 * BN, BK] tile
        b_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BN, BK], w_desc.layout)
        b2_bufs = b_bufs
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
        b2_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_up_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        # the weight tiles' expect-tx arrival, and one cp.async arrival per producer thread
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    producer = (x_ptr, stride_xm, sorted_pairs_ptr, top_k, w_desc, w_up_desc, a_bufs, b_bufs,
                b2_bufs, ready, empty, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                num_tiles_ptr, N, K, b_row_step, up_row_off, side_bufs)  # fmt: skip
    shared = (ready, empty, bias_ptr, h_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
              num_tiles_ptr, N, K, stride_be, stride_hm, alpha, limit, sorted_pairs_ptr, top_k,
              x_scale_ptr, stride_xs, w_scale_ptr, stride_wse, stride_wsn, zero_ptr,
              zero_numel)  # fmt: skip
    if FUSED:
        bb_bufs = b_bufs.reinterpret(dtype, [STAGES, 2 * BN, BK], BB_LAYOUT)
        consumer = (a_bufs, bb_bufs) + shared
        if CONSUMERS == 1:
            gl.warp_specialize(
                [
                    (_gate_up_fused_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M,
                                               SCALED, 0, num_warps)),
                    (_gather_producer, (producer, GROUP_M, FUSED, 0, EVICT_W)),
                ],
                [GATHER_WARPS],
                [GATHER_REGS],
            )
        else:  # a partition per consumer warpgroup (module docstring)
            gl.warp_specialize(
                [
                    (_gate_up_fused_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M,
                                               SCALED, 0, num_warps)),
                    (_gate_up_fused_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M,
                                               SCALED, 16 * num_warps, num_warps)),
                    (_gather_producer, (producer, GROUP_M, FUSED, 0, EVICT_W)),
                ],
                [num_warps, GATHER_WARPS],
                [CONSUMER_REGS, GATHER_REGS],
            )
    else:
        consumer = (a_bufs, b_bufs, b2_bufs) + shared + (side_bufs,)
        if CONSUMERS == 1:
            gl.warp_specialize(
                [
                    (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, True,
                                         SCALED, 0, FOLD, num_warps)),
                    (_gather_producer, (producer, GROUP_M, FUSED, FOLD, EVICT_W)),
                ],
                [GATHER_WARPS],
                [GATHER_REGS],
            )
        else:  # a partition per consumer warpgroup (module docstring)
            gl.warp_specialize(
                [
                    (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, True,
                                         SCALED, 0, 0, num_warps)),
                    (_gate_up_consumer, (consumer, ACT, HAS_BIAS, INTERLEAVED, GROUP_M, True,
                                         SCALED, 16 * num_warps, 0, num_warps)),
                    (_gather_producer, (producer, GROUP_M, FUSED, 0, EVICT_W)),
                ],
                [num_warps, GATHER_WARPS],
                [CONSUMER_REGS, GATHER_REGS],
            )


@gluon.jit
def _down_store(acc, expert, row0, nrows, n0, bias_ptr, y_ptr, topk_weights_ptr,
                sorted_pairs_ptr, top_k, N, stride_be, stride_ym, HAS_BIAS: gl.constexpr,
                ATOMIC: gl.constexpr, MAX_W: gl.constexpr, pair=None, weight=None):  # fmt: skip
    """Epilogue of down: rows [BM', BN] (float32, any distributed layout) of sorted rows row0 ...
    (nrows valid), columns n0 ...: bias, routing weight, stored by pair (or added by token).
    pair, weight: the rows' pairs and routing weights [BM'] (acc's row layout) loaded before
    (`_down_consumer` EARLY), else loaded here."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
    n_out = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
    row_ok = offs_m < nrows
    col_ok = n_out < N
    if HAS_BIAS:
        acc += gl.load(bias_ptr + expert.to(gl.int64) * stride_be + n_out, mask=col_ok,
                       other=0.0).to(gl.float32)[None, :]  # fmt: skip
    if pair is None:
        pair = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=row_ok, other=0)
        acc = acc * gl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        _store_rows(acc.to(y_ptr.dtype.element_ty), y_ptr, stride_ym, row0, nrows, n0, N,
                    sorted_pairs_ptr, True, MAX_W, ATOMIC, top_k)  # fmt: skip
    else:
        acc = acc * weight[:, None]
        _store_rows(acc.to(y_ptr.dtype.element_ty), y_ptr, stride_ym, row0, nrows, n0, N,
                    sorted_pairs_ptr, True, MAX_W, ATOMIC, top_k, pair)  # fmt: skip


@gluon.jit
def _down_consumer(args, HAS_BIAS: gl.constexpr, ATOMIC: gl.constexpr, GROUP_M: gl.constexpr,
                   SCALED: gl.constexpr, M_OFF: gl.constexpr, FOLD: gl.constexpr,
                   EARLY: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """One accumulator per work item; epilogue: bias, routing weight, store by pair (or atomic
    add by token) from registers. SCALED: as `_gate_up_consumer`, with h's scales [P,
    cdiv(I, 128)] by sorted row and w2's [E, cdiv(H, 128), cdiv(I, 128)] (BN = 128: one row
    block a tile). FOLD: the side rows (module docstring) in side_bufs. EARLY: the tile's pairs
    and routing weights are loaded before its K loop, so that the epilogue does not wait for
    them."""
    (a_bufs, b_bufs, ready, empty, bias_ptr, y_ptr, topk_weights_ptr, sorted_pairs_ptr,
     tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, top_k, N, K, stride_be,
     stride_ym, a_scale_ptr, stride_as, w_scale_ptr, stride_wse, stride_wsn, side_bufs) = args  # fmt: skip
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = 16 * num_warps  # this partition's rows of a tile, from M_OFF
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    STORE_W: gl.constexpr = 64 if FOLD > 0 else 128  # `_store_rows`' MAX_W
    layout: gl.constexpr = _acc_layout(BN, num_warps, a_bufs.dtype)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    zero = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    if FOLD > 0:
        side_zero = gl.zeros((BN, FOLD), dtype=gl.float32,
                             layout=_acc_layout(FOLD, num_warps, a_bufs.dtype))  # fmt: skip
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    num_tiles = gl.load(num_tiles_ptr)
    count = 0
    for w in range(gl.program_id(0), num_tiles * num_n, gl.num_programs(0)):
        expert, row0, nrows, pid_n, _ = _work_item(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M, M_OFF
        )
        acc = zero
        if EARLY:
            pair_ok = offs_m < nrows
            pair = gl.load(sorted_pairs_ptr + row0 + offs_m, mask=pair_ok, other=0)
            weight = gl.load(topk_weights_ptr + pair, mask=pair_ok, other=0.0)
        else:  # `_down_store` loads them
            pair = None
            weight = None
        if FOLD > 0:  # accumulator-typed across the loop, as in `_gate_up_consumer`
            side_acc = warpgroup_mma_init(side_zero)
        if SCALED:
            row_ok = offs_m < nrows
            a_s_rows = _scale_rows(a_scale_ptr, stride_as, sorted_pairs_ptr, top_k, row0, offs_m,
                                   row_ok, False)  # fmt: skip
            w_s_ptr = (w_scale_ptr + expert.to(gl.int64) * stride_wse
                       + (pid_n * BN // 128) * stride_wsn)  # fmt: skip
        for ki in range(num_k):
            s = count % STAGES
            a = _stage_rows(a_bufs, s, M_OFF, BM)
            if SCALED:
                scale = gl.load(a_s_rows + ki, mask=row_ok, other=0.0) * gl.load(w_s_ptr + ki)
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            if SCALED:  # as in `_gate_up_consumer`
                p = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)  # fmt: skip
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                mbarrier.arrive(empty.index(s))
                acc += p * scale[:, None]
            else:
                if FOLD > 0:
                    if nrows > BM:  # before the main wgmma: the wait below retires it
                        side_acc = warpgroup_mma(b_bufs.index(s), side_bufs.index(s).permute(
                            (1, 0)), side_acc, is_async=True)  # fmt: skip
                acc = warpgroup_mma(a, b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=ki > 0)
            count += 1
        if not SCALED:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        _down_store(acc, expert, row0, nrows, pid_n * BN, bias_ptr, y_ptr, topk_weights_ptr,
                    sorted_pairs_ptr, top_k, N, stride_be, stride_ym, HAS_BIAS, ATOMIC, STORE_W,
                    pair, weight)  # fmt: skip
        if FOLD > 0:
            side_acc = warpgroup_mma_wait(num_outstanding=0, deps=(side_acc,))
            if nrows > BM:
                _down_store(_side_rows(side_acc), expert, row0 + BM, nrows - BM, pid_n * BN,
                            bias_ptr, y_ptr, topk_weights_ptr, sorted_pairs_ptr, top_k, N,
                            stride_be, stride_ym, HAS_BIAS, ATOMIC, BN)  # fmt: skip


@gluon.jit
def down_kernel(h_desc, side_desc, w_desc, bias_ptr, y_ptr, topk_weights_ptr, sorted_pairs_ptr,
                tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, top_k, N, K,
                stride_be, stride_ym, h_scale_ptr, stride_hs, w_scale_ptr, stride_wse,
                stride_wsn, HAS_BIAS: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr,
                GROUP_M: gl.constexpr, SCALED: gl.constexpr, CONSUMERS: gl.constexpr,
                FOLD: gl.constexpr, EVICT_W: gl.constexpr, EARLY: gl.constexpr,
                num_warps: gl.constexpr):  # fmt: skip
    """y = weight * (h @ w2[e].T + b2[e]) per sorted row (module docstring); N = H, K = I.
    h_desc: h [P, I], block [BM, BK]; side_desc: h, block [FOLD, BK] (FOLD > 0; CONSUMERS = 1,
    not SCALED); w_desc: w2 viewed [E * H, I], block [BN, BK]. y [P, H] by pair, or (ATOMIC)
    out [T, H], zeroed before, by token. SCALED: h and w2 are fp8 with block scales
    (`_down_consumer`): h_scale [P, cdiv(I, 128)] (row stride stride_hs), w_scale [E,
    cdiv(H, 128), cdiv(I, 128)]."""
    dtype: gl.constexpr = h_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    side_bufs = a_bufs  # unused without FOLD
    if FOLD > 0:
        side_bufs = gl.allocate_shared_memory(dtype, [STAGES] + side_desc.block_type.shape,
                                              side_desc.layout)  # fmt: skip
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    consumer = (a_bufs, b_bufs, ready, empty, bias_ptr, y_ptr, topk_weights_ptr,
                sorted_pairs_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles_ptr,
                top_k, N, K, stride_be, stride_ym, h_scale_ptr, stride_hs, w_scale_ptr,
                stride_wse, stride_wsn, side_bufs)  # fmt: skip
    producer = (h_desc, w_desc, w_desc, a_bufs, b_bufs, b_bufs, ready, empty, tile_expert_ptr,
                tile_row0_ptr, tile_rows_ptr, num_tiles_ptr, N, K, N, 0, side_desc,
                side_bufs)  # fmt: skip
    if CONSUMERS == 1:
        gl.warp_specialize(
            [
                (_down_consumer, (consumer, HAS_BIAS, ATOMIC, GROUP_M, SCALED, 0, FOLD, EARLY,
                                  num_warps)),
                (_producer, (producer, False, GROUP_M, FOLD, EVICT_W)),
            ],
            [1],
            [PRODUCER_REGS],
        )
    else:  # a partition per consumer warpgroup (module docstring); no FOLD
        gl.warp_specialize(
            [
                (_down_consumer, (consumer, HAS_BIAS, ATOMIC, GROUP_M, SCALED, 0, 0, EARLY,
                                  num_warps)),
                (_down_consumer, (consumer, HAS_BIAS, ATOMIC, GROUP_M, SCALED, 16 * num_warps, 0,
                                  EARLY, num_warps)),
                (_producer, (producer, False, GROUP_M, 0, EVICT_W)),
            ],
            [num_warps, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
