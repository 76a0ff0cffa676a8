"""Triton kernels of the token alignment (private; the wrapper is `moekit.runners._align`):
sort the P (token, k) pairs by expert into blocks of BM rows (padding at the end of each
expert's segment), on device, with shapes fixed by (P, E, BM) only (CUDA-graph safe)."""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.runners._triton_common import chunk_sums, sort_chunk


@triton.jit
def _padded_layout(cnt, BLOCK_M: tl.constexpr):
    """Per-expert counts cnt [EP] -> first and end row [EP] of each expert's segment, padded
    to a multiple of BLOCK_M."""
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    return pad_end - padded, pad_end


@triton.jit
def _write_layout(
    cnt,
    sorted_ids_ptr,
    num_rows_ptr,
    counts_ptr,
    ends_ptr,
    P,
    E,
    BLOCK_M: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """From the per-expert counts cnt [EP] (0 past E): write the padded row total and the
    padding sentinels (value P) at the end of each expert's segment; with GROUPS also the
    counts [E] and padded end rows [E]. Returns the first and the end padded row of each
    expert ([EP] each)."""
    pad_start, pad_end = _padded_layout(cnt, BLOCK_M)
    tl.store(num_rows_ptr, tl.sum(pad_end - pad_start, 0))
    if GROUPS:
        ee = tl.arange(0, EP)
        tl.store(counts_ptr + ee, cnt, mask=ee < E)
        tl.store(ends_ptr + ee, pad_end, mask=ee < E)
    # padding sentinels: rows [pad_start + cnt, pad_end) of each expert
    fill_from = pad_start + cnt
    fill_len = pad_end - fill_from
    sentinel = tl.zeros([EP, PAD_STEP], dtype=tl.int32) + P
    for j in tl.static_range(0, BLOCK_M, PAD_STEP):
        col = j + tl.arange(0, PAD_STEP)
        tl.store(
            sorted_ids_ptr + fill_from[:, None] + col[None, :],
            sentinel,
            mask=col[None, :] < fill_len[:, None],
        )
    return pad_start, pad_end


@triton.jit
def _write_block_experts(
    block_expert_ptr, pad_end, E, b_begin, b_end,
    BLOCK_M: tl.constexpr, BLOCKS_STEP: tl.constexpr,
):  # fmt: skip
    """block_expert[b] for b in [b_begin, b_end): the number of experts whose padded segment
    ends at or before the block's first row (-1 past the last used block)."""
    for b0 in range(b_begin, b_end, BLOCKS_STEP):
        b = b0 + tl.arange(0, BLOCKS_STEP)
        before = (pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32)
        e = tl.sum(before, 1)
        tl.store(block_expert_ptr + b, tl.where(e < E, e, -1), mask=b < b_end)


@triton.jit
def _align_small_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    counts_ptr,
    ends_ptr,
    P,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,
    GROUPS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program does the whole alignment (P <= CHUNK). PDL (a programmatic dependent
    launch): let the next kernel be placed at once; wait for the previous one's writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    sorted_e, sorted_pair, rank, hist = sort_chunk(ids_ptr, 0, P, E, CHUNK, EP)
    cnt = tl.where(tl.arange(0, EP) < E, hist, 0)
    pad_start, pad_end = _write_layout(
        cnt, sorted_ids_ptr, num_rows_ptr, counts_ptr, ends_ptr, P, E, BLOCK_M, EP, PAD_STEP,
        GROUPS,
    )  # fmt: skip
    _write_block_experts(block_expert_ptr, pad_end, E, 0, max_blocks, BLOCK_M, BLOCKS_STEP)
    dest = tl.gather(pad_start, sorted_e, 0) + rank
    tl.store(sorted_ids_ptr + dest, sorted_pair, mask=sorted_e < E)


@triton.jit
def _align_chunk_kernel(
    ids_ptr, expert_ptr, pair_ptr, rank_ptr, hist_ptr, P, E,
    CHUNK: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    """Pass 1 of 3 (or 2; P > CHUNK): sort each chunk; store its sorted pairs and histogram
    [EP]."""
    c = tl.program_id(0)
    sorted_e, sorted_pair, rank, hist = sort_chunk(ids_ptr, c * CHUNK, P, E, CHUNK, EP)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    tl.store(expert_ptr + offs, sorted_e)
    tl.store(pair_ptr + offs, sorted_pair)
    tl.store(rank_ptr + offs, rank)
    tl.store(hist_ptr + c * EP + tl.arange(0, EP), hist)


@triton.jit
def _align_scan_kernel(
    hist_ptr,
    base_ptr,
    pad_end_ptr,
    sorted_ids_ptr,
    num_rows_ptr,
    counts_ptr,
    ends_ptr,
    num_chunks,
    P,
    E,
    BLOCK_M: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    CB: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """Pass 2 of 3 (one program): totals per expert, the padded layout (pad_end [EP] stored for
    pass 3), and base[c, e] = the row where chunk c's pairs of expert e start. Chunks are
    read CB at a time as [CB, EP] tiles."""
    ee = tl.arange(0, EP)
    cc = tl.arange(0, CB)
    cnt = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        m = (c0 + cc)[:, None] < num_chunks
        tile = tl.load(hist_ptr + (c0 + cc)[:, None] * EP + ee[None, :], mask=m, other=0)
        cnt += tl.sum(tile, 0)
    cnt = tl.where(ee < E, cnt, 0)
    pad_start, pad_end = _write_layout(
        cnt, sorted_ids_ptr, num_rows_ptr, counts_ptr, ends_ptr, P, E, BLOCK_M, EP, PAD_STEP,
        GROUPS,
    )  # fmt: skip
    tl.store(pad_end_ptr + ee, pad_end)
    running = pad_start
    for c0 in range(0, num_chunks, CB):
        m = (c0 + cc)[:, None] < num_chunks
        offs = (c0 + cc)[:, None] * EP + ee[None, :]
        tile = tl.load(hist_ptr + offs, mask=m, other=0)
        incl = tl.cumsum(tile, 0)
        tl.store(base_ptr + offs, running[None, :] + incl - tile, mask=m)
        running += tl.sum(tile, 0)


@triton.jit
def _align_scatter_kernel(
    expert_ptr, pair_ptr, rank_ptr, hist_ptr, base_ptr, pad_end_ptr, sorted_ids_ptr,
    block_expert_ptr, num_rows_ptr, counts_ptr, ends_ptr, num_chunks, P, E, max_blocks,
    blocks_per_program, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EP: tl.constexpr,
    BLOCKS_STEP: tl.constexpr, PAD_STEP: tl.constexpr, CB: tl.constexpr,
    GROUPS: tl.constexpr, SCAN: tl.constexpr,
):  # fmt: skip
    """Pass 3 of 3: each sorted pair goes to base[c, expert] + rank; program c also writes the
    expert of its share of the blocks. SCAN (pass 2 of 2): base and pad_end are not read but
    summed here from hist [num_chunks, EP] (CB chunks at a time), and program 0 writes what
    the scan kernel would (`_write_layout`)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(expert_ptr + offs)
    ok = e < E
    if SCAN:
        cnt, before = chunk_sums(hist_ptr, num_chunks, c, EP, CB)
        cnt = tl.where(tl.arange(0, EP) < E, cnt, 0)
        if c == 0:
            pad_start, pad_end = _write_layout(
                cnt, sorted_ids_ptr, num_rows_ptr, counts_ptr, ends_ptr, P, E, BLOCK_M, EP,
                PAD_STEP, GROUPS,
            )  # fmt: skip
        else:
            pad_start, pad_end = _padded_layout(cnt, BLOCK_M)
        base = tl.gather(pad_start + before, e, 0)  # e <= E < EP
    else:
        base = tl.load(base_ptr + c * EP + e, mask=ok, other=0)
        pad_end = tl.load(pad_end_ptr + tl.arange(0, EP))
    rank = tl.load(rank_ptr + offs)
    tl.store(sorted_ids_ptr + base + rank, tl.load(pair_ptr + offs), mask=ok)
    b_begin = c * blocks_per_program
    b_end = tl.minimum(b_begin + blocks_per_program, max_blocks)
    _write_block_experts(block_expert_ptr, pad_end, E, b_begin, b_end, BLOCK_M, BLOCKS_STEP)
