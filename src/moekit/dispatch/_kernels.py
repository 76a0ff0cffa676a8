"""Triton kernels for moving token rows (see `moekit.dispatch.rows` for the wrappers and the
PyTorch twins). One program handles one destination row and BLOCK_H columns."""

import torch
import triton
import triton.language as tl

from moekit._triton_host import cdiv, next_pow2, pdl_capable


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


@triton.jit
def _dequant_scatter_kernel(
    src_ptr, scale_ptr, dest_ptr, out_ptr, M, H, stride_src, stride_scale, stride_out,
    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[dest[n, k]] = fp8 row n (bytes at src) * its group scales (float32 words at
    scale_ptr), in out's dtype, for the k with 0 <= dest[n, k] < M."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    q = tl.load(src_ptr + n * stride_src + offs, mask=hmask, other=0)
    s = tl.load(scale_ptr + n * stride_scale + offs // GROUP, mask=hmask, other=0.0)
    v = (q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(out_ptr.dtype.element_ty)
    for k in range(K):
        d = tl.load(dest_ptr + n * K + k).to(tl.int64)
        ok = (d >= 0) & (d < M)
        safe = tl.where(ok, d, 0)
        tl.store(out_ptr + safe * stride_out + offs, v, mask=hmask & ok)


def launch_dequant_scatter(src_u8, scale_f32, dest, out, group):
    N, K = dest.shape
    H = out.shape[1]
    block = max(group, min(2048, next_pow2(max(H, 1))))
    grid = (N, cdiv(H, block))
    _dequant_scatter_kernel[grid](
        src_u8, scale_f32, dest, out, out.shape[0], H, src_u8.stride(0), scale_f32.stride(0),
        out.stride(0), K=K, GROUP=group, BLOCK_H=block, num_warps=4,
    )


def _block(H: int) -> int:
    return max(16, min(1024, next_pow2(max(H, 1))))


def launch_gather_reduce(src, rows, weights, out):
    N, K = rows.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, cdiv(H, block))
    _gather_reduce_kernel[grid](
        src, rows, weights if weights is not None else rows, out, src.shape[0], H,
        src.stride(0), out.stride(0), K=K, HAS_W=weights is not None, BLOCK_H=block,
        num_warps=4,
    )


def launch_scatter_rows(src, dest, out):
    N, K = dest.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, cdiv(H, block))
    _scatter_rows_kernel[grid](
        src, dest, out, out.shape[0], H, src.stride(0), out.stride(0), K=K, BLOCK_H=block,
        num_warps=4,
    )


@triton.jit
def _physical_slots(ids_ptr, table_ptr, copies_ptr, t, k, K, L, W, mask, SPREAD: tl.constexpr):
    """Physical slot of each (token t [BT, 1], k [1, BK]) pair (-1 where masked or unplaced):
    the logical id's row of the placement table (row L for ids < 0); with SPREAD, copy
    t % copies[id] of a replicated expert, else its first copy."""
    ids = tl.load(ids_ptr + t.to(tl.int64) * K + k, mask=mask, other=-1).to(tl.int64)
    row = tl.where(ids < 0, L, ids)
    if SPREAD:
        choice = t % tl.load(copies_ptr + row, mask=mask, other=1)
    else:
        choice = tl.zeros(ids.shape, dtype=tl.int64)
    return tl.load(table_ptr + row * W + choice, mask=mask, other=-1)


@triton.jit
def _local_ids_kernel(ids_ptr, table_ptr, copies_ptr, out_ptr, T, L, W, start, E,
                      K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SPREAD: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program b maps tokens b*BT .. b*BT + BT-1: out = physical slot - start where the slot is
    on this rank (in [start, start + E)), -1 elsewhere and for masked ids. PDL (launched as a
    programmatic dependent launch): let the next kernel be placed, then wait for the ids."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0) * BT + tl.arange(0, BT)[:, None]
    k = tl.arange(0, BK)[None, :]
    mask = (t < T) & (k < K)
    slot = _physical_slots(ids_ptr, table_ptr, copies_ptr, t, k, K, L, W, mask, SPREAD)
    here = (slot >= start) & (slot < start + E)
    tl.store(out_ptr + t.to(tl.int64) * K + k, tl.where(here, slot - start, -1).to(tl.int32),
             mask=mask)


def launch_local_ids(ids, table, copies, spread, out, start, E):
    T, K = ids.shape
    BK = max(2, next_pow2(K))
    BT = max(1, 1024 // BK)
    pdl = pdl_capable(ids.device)  # chained between the routing and the runner's kernels
    _local_ids_kernel[(cdiv(T, BT),)](
        ids, table, copies, out, T, table.shape[0] - 1, table.shape[1], start, E,
        K=K, BT=BT, BK=BK, SPREAD=spread, PDL=pdl, num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
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
    slot = _physical_slots(ids_ptr, table_ptr, copies_ptr, t, k, K, L, W, mask, SPREAD)
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
    BT = max(16, next_pow2(C))
    BK = max(2, next_pow2(K))
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
    ids_ptr, table_ptr, copies_ptr, slot_ptr, local_ptr, bcount_ptr, base_ptr, counts_ptr,
    ticket_ptr, args_ptr, T, L, W, E, NB, BPC, NC,
    R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    NBP: tl.constexpr, NCMAX: tl.constexpr, SPREAD: tl.constexpr, INDIRECT: tl.constexpr,
):
    """Program b plans tokens [b*BT, (b+1)*BT): slot[t, k] (physical slot, -1 masked),
    local[t, r] = position of t among the block's tokens with an expert on rank r (-1 if none),
    bcount[b, r] = how many. The last program to finish (a ticket counter, left at 0 for the
    next launch) lays out the chunks (BPC blocks each) back to back, and in each chunk the
    rank blocks back to back: counts[r, c] = rows of chunk c for rank r (counts is
    [R, NCMAX + 1]; column NCMAX gets T) and base[b, r] = the send row of block b's first
    token for rank r.
    INDIRECT (a launch a CUDA graph replays for new inputs): T and the ids pointer come from
    args [T, ids address, ...] int64 on the device, the grid covers the graph's capacity, and
    the chunk size follows T: BPC = max(1, cdiv(cdiv(T, BT), NC))."""
    if INDIRECT:
        T = tl.load(args_ptr).to(tl.int32)
        ids_ptr = tl.load(args_ptr + 1).to(tl.pointer_type(tl.int32))
        BPC = tl.maximum(tl.cdiv(tl.cdiv(T, BT), NC), 1)
    b = tl.program_id(0)
    tv = b * BT + tl.arange(0, BT)
    t = tv[:, None]
    k = tl.arange(0, BK)[None, :]
    mask = (t < T) & (k < K)
    slot = _physical_slots(ids_ptr, table_ptr, copies_ptr, t, k, K, L, W, mask, SPREAD)
    tl.store(slot_ptr + t.to(tl.int64) * K + k, slot.to(tl.int32), mask=mask)
    rk = tl.where(mask & (slot >= 0), slot // E, -1)  # [BT, BK] rank of each pair
    rr = tl.arange(0, RP)
    hit = tl.max((rk[:, :, None] == rr[None, None, :]).to(tl.int32), axis=1)  # [BT, RP]
    loc = tl.cumsum(hit, axis=0) - 1
    out_mask = (tv < T)[:, None] & (rr < R)[None, :]
    tl.store(local_ptr + tv.to(tl.int64)[:, None] * R + rr[None, :], tl.where(hit > 0, loc, -1),
             mask=out_mask)
    tl.store(bcount_ptr + b * R + rr, tl.sum(hit, axis=0), mask=rr < R)
    # every thread's stores of this program before the (one-thread) release of the ticket
    tl.debug_barrier()
    done = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if done == NB - 1:  # every block count is written: the prefix sums, in one [NBP, RP] tile
        tl.debug_barrier()
        rm = rr < R
        cb = tl.arange(0, NBP)
        m2 = (cb < NB)[:, None] & rm[None, :]
        n = tl.load(bcount_ptr + cb[:, None] * R + rr[None, :], mask=m2, other=0,
                    volatile=True).to(tl.int64)
        excl = tl.cumsum(n, axis=0) - n  # rows of rank r in the blocks before b
        chunk = (cb // BPC)[:, None]
        base = tl.zeros([NBP, RP], dtype=tl.int64)
        for c in tl.static_range(NCMAX):
            total = tl.sum(tl.where(chunk == c, n, 0), axis=0)  # [RP] rows of chunk c per rank
            before = tl.sum(tl.where(chunk < c, n, 0), axis=0)  # [RP] rows of earlier chunks
            first = tl.sum(before, axis=0) + tl.cumsum(total, axis=0) - total  # rank block starts
            base = tl.where(chunk == c, first[None, :] + excl - before[None, :], base)
            tl.store(counts_ptr + rr * (NCMAX + 1) + c, total, mask=rm)
        tl.store(base_ptr + cb[:, None] * R + rr[None, :], base, mask=m2)
        tl.store(counts_ptr + rr * (NCMAX + 1) + NCMAX, tl.zeros([RP], dtype=tl.int64) + T,
                 mask=rm)
        tl.store(ticket_ptr, 0)


@triton.jit
def _pack_rows_kernel(
    src_ptr, slot_ptr, w_ptr, local_ptr, base_ptr, rows_ptr, out_ptr, meta_ptr, args_ptr,
    dst_ptr, t0, NW, E, stride_src, stride_out, stride_meta, META_W,
    R: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr,
    INDIRECT: tl.constexpr, REMOTE: tl.constexpr,
):
    """Program (i, h), token t = t0 + i, copies words [h*BLOCK, (h+1)*BLOCK) of payload row t
    to send row d = base[t // BT, r] + local[t, r] for every rank r the token hits; program
    (i, 0) also writes the row's metadata meta[d] (K local ids on rank r, -1 elsewhere; then
    the K weights' bits, 0 elsewhere; meta may be a view into the same rows) and
    rows[t, r] = d (-1 where the token does not go to r).
    INDIRECT (a launch a CUDA graph replays): args [T, ids address, payload address (int32
    words), weights address, payload row stride in words] int64 on the device; programs of
    tokens t >= T do nothing.
    REMOTE (peer-to-peer normal mode): rank r's rows go to the int32 words at address
    dst[r] (int64 [R + 1]: per rank the address of send row 0 in the numbering above, i.e.
    shifted to where this rank's rows start in rank r's receive buffer; dst[R] = 0: write no
    rows, only rows[]), the metadata META_W words into each row; out / meta unused."""
    t = t0 + tl.program_id(0).to(tl.int64)
    if INDIRECT:
        live = t < tl.load(args_ptr)
        src_ptr = tl.load(args_ptr + 2).to(tl.pointer_type(tl.int32))
        w_ptr = tl.load(args_ptr + 3).to(tl.pointer_type(tl.float32))
        stride_src = tl.load(args_ptr + 4)
    else:
        live = t >= 0
    h = tl.program_id(1)
    offs = h * BLOCK + tl.arange(0, BLOCK)
    m = (offs < NW) & live
    v = tl.load(src_ptr + t * stride_src + offs, mask=m)
    kk = tl.arange(0, BK)
    km = (kk < K) & live
    slot = tl.load(slot_ptr + t * K + kk, mask=km, other=-1)
    w = tl.load(w_ptr + t * K + kk, mask=km, other=0.0)
    b = t // BT
    for r in tl.static_range(R):
        p = tl.load(local_ptr + t * R + r, mask=live, other=-1)
        ok = (p >= 0) & live
        d = tl.load(base_ptr + b * R + r, mask=live, other=0) + p.to(tl.int64)
        if REMOTE:
            go = ok & (tl.load(dst_ptr + R) != 0)
            row_r = tl.load(dst_ptr + r).to(tl.pointer_type(tl.int32)) + d * stride_out
            tl.store(row_r + offs, v, mask=m & go)
            meta_r = row_r + META_W
        else:
            go = ok
            tl.store(out_ptr + d * stride_out + offs, v, mask=m & ok)
            meta_r = meta_ptr + d * stride_meta
        if h == 0:
            here = (slot >= r * E) & (slot < r * E + E)
            tl.store(meta_r + kk, tl.where(here, slot - r * E, -1).to(tl.int32), mask=km & go)
            tl.store(meta_r + kk + K, tl.where(here, w, 0.0).to(tl.int32, bitcast=True),
                     mask=km & go)
            tl.store(rows_ptr + t * R + r, tl.where(ok, d, -1), mask=live)


def launch_normal_plan(ids, table, copies, spread, slot, local, bcount, base, counts, ticket,
                       E, R, block, blocks_per_chunk, args=None, num_chunks=1):
    """args: INDIRECT (see the kernel); ids then only gives the capacity T and K."""
    T, K = ids.shape
    L, W = table.shape[0] - 1, table.shape[1]
    NB = bcount.shape[0]
    RP = max(2, next_pow2(R))
    BK = max(2, next_pow2(K))
    NBP = max(2, next_pow2(NB))  # the layout's block size keeps NBP * RP small
    _normal_plan_kernel[(NB,)](
        ids, table, copies, slot, local, bcount, base, counts, ticket,
        args if args is not None else ticket, T, L, W, E, NB, blocks_per_chunk, num_chunks,
        R=R, RP=RP, K=K, BK=BK, BT=block, NBP=NBP, NCMAX=counts.shape[1] - 1, SPREAD=spread,
        INDIRECT=args is not None, num_warps=4 if block * BK * RP <= 8192 else 8,
    )


def launch_pack_rows(src_words, slot, weights, local, base, rows, out_words, meta, E, block,
                     t0, t1, args=None, dst=None, meta_words=0):
    """args: INDIRECT (see the kernel); src_words / weights then only give the shapes (and the
    payload must be int32 words). dst: REMOTE (see the kernel): int64 [R + 1], out_words /
    meta then only give the row stride (int32 words); meta_words: the metadata's offset in a
    row (words)."""
    NW = src_words.shape[1]
    R = local.shape[1]
    K = slot.shape[1]
    if dst is None and (meta.shape[1] != 2 * K or meta.stride(1) != 1 or meta.dtype.itemsize != 4):
        raise ValueError(f"pack_rows: meta must be [N, {2 * K}] 4-byte words, rows contiguous")
    if dst is not None and (out_words.dtype != torch.int32 or src_words.dtype != torch.int32
                            or meta_words + 2 * K > out_words.shape[1]):
        raise ValueError("pack_rows REMOTE: int32 payload and rows with room for the metadata")
    bw = max(16, min(2048, next_pow2(max(NW, 1))))
    grid = (t1 - t0, cdiv(max(NW, 1), bw))
    _pack_rows_kernel[grid](
        src_words, slot, weights, local, base, rows, out_words, meta,
        args if args is not None else rows, dst if dst is not None else rows, t0, NW, E,
        src_words.stride(0), out_words.stride(0), meta.stride(0), meta_words, R=R, K=K,
        BK=max(2, next_pow2(K)), BT=block, BLOCK=bw, INDIRECT=args is not None,
        REMOTE=dst is not None, num_warps=4,
    )


# ---- peer-to-peer normal mode (moekit.dispatch.p2p) ------------------------------------------


@triton.jit
def _p2p_offsets_kernel(
    hdr_ptrs, recv_ptrs, back_ptrs, counts_ptr, dst_ptr, ret_ptr, bounds_ptr, me, cap_rows,
    row_bytes, back_row_bytes, R: tl.constexpr, RP: tl.constexpr, NC: tl.constexpr,
    NCP: tl.constexpr,
):
    """One program, once every rank has published its counts header [R, NC] in symmetric
    memory (hdr_ptrs [R]: their addresses; row r: rows it sends to rank r in column 0, its T
    in column NC - 1). M[s, r] = rows rank s sends to rank r; ok = every rank receives at
    most cap_rows rows and sends at most cap_rows (the buffers' room: the same verdict on
    every rank). Writes
    counts [2, R, NC]: this rank's header | row `me` of every rank's header (as the NCCL
    counts exchange gives them);
    dst [R + 1]: recv_ptrs[r] + (rows of ranks < me in r's buffer - rows this rank sends to
    ranks < r) * row_bytes, the address of this rank's send row 0 shifted into r's receive
    buffer (see _pack_rows_kernel REMOTE); dst[R] = ok;
    bounds [R + 1]: the first received row of each source rank, then the total;
    ret [R]: back_ptrs[s] + (rows s sends to ranks < me - bounds[s]) * back_row_bytes, the
    address of received row 0 shifted into rank s's return buffer."""
    s1 = tl.arange(0, RP)
    s = s1[:, None]
    r = s1[None, :]
    m = (s < R) & (r < R)
    hdr_s = tl.load(hdr_ptrs + s, mask=s < R, other=0).to(tl.pointer_type(tl.int64))
    M = tl.load(hdr_s + r * NC, mask=m, other=0, volatile=True)  # [RP, RP]
    ok = (tl.max(tl.sum(M, axis=0), axis=0) <= cap_rows) & \
        (tl.max(tl.sum(M, axis=1), axis=0) <= cap_rows)
    mine = tl.sum(tl.where(s == me, M, 0), axis=0)  # [RP] over r: rows this rank sends to r
    above = tl.sum(tl.where(s < me, M, 0), axis=0)  # [RP] over r: rows of ranks < me in r
    recv_r = tl.load(recv_ptrs + s1, mask=s1 < R, other=0)
    tl.store(dst_ptr + s1, recv_r + (above - (tl.cumsum(mine, axis=0) - mine)) * row_bytes,
             mask=s1 < R)
    tl.store(dst_ptr + R, ok.to(tl.int64))
    col = tl.sum(tl.where(r == me, M, 0), axis=1)  # [RP] over s: rows s sends here
    first = tl.cumsum(col, axis=0) - col
    tl.store(bounds_ptr + s1, first, mask=s1 < R)
    tl.store(bounds_ptr + R, tl.sum(col, axis=0))
    before = tl.sum(tl.where(r < me, M, 0), axis=1)  # [RP] over s: rows s sends to ranks < me
    back_s = tl.load(back_ptrs + s1, mask=s1 < R, other=0)
    tl.store(ret_ptr + s1, back_s + (before - first) * back_row_bytes, mask=s1 < R)
    c = tl.arange(0, NCP)[None, :]
    cm = (s < R) & (c < NC)
    own = tl.load(hdr_ptrs + me).to(tl.pointer_type(tl.int64))
    tl.store(counts_ptr + s * NC + c, tl.load(own + s * NC + c, mask=cm, other=0), mask=cm)
    theirs = tl.load(hdr_s + me * NC + c, mask=cm, other=0, volatile=True)
    tl.store(counts_ptr + R * NC + s * NC + c, theirs, mask=cm)


@triton.jit
def _push_back_kernel(src_ptr, ret_ptr, bounds_ptr, back_ptr, H, stride_src, NH,
                      R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program p: source rank s = p % R, then column block h and row j of that source's
    received rows (consecutive programs write to different ranks, so every link is busy):
    received row i = bounds[s] + j (if < bounds[s + 1]), columns [h*BLOCK_H, ...) -> row i
    of the rows of H elements of back_ptr's type at address ret[s] (converted to that type)."""
    pid = tl.program_id(0)
    s = pid % R
    rest = pid // R
    h = rest % NH
    i = tl.load(bounds_ptr + s) + (rest // NH)
    offs = h * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (offs < H) & (i < tl.load(bounds_ptr + s + 1))
    dst = tl.load(ret_ptr + s).to(tl.pointer_type(back_ptr.dtype.element_ty))
    v = tl.load(src_ptr + i * stride_src + offs, mask=m)
    tl.store(dst + i * H + offs, v.to(back_ptr.dtype.element_ty), mask=m)


def launch_p2p_offsets(hdr_ptrs, recv_ptrs, back_ptrs, counts, dst, ret, bounds, me, cap_rows,
                       row_bytes, back_row_bytes):
    """See _p2p_offsets_kernel; counts [2, R, NC] int64."""
    R, NC = counts.shape[1], counts.shape[2]
    _p2p_offsets_kernel[(1,)](
        hdr_ptrs, recv_ptrs, back_ptrs, counts, dst, ret, bounds, me, cap_rows, row_bytes,
        back_row_bytes, R=R, RP=max(2, next_pow2(R)), NC=NC,
        NCP=max(2, next_pow2(NC)), num_warps=1,
    )


def launch_push_back(src, ret, bounds, back, max_rows):
    """src [N, H] rows (unit last stride) -> the return buffers (see _push_back_kernel); back:
    a [rows, H] tensor of the return buffers' dtype; max_rows: the most rows any source rank
    sent. Rows of whole 4-byte words in the same dtype move as int32 words, 8 kB a program
    (as the packing kernel does)."""
    N, H = src.shape
    if N == 0 or H == 0 or max_rows == 0:
        return
    nbytes = H * src.element_size()
    if (src.dtype == back.dtype and nbytes % 4 == 0 and (src.stride(0) * src.element_size()) % 4
            == 0 and src.data_ptr() % 4 == 0):
        src, back, H = src.view(torch.int32), back.view(torch.int32), nbytes // 4
        bh = max(16, min(2048, next_pow2(H)))
    else:
        bh = _block(H)
    R, nh = ret.shape[0], cdiv(H, bh)
    _push_back_kernel[(R * nh * max_rows,)](src, ret, bounds, back, H, src.stride(0), nh, R=R,
                                            BLOCK_H=bh, num_warps=4)
