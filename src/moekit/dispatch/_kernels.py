"""Triton kernels for moving token rows (see `moekit.dispatch.rows` for the wrappers and the
PyTorch twins). One program handles one destination row and BLOCK_H columns."""

import triton
import triton.language as tl


@triton.jit
def _gather_reduce_kernel(
    src_ptr, rows_ptr, w_ptr, out_ptr, M, H, stride_src, stride_out,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[n] = sum_k w[n, k] * src[rows[n, k]] over the k with 0 <= rows[n, k] < M (fp32 sum)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        row = tl.load(rows_ptr + n * K + k).to(tl.int64)
        ok = (row >= 0) & (row < M)
        safe = tl.where(ok, row, 0)
        v = tl.load(src_ptr + safe * stride_src + offs, mask=hmask & ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + n * K + k)
        acc += tl.where(ok, v, 0.0)
    tl.store(out_ptr + n * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, dest_ptr, out_ptr, M, H, stride_src, stride_out,
    K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[dest[n, k]] = src[n] for the k with 0 <= dest[n, k] < M (a bit copy)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    v = tl.load(src_ptr + n * stride_src + offs, mask=hmask)
    for k in range(K):
        d = tl.load(dest_ptr + n * K + k).to(tl.int64)
        ok = (d >= 0) & (d < M)
        safe = tl.where(ok, d, 0)
        tl.store(out_ptr + safe * stride_out + offs, v, mask=hmask & ok)


def _block(H: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(max(H, 1))))


def launch_gather_reduce(src, rows, weights, out):
    N, K = rows.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, triton.cdiv(H, block))
    _gather_reduce_kernel[grid](
        src, rows, weights if weights is not None else rows, out, src.shape[0], H,
        src.stride(0), out.stride(0), K=K, HAS_W=weights is not None, BLOCK_H=block,
        num_warps=4,
    )


def launch_scatter_rows(src, dest, out):
    N, K = dest.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, triton.cdiv(H, block))
    _scatter_rows_kernel[grid](
        src, dest, out, out.shape[0], H, src.stride(0), out.stride(0), K=K, BLOCK_H=block,
        num_warps=4,
    )


@triton.jit
def _ll_send_plan_kernel(
    ids_ptr, w_ptr, table_ptr, copies_ptr, rows_ptr, send_ids_ptr, send_w_ptr,
    T, L, W, E, C, R, stride_meta,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPREAD: tl.constexpr,
):
    """Program r lays out block r of the low-latency send buffer: the tokens with an expert on
    rank r, in token order, get rows r*C + 0, 1, ...; their meta rows hold local ids (-1 for
    experts elsewhere) and weights; rows past them get ids -1. rows[t, r] = the row, or R*C."""
    r = tl.program_id(0)
    t = tl.arange(0, BT)[:, None]
    k = tl.arange(0, BK)[None, :]
    mask = (t < T) & (k < K)
    ids = tl.load(ids_ptr + t * K + k, mask=mask, other=-1).to(tl.int64)
    row = tl.where(ids < 0, L, ids)
    if SPREAD:
        copies = tl.load(copies_ptr + row, mask=mask, other=1)
        choice = t % copies
    else:
        choice = tl.zeros([BT, BK], dtype=tl.int64)
    slot = tl.load(table_ptr + row * W + choice, mask=mask, other=-1)
    lo = r * E
    here = mask & (slot >= lo) & (slot < lo + E)
    hit = tl.max(here.to(tl.int32), axis=1)  # [BT]
    pos = tl.cumsum(hit, axis=0) - 1
    n = tl.sum(hit, axis=0)
    tv = tl.arange(0, BT)
    out_row = (r * C + pos).to(tl.int64)
    tl.store(rows_ptr + tv * R + r, tl.where(hit > 0, out_row, R * C), mask=tv < T)
    used = (hit > 0)[:, None] & (k < K)
    w = tl.load(w_ptr + t * K + k, mask=mask, other=0.0)
    meta = out_row[:, None] * stride_meta + k
    tl.store(send_ids_ptr + meta, tl.where(here, slot - lo, -1).to(tl.int32), mask=used)
    tl.store(send_w_ptr + meta, tl.where(here, w, 0.0), mask=used)
    j = tl.arange(0, BT)[:, None]
    free = (j >= n) & (j < C) & (k < K)
    meta_free = (r * C + j).to(tl.int64) * stride_meta + k
    tl.store(send_ids_ptr + meta_free, tl.full([BT, BK], -1, tl.int32), mask=free)
    tl.store(send_w_ptr + meta_free, tl.zeros([BT, BK], dtype=tl.float32), mask=free)


@triton.jit
def _ll_recv_plan_kernel(
    ids_ptr, w_ptr, dest_ptr, counts_ptr, w_out_ptr, N, RC, E, stride_meta,
    K: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program e numbers the received (row, k) pairs of local expert e in (row, k) order:
    dest = e * RC + position, counts[e] = how many. Program 0 also marks unused pairs
    (dest = E * RC) and copies the weights out contiguously."""
    e = tl.program_id(0)
    count = e * 0  # an int32 tensor: the loop-carried type stays the same
    for start in range(0, N, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        m = idx < N
        meta = (idx // K).to(tl.int64) * stride_meta + idx % K
        ids = tl.load(ids_ptr + meta, mask=m, other=-1)
        match = m & (ids == e)
        pos = tl.cumsum(match.to(tl.int32), axis=0) - 1 + count
        tl.store(dest_ptr + idx, (e * RC + pos).to(tl.int64), mask=match)
        if e == 0:
            tl.store(dest_ptr + idx, tl.zeros([BLOCK], dtype=tl.int64) + E * RC,
                     mask=m & (ids < 0))
            tl.store(w_out_ptr + idx, tl.load(w_ptr + meta, mask=m, other=0.0), mask=m)
        count += tl.sum(match.to(tl.int32), axis=0)
    tl.store(counts_ptr + e, count)


def launch_ll_send_plan(ids, weights, table, copies, spread, rows, send_ids, send_w, E, C, R):
    T, K = ids.shape
    L, W = table.shape[0] - 1, table.shape[1]
    BT = max(16, triton.next_power_of_2(C))
    BK = max(2, triton.next_power_of_2(K))
    _ll_send_plan_kernel[(R,)](
        ids, weights, table, copies, rows, send_ids, send_w, T, L, W, E, C, R,
        send_ids.stride(0), K=K, BT=BT, BK=BK, SPREAD=spread, num_warps=4,
    )


def launch_ll_recv_plan(recv_ids, recv_w, dest, counts, w_out, E):
    RC, K = recv_ids.shape
    _ll_recv_plan_kernel[(E,)](
        recv_ids, recv_w, dest, counts, w_out, RC * K, RC, E, recv_ids.stride(0),
        K=K, BLOCK=1024, num_warps=4,
    )


@triton.jit
def _normal_plan_kernel(
    ids_ptr, table_ptr, copies_ptr, slot_ptr, pos_ptr, counts_ptr, offsets_ptr,
    T, L, W, E,
    R: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPREAD: tl.constexpr,
):
    """Program r, over all tokens in blocks of BT: pos[t, r] = the rank-r position (0, 1, ...,
    in token order) of token t among the tokens with an expert on rank r, -1 if none;
    counts[r] = how many; offsets[r] = sum of counts[q] for q < r (each token counted once per
    rank it hits). Program 0 also writes slot[t, k] (physical slot, -1 where masked)."""
    r = tl.program_id(0)
    count = r * 0  # int32 tensors: the loop-carried types stay the same
    below = r * 0
    kk = tl.arange(0, BK)
    k = kk[None, :]
    earlier = kk[None, :, None] < kk[None, None, :]  # [1, k', k]: k' before k
    for start in range(0, T, BT):
        tv = start + tl.arange(0, BT)
        t = tv[:, None]
        mask = (t < T) & (k < K)
        ids = tl.load(ids_ptr + t.to(tl.int64) * K + k, mask=mask, other=-1).to(tl.int64)
        row = tl.where(ids < 0, L, ids)
        if SPREAD:
            copies = tl.load(copies_ptr + row, mask=mask, other=1)
            choice = t % copies
        else:
            choice = tl.zeros([BT, BK], dtype=tl.int64)
        slot = tl.load(table_ptr + row * W + choice, mask=mask, other=-1)
        if r == 0:
            tl.store(slot_ptr + t.to(tl.int64) * K + k, slot.to(tl.int32), mask=mask)
        rk = tl.where(mask & (slot >= 0), slot // E, -1)  # [BT, BK] rank of each pair
        hit = tl.max((rk == r).to(tl.int32), axis=1)  # [BT]
        pos = tl.cumsum(hit, axis=0) - 1 + count
        tl.store(pos_ptr + tv.to(tl.int64) * R + r, tl.where(hit > 0, pos, -1), mask=tv < T)
        count += tl.sum(hit, axis=0)
        # distinct ranks below r per token: pairs whose rank no earlier pair of the token has
        same = rk[:, :, None] == rk[:, None, :]  # [BT, k', k]
        dup = tl.max((same & earlier).to(tl.int32), axis=1)  # [BT, k]
        first = (rk >= 0) & (rk < r) & (dup == 0)
        below += tl.sum(tl.sum(first.to(tl.int32), axis=1), axis=0)
    tl.store(counts_ptr + r, count.to(tl.int64))
    tl.store(offsets_ptr + r, below.to(tl.int64))


@triton.jit
def _pack_rows_kernel(
    src_ptr, slot_ptr, w_ptr, pos_ptr, offsets_ptr, rows_ptr, out_ptr, ids_out_ptr, w_out_ptr,
    NW, E, stride_src, stride_out, stride_meta, meta_off,
    R: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (t, h) copies words [h*BLOCK, (h+1)*BLOCK) of payload row t to send row
    offsets[r] + pos[t, r] for every rank r the token hits; program (t, 0) also writes those
    rows' metadata (local ids on rank r, -1 elsewhere; weights, 0 elsewhere) and
    rows[t, r] = the send row (-1 where the token does not go to r)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = h * BLOCK + tl.arange(0, BLOCK)
    m = offs < NW
    v = tl.load(src_ptr + t * stride_src + offs, mask=m)
    kk = tl.arange(0, BK)
    km = kk < K
    slot = tl.load(slot_ptr + t * K + kk, mask=km, other=-1)
    w = tl.load(w_ptr + t * K + kk, mask=km, other=0.0)
    for r in tl.static_range(R):
        p = tl.load(pos_ptr + t * R + r)
        ok = p >= 0
        d = tl.load(offsets_ptr + r) + p.to(tl.int64)
        tl.store(out_ptr + d * stride_out + offs, v, mask=m & ok)
        if h == 0:
            here = (slot >= r * E) & (slot < r * E + E)
            meta = d * stride_meta + meta_off + kk
            tl.store(ids_out_ptr + meta, tl.where(here, slot - r * E, -1).to(tl.int32),
                     mask=km & ok)
            tl.store(w_out_ptr + meta + K, tl.where(here, w, 0.0), mask=km & ok)
            tl.store(rows_ptr + t * R + r, tl.where(ok, d, -1))


def launch_normal_plan(ids, table, copies, spread, slot, pos, counts, offsets, E, R):
    T, K = ids.shape
    L, W = table.shape[0] - 1, table.shape[1]
    BK = max(2, triton.next_power_of_2(K))
    BT = max(16, min(256, 2048 // BK))
    _normal_plan_kernel[(R,)](
        ids, table, copies, slot, pos, counts, offsets, T, L, W, E,
        R=R, K=K, BT=BT, BK=BK, SPREAD=spread, num_warps=4,
    )


def launch_pack_rows(src_words, slot, weights, pos, offsets, rows, out_words, out_i32, out_f32,
                     meta_off, E):
    T, NW = src_words.shape
    R = pos.shape[1]
    K = slot.shape[1]
    block = max(16, min(2048, triton.next_power_of_2(max(NW, 1))))
    grid = (T, triton.cdiv(max(NW, 1), block))
    _pack_rows_kernel[grid](
        src_words, slot, weights, pos, offsets, rows, out_words, out_i32, out_f32,
        NW, E, src_words.stride(0), out_words.stride(0), out_i32.stride(0), meta_off,
        R=R, K=K, BK=max(2, triton.next_power_of_2(K)), BLOCK=block, num_warps=4,
    )
