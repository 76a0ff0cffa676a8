"""Triton kernels of the `triton_kernel` runner (private: wrappers in `routing.py` and `ops.py`).

Vocabulary: T tokens, K top-k, P = T*K (token, k) pairs with pair index p = t*K + k, E local
experts, H hidden, I intermediate, BM rows of one work tile (all of one expert).

Routing (a stable counting sort of the pairs by expert, no padding):
  _chunk_hist_kernel   one program per chunk of CHUNK pairs: histogram over experts (+ a bucket
                       E for masked ids) -> hist [NC, EP]
  _scan_tiles_kernel   one program: per-chunk bases (prefix over chunks), per-expert counts and
                       offsets, the number of work tiles
  _scatter_kernel      one program per chunk: sorted_pairs[offsets[e] + base[c, e] + rank] = p,
                       and a slice of the work tile list (expert, first row, rows) of BM rows;
                       with SCAN it sums the chunk histograms itself (no scan kernel before it)
Grouped GEMMs over (tile, column block) work items whose number is read on device (a fixed
persistent grid loops over them, or one program per possible item):
  _gate_up_kernel      h[row] = act(x[token(row)] @ w13[e].T + b13[e]); the token gather is the
                       A-operand load, the activation the epilogue; h in sorted row order
  _down_kernel         y[pair(row)] = weight[pair] * (h[row] @ w2[e].T + b2[e]); the scatter
                       back to pair order is the epilogue's store (then a sum over K per token),
                       or (ATOMIC) an atomic add into out[token(row)]
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.runners._triton_common import (
    activate,
    chunk_sums,
    desc_w_tile,
    load_a_tile,
    load_w_tile,
    sort_chunk,
    tile_coords,
    zero_fill,
)

# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["P"])
def _chunk_hist_kernel(ids_ptr, hist_ptr, P, E, CHUNK: tl.constexpr, EP: tl.constexpr):
    """hist[c, :] = histogram of the experts of pairs [c*CHUNK, (c+1)*CHUNK); masked ids
    (-1 or >= E) and lanes past P count in bucket E."""
    c = tl.program_id(0)
    pair = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + pair, mask=pair < P, other=-1)
    e = tl.where((e >= 0) & (e < E), e, E)
    hist = tl.histogram(e, EP)
    tl.store(hist_ptr + c * EP + tl.arange(0, EP), hist)


@triton.jit(do_not_specialize=["P", "num_chunks"])
def _scan_tiles_kernel(
    hist_ptr,
    base_ptr,
    counts_ptr,
    offsets_ptr,
    num_tiles_ptr,
    P,
    E,
    num_chunks,
    BLOCK_M: tl.constexpr,
    EP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FOLD: tl.constexpr = 0,
):
    """One program. base[c, e] = pairs of expert e in chunks before c; counts[e] (e < E);
    offsets[e] = first sorted row of expert e for e <= E (offsets[E] = valid pairs; masked
    pairs follow them); num_tiles = sum of `_expert_tiles`."""
    cols = tl.arange(0, EP)
    running = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        ok = (c < num_chunks)[:, None]
        h = tl.load(hist_ptr + c[:, None] * EP + cols[None, :], mask=ok, other=0)
        before = tl.cumsum(h, 0) - h + running[None, :]
        tl.store(base_ptr + c[:, None] * EP + cols[None, :], before, mask=ok)
        running += tl.sum(h, 0)
    counts = tl.where(cols < E, running, 0)
    tl.store(counts_ptr + cols, counts, mask=cols < E)
    offsets = tl.cumsum(counts, 0) - counts  # offsets[E] = sum of counts (valid pairs)
    tl.store(offsets_ptr + cols, offsets, mask=cols <= E)

    tl.store(num_tiles_ptr, tl.sum(_expert_tiles(counts, BLOCK_M, FOLD), 0))


@triton.jit
def _expert_tiles(counts, BLOCK_M: tl.constexpr, FOLD: tl.constexpr):
    """Work tiles of experts with `counts` rows: cdiv(count, BM), one fewer where a last tile
    of 1 ... FOLD rows follows a full one (the full tile takes those rows too)."""
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    if FOLD > 0:
        tail = counts % BLOCK_M
        tiles -= ((counts > BLOCK_M) & (tail > 0) & (tail <= FOLD)).to(tl.int32)
    return tiles


@triton.jit
def _write_tiles(
    counts, offsets, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, t_lo, t_hi, E,
    BLOCK_M: tl.constexpr, EP: tl.constexpr, BLOCK_T: tl.constexpr, FOLD: tl.constexpr,
):  # fmt: skip
    """Work tiles t in [t_lo, t_hi) from counts and offsets [EP] (0 past E): expert e owns
    `_expert_tiles` tiles, in expert order; tile j of e covers sorted rows [offsets[e] + j*BM,
    + rows): BM rows, or what is left of the expert where that fits in BM + FOLD rows. Past the
    last tile: expert -1, 0 rows."""
    cols = tl.arange(0, EP)
    tiles = _expert_tiles(counts, BLOCK_M, FOLD)
    tile_end = tl.cumsum(tiles, 0)
    tile_start = tile_end - tiles
    num_tiles = tl.sum(tiles, 0)
    # experts >= E own no tile: their end never counts below a tile index
    end_key = tl.where(cols < E, tile_end, 2147483647)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        expert = tl.sum((end_key[None, :] <= t[:, None]).to(tl.int32), 1)
        onehot = cols[None, :] == expert[:, None]
        first = tl.sum(tl.where(onehot, (offsets - tile_start * BLOCK_M)[None, :], 0), 1)
        seg_end = tl.sum(tl.where(onehot, (offsets + counts)[None, :], 0), 1)
        row0 = first + t * BLOCK_M
        rows = seg_end - row0
        rows = tl.where(rows <= BLOCK_M + FOLD, rows, BLOCK_M)
        live = t < num_tiles
        in_range = t < t_hi
        tl.store(tile_expert_ptr + t, tl.where(live, expert, -1), mask=in_range)
        tl.store(tile_row0_ptr + t, tl.where(live, row0, 0), mask=in_range)
        tl.store(tile_rows_ptr + t, tl.where(live, rows, 0), mask=in_range)


@triton.jit(do_not_specialize=["P", "num_chunks", "tiles_per_program", "max_tiles"])
def _scatter_kernel(
    ids_ptr, hist_ptr, base_ptr, counts_ptr, offsets_ptr, num_tiles_ptr, sorted_pairs_ptr,
    tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, P, E, num_chunks, tiles_per_program,
    max_tiles, CHUNK: tl.constexpr, EP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, FOLD: tl.constexpr = 0,
    SCAN: tl.constexpr = False,
):  # fmt: skip
    """sorted_pairs[offsets[e] + base[c, e] + rank] = pair, for the pairs of chunk c (rank:
    position among the chunk's pairs of expert e, in pair order: a stable sort). Masked pairs
    (bucket E) land after the valid ones, so sorted_pairs is a permutation of [0, P). Program
    c also writes work tiles [c, c + 1) * tiles_per_program (`_write_tiles`).
    SCAN: base, counts and offsets are not read but summed here from hist [num_chunks, EP]
    (BLOCK_C chunks at a time), and program 0 stores counts, offsets and num_tiles."""
    c = tl.program_id(0)
    cols = tl.arange(0, EP)
    if SCAN:
        total, base = chunk_sums(hist_ptr, num_chunks, c, EP, BLOCK_C)
        counts = tl.where(cols < E, total, 0)
        offsets = tl.cumsum(counts, 0) - counts  # offsets[E] = valid pairs
        if c == 0:
            tl.store(counts_ptr + cols, counts, mask=cols < E)
            tl.store(offsets_ptr + cols, offsets, mask=cols <= E)
            tl.store(num_tiles_ptr, tl.sum(_expert_tiles(counts, BLOCK_M, FOLD), 0))
    else:
        counts = tl.load(counts_ptr + cols, mask=cols < E, other=0)
        offsets = tl.load(offsets_ptr + cols, mask=cols <= E, other=0)
        base = tl.load(base_ptr + c * EP + cols)
    t_lo = c * tiles_per_program
    _write_tiles(counts, tl.where(cols < E, offsets, 0), tile_expert_ptr, tile_row0_ptr,
                 tile_rows_ptr, t_lo, tl.minimum(t_lo + tiles_per_program, max_tiles), E,
                 BLOCK_M, EP, BLOCK_T, FOLD)  # fmt: skip
    sorted_e, sorted_pair, rank, _ = sort_chunk(ids_ptr, c * CHUNK, P, E, CHUNK, EP)
    dest = tl.gather(offsets + base, sorted_e, 0) + rank
    tl.store(sorted_pairs_ptr + dest, sorted_pair, mask=sorted_pair < P)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs (persistent)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _work_tile(
    w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M: tl.constexpr
):
    """Work item w -> (expert, first sorted row, valid rows, column block)."""
    tile, pid_n = tile_coords(w, num_tiles, num_n, GROUP_M)
    expert = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_row0_ptr + tile)
    nrows = tl.load(tile_rows_ptr + tile)
    return expert, row0, nrows, pid_n


@triton.jit
def _w_tile(w_ptrs, w_desc, row, k0, k_left, USE_TMA: tl.constexpr, EVEN_K: tl.constexpr,
            BLOCK_K: tl.constexpr):  # fmt: skip
    """Weight tile [BLOCK_K, rows] at (row, k0): TMA (out-of-bounds reads zero) or pointers."""
    if USE_TMA:
        b = desc_w_tile(w_desc, row, k0)
    else:
        b = load_w_tile(w_ptrs, k_left, EVEN_K, BLOCK_K)
    return b


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    w_desc_up,
    b_ptr,
    h_ptr,
    zero_ptr,
    zero_numel,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_row0_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    top_k,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    alpha,
    limit,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ONE_TILE: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ZERO_OUT: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """h[row, n] = act(x[token] @ w13[e, gate(n)] + b, x[token] @ w13[e, up(n)] + b), n < N = I,
    for each sorted row (token = sorted_pairs[row] // top_k). x [T, K=H], w13 [E, 2I, H]: gate
    rows n and up rows I + n, or (INTERLEAVED) 2n and 2n + 1. Two accumulators (gate, up);
    TMA (USE_TMA): w_desc = w_desc_up = w13 viewed [E * 2I, H], block [BLOCK_N, BLOCK_K]; or,
    interleaved, w_desc = the gate rows and w_desc_up = the up rows, each viewed [E * I, H] with
    a row stride of 2H. INTERLEAVED and ONE_TILE: instead one accumulator over 2 * BLOCK_N
    consecutive rows, split in the epilogue (w_desc [E * 2I, H], block [2 * BLOCK_N, BLOCK_K]).
    h [P, I].
    ZERO_OUT: first zero zero_ptr[0:zero_numel] (the output the atomic down GEMM adds into).
    FLATTEN / WARP_SPEC: the work loop's `tl.range` flags (pipelining across work items,
    automatic warp specialization)."""
    if ZERO_OUT:
        zero_fill(zero_ptr, zero_numel, tl.program_id(0), tl.num_programs(0), 1024)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for w in tl.range(tl.program_id(0), num_tiles * num_n, tl.num_programs(0), flatten=FLATTEN,
                      warp_specialize=WARP_SPEC):
        expert, row0, nrows, pid_n = _work_tile(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        row_ok = offs_m < nrows
        rows = row0 + offs_m
        pair = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
        token = (pair // top_k).to(tl.int64)
        a_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]
        n0 = pid_n * BLOCK_N
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        e_row = expert * (2 * N)
        if INTERLEAVED and ONE_TILE:
            wrows = (2 * n0 + tl.arange(0, 2 * BLOCK_N)) % (2 * N)
            w_ptrs = w_base + wrows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for ki in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - ki * BLOCK_K
                a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
                b = _w_tile(w_ptrs, w_desc, e_row + 2 * n0, ki * BLOCK_K, k_left, USE_TMA,
                            EVEN_K, BLOCK_K)  # fmt: skip
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            if HAS_BIAS:
                b_rows = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
                bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + b_rows,
                               mask=b_rows < 2 * N, other=0.0)  # fmt: skip
                acc += bias.to(tl.float32)[None, :]
            acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            n_rows = (n0 + tl.arange(0, BLOCK_N)) % N
            if INTERLEAVED:  # gate row 2n, up row 2n + 1; TMA: w_desc / w_desc_up [E * I, H]
                g_rows = 2 * n_rows
                u_step = 1
                g_row0 = expert * N + n0
                u_row0 = g_row0
            else:  # gate row n, up row I + n; TMA: w_desc [E * 2I, H] for both
                g_rows = n_rows
                u_step = N
                g_row0 = e_row + n0
                u_row0 = e_row + N + n0
            g_ptrs = w_base + g_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            u_ptrs = g_ptrs + u_step * stride_wn
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for ki in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - ki * BLOCK_K
                a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
                bg = _w_tile(g_ptrs, w_desc, g_row0, ki * BLOCK_K, k_left, USE_TMA, EVEN_K,
                             BLOCK_K)  # fmt: skip
                bu = _w_tile(u_ptrs, w_desc_up, u_row0, ki * BLOCK_K, k_left, USE_TMA, EVEN_K,
                             BLOCK_K)  # fmt: skip
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            if HAS_BIAS:
                b_base = b_ptr + expert.to(tl.int64) * stride_be
                acc_g += tl.load(b_base + g_rows).to(tl.float32)[None, :]
                acc_u += tl.load(b_base + g_rows + u_step).to(tl.float32)[None, :]
        act = activate(acc_g, acc_u, alpha, limit, ACT)
        n_out = n0 + tl.arange(0, BLOCK_N)
        h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_hm + n_out[None, :]
        tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (n_out[None, :] < N))  # fmt: skip


@triton.jit
def _down_kernel(
    h_ptr,
    h_desc,
    w_ptr,
    w_desc,
    b_ptr,
    y_ptr,
    topk_weights_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_row0_ptr,
    tile_rows_ptr,
    num_tiles_ptr,
    top_k,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ATOMIC: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """y[pair, n] = weight[pair] * (h[row] @ w2[e, n] + b2[e, n]) for each sorted row
    (pair = sorted_pairs[row]), N = H columns, K = I. h [P, I] in sorted row order (rows of a
    tile are contiguous: h_desc, block [BLOCK_M, BLOCK_K], reads them by TMA; rows past the
    tile's end are read but not stored). w_desc: w2 viewed [E * H, I], block [BLOCK_N,
    BLOCK_K]. y [P, H]: rows of masked pairs are not written. ATOMIC: instead add the weighted
    row into y[token = pair // top_k] (y [T, H], zeroed before): the sum over K fused into
    the epilogue, in a run-dependent order."""
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for w in tl.range(tl.program_id(0), num_tiles * num_n, tl.num_programs(0), flatten=FLATTEN,
                      warp_specialize=WARP_SPEC):
        expert, row0, nrows, pid_n = _work_tile(
            w, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr, num_tiles, num_n, GROUP_M
        )
        row_ok = offs_m < nrows
        rows = row0 + offs_m
        n0 = pid_n * BLOCK_N
        offs_n = (n0 + tl.arange(0, BLOCK_N)) % N
        a_ptrs = h_ptr + tl.where(row_ok, rows, row0).to(tl.int64)[:, None] * stride_hm \
            + offs_k[None, :]  # fmt: skip
        b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
                  + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None])  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for ki in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - ki * BLOCK_K
            if USE_TMA:
                a = h_desc.load([row0, ki * BLOCK_K])
            else:
                a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
            b = _w_tile(b_ptrs, w_desc, expert * N + n0, ki * BLOCK_K, k_left, USE_TMA, EVEN_K,
                        BLOCK_K)  # fmt: skip
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n).to(tl.float32)[None, :]
        pair = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        n_out = n0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (n_out[None, :] < N)
        if ATOMIC:
            y_rows = (pair // top_k).to(tl.int64)
        else:
            y_rows = pair.to(tl.int64)
        y_ptrs = y_ptr + y_rows[:, None] * stride_ym + n_out[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask, sem="relaxed")
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
