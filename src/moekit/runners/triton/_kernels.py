"""Triton kernels of the `triton` runner (private: the allocating wrappers live in `ops.py` and
`align.py`).

Vocabulary: T tokens, K top-k, P = T*K (token, k) pairs with pair index p = t*K + k, E local
experts, H hidden, I intermediate, BM the block of rows that shares one expert.

Three groups of kernels:
  * alignment: sort the P pairs by expert into blocks of BM rows (padding at the end of each
    expert's segment), on device, with shapes fixed by (P, E, BM) only (CUDA-graph safe);
  * grouped GEMMs: gate_up (x @ w13[e].T with the activation fused) and down (h @ w2[e].T with
    the routing weight, then either a store per pair or an atomic add per token);
  * sum over the K experts of each token (`_sum_topk_kernel`), when the down GEMM stored pairs.

The GEMM main loops load the weight tiles through `_load_w_tile`, the one place a quantized
weight format would dequantize.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation codes (constexpr ACT).
ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI = 0, 1, 2


# ----------------------------------------------------------------------------------------------
# Alignment: pairs sorted by expert, padded to blocks of BLOCK_M rows
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sort_chunk(ids_ptr, start, P, E, CHUNK: tl.constexpr, EP: tl.constexpr):
    """Sort the pairs [start, start + CHUNK) by expert (ties by pair index).

    Returns expert [CHUNK] (E for masked ids / padding lanes), pair [CHUNK], rank [CHUNK]
    (position among the chunk's pairs of the same expert) and the histogram [EP] of experts.
    """
    offs = tl.arange(0, CHUNK)
    pair = start + offs
    e = tl.load(ids_ptr + pair, mask=pair < P, other=-1)
    e = tl.where((e >= 0) & (e < E), e, E)
    key = tl.sort(e * CHUNK + offs)
    sorted_e = key // CHUNK
    sorted_pair = start + key % CHUNK
    hist = tl.histogram(e, EP)
    local_start = tl.cumsum(hist, 0) - hist
    rank = offs - tl.gather(local_start, sorted_e, 0)
    return sorted_e, sorted_pair, rank, hist


@triton.jit
def _write_layout(
    cnt,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    P,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,
):
    """From the per-expert counts cnt [EP] (0 past E): write the padded row total, the padding
    sentinels (value P) at the end of each expert's segment and the expert of every block
    (-1 past the last used block). Returns the first padded row of each expert [EP]."""
    padded = (cnt + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    # padding sentinels: rows [pad_start + cnt, pad_end) of each expert
    fill_from = pad_start + cnt
    fill_len = padded - cnt
    sentinel = tl.zeros([EP, PAD_STEP], dtype=tl.int32) + P
    for j in tl.static_range(0, BLOCK_M, PAD_STEP):
        col = j + tl.arange(0, PAD_STEP)
        tl.store(
            sorted_ids_ptr + fill_from[:, None] + col[None, :],
            sentinel,
            mask=col[None, :] < fill_len[:, None],
        )
    # expert of each block = number of experts whose padded segment ends at or before it
    for b0 in range(0, max_blocks, BLOCKS_STEP):
        b = b0 + tl.arange(0, BLOCKS_STEP)
        before = (pad_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32)
        e = tl.sum(before, 1)
        tl.store(block_expert_ptr + b, tl.where(e < E, e, -1), mask=b < max_blocks)
    return pad_start


@triton.jit
def _align_small_kernel(
    ids_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    P,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,
):
    """One program does the whole alignment (P <= CHUNK)."""
    sorted_e, sorted_pair, rank, hist = _sort_chunk(ids_ptr, 0, P, E, CHUNK, EP)
    cnt = tl.where(tl.arange(0, EP) < E, hist, 0)
    pad_start = _write_layout(
        cnt, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, P, E, max_blocks,
        BLOCK_M, EP, PAD_STEP, BLOCKS_STEP,
    )  # fmt: skip
    dest = tl.gather(pad_start, sorted_e, 0) + rank
    tl.store(sorted_ids_ptr + dest, sorted_pair, mask=sorted_e < E)


@triton.jit
def _align_chunk_kernel(
    ids_ptr, expert_ptr, pair_ptr, rank_ptr, hist_ptr, P, E,
    CHUNK: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    """Pass 1 of 3 (P > CHUNK): sort each chunk; store its sorted pairs and histogram [EP]."""
    c = tl.program_id(0)
    sorted_e, sorted_pair, rank, hist = _sort_chunk(ids_ptr, c * CHUNK, P, E, CHUNK, EP)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    tl.store(expert_ptr + offs, sorted_e)
    tl.store(pair_ptr + offs, sorted_pair)
    tl.store(rank_ptr + offs, rank)
    tl.store(hist_ptr + c * EP + tl.arange(0, EP), hist)


@triton.jit
def _align_scan_kernel(
    hist_ptr,
    base_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_chunks,
    P,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EP: tl.constexpr,
    PAD_STEP: tl.constexpr,
    BLOCKS_STEP: tl.constexpr,
):
    """Pass 2 of 3 (one program): totals per expert, the padded layout, and base[c, e] = the
    row where chunk c's pairs of expert e start."""
    ee = tl.arange(0, EP)
    cnt = tl.zeros([EP], dtype=tl.int32)
    for c in range(num_chunks):
        cnt += tl.load(hist_ptr + c * EP + ee)
    cnt = tl.where(ee < E, cnt, 0)
    pad_start = _write_layout(
        cnt, sorted_ids_ptr, block_expert_ptr, num_rows_ptr, P, E, max_blocks,
        BLOCK_M, EP, PAD_STEP, BLOCKS_STEP,
    )  # fmt: skip
    running = pad_start
    for c in range(num_chunks):
        tl.store(base_ptr + c * EP + ee, running)
        running += tl.load(hist_ptr + c * EP + ee)


@triton.jit
def _align_scatter_kernel(
    expert_ptr, pair_ptr, rank_ptr, base_ptr, sorted_ids_ptr, E,
    CHUNK: tl.constexpr, EP: tl.constexpr,
):  # fmt: skip
    """Pass 3 of 3: each sorted pair goes to base[c, expert] + rank."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(expert_ptr + offs)
    ok = e < E
    base = tl.load(base_ptr + c * EP + e, mask=ok, other=0)
    rank = tl.load(rank_ptr + offs)
    tl.store(sorted_ids_ptr + base + rank, tl.load(pair_ptr + offs), mask=ok)


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M row blocks share each weight tile while it is in L2."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _load_w_tile(ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight tile [BLOCK_K, BLOCK_N] (rows along the reduction). The hook for a future
    dequantizing weight format: load packed values and scales here, return the dot dtype."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
    return tile


@triton.jit
def _load_a_tile(ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation tile [BLOCK_M, BLOCK_K]."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
    return tile


@triton.jit
def _mma(a, b, acc, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ b, with acc kept transposed ([BN, BM]) when SWAP_AB: small row blocks then
    sit in the MMA's N slot and the weight tile in its M slot."""
    if SWAP_AB:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _tile_rows(
    pid_m,
    sorted_ids_ptr,
    block_expert_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    capacity,
    blocks_per_expert,
    align_m,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Rows of row block pid_m. Returns (expert, row_ok [BM], pair [BM], token [BM],
    slot [BM], first_ok): standard format: slot = row of the sorted (padded) order, pair / token
    of each row (token 0 on padding rows); masked format: slot = e * capacity + local row
    (local row 0 where not row_ok, so loads stay in bounds; pair, token unused).
    Only rows with row_ok are stored. first_ok is False when the block has no row to compute."""
    offs = tl.arange(0, BLOCK_M)
    if MASKED:
        expert = pid_m // blocks_per_expert
        local0 = (pid_m % blocks_per_expert) * BLOCK_M
        count = tl.minimum(tl.load(counts_ptr + expert), capacity)
        local = local0 + offs
        row_ok = local < count
        slot = expert.to(tl.int64) * capacity + tl.where(row_ok, local, 0)
        pair = slot.to(tl.int32)
        token = pair
        first_ok = local0 < count
    else:
        row0 = pid_m * BLOCK_M
        pair = tl.load(sorted_ids_ptr + row0 + offs)
        row_ok = pair < num_pairs
        token = tl.where(row_ok, pair // top_k, 0)
        expert = tl.load(block_expert_ptr + row0 // align_m)
        slot = (row0 + offs).to(tl.int64)
        first_ok = tl.load(sorted_ids_ptr + row0) < num_pairs
    return expert, row_ok, pair, token, slot, first_ok


@triton.jit(do_not_specialize=["num_pairs", "capacity", "blocks_per_expert", "num_pid_m"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    h_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    capacity,
    blocks_per_expert,
    align_m,
    num_pid_m,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    gate_step,
    up_offset,
    alpha,
    limit,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """h[slot, n] = act(x[row] @ w13[e, gate(n)] + b, x[row] @ w13[e, up(n)] + b) for n < N = I.

    x [rows, K=H]; w13 [E, 2I, H] with gate row n*gate_step and up row n*gate_step + up_offset
    (1, I: gate rows then up rows; 2, 1: interleaved); h [slots, I] in x's dtype. Standard
    format: row = token of the pair, slot = its row in the sorted order (padding rows are not
    stored: the down GEMM's output rows depend only on their own h row, and are masked too).
    Masked format: row = slot = e * capacity + local row.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    if not MASKED:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    expert, row_ok, pair, token, slot, first_ok = _tile_rows(
        pid_m, sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, capacity,
        blocks_per_expert, align_m, BLOCK_M, MASKED,
    )  # fmt: skip
    if not first_ok:
        return
    if MASKED:
        a_rows = slot
    else:
        a_rows = token.to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    n_raw = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = n_raw % N  # wrapped columns load real rows; their results are masked at the store
    g_rows = offs_n * gate_step
    u_rows = g_rows + up_offset
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    a_ptrs = x_ptr + a_rows[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_base + g_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = w_base + u_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    if SWAP_AB:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = _load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
        bg = _load_w_tile(g_ptrs, k_left, EVEN_K, BLOCK_K)
        bu = _load_w_tile(u_ptrs, k_left, EVEN_K, BLOCK_K)
        acc_g = _mma(a, bg, acc_g, SWAP_AB, DOT_PRECISION)
        acc_u = _mma(a, bu, acc_u, SWAP_AB, DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)

    if HAS_BIAS:
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        acc_g += tl.load(b_base + g_rows).to(tl.float32)[None, :]
        acc_u += tl.load(b_base + u_rows).to(tl.float32)[None, :]
    if ACT == 0:  # silu(gate) * up
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    elif ACT == 1:  # gelu(gate) * up, exact erf form
        act = 0.5 * acc_g * (1.0 + tl.erf(acc_g * 0.7071067811865476)) * acc_u
    else:  # swiglu_oai: clamp, gate * sigmoid(alpha * gate) * (up + 1)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)

    h_ptrs = h_ptr + slot[:, None] * stride_hm + n_raw[None, :]
    tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & (n_raw[None, :] < N))


@triton.jit(do_not_specialize=["num_pairs", "capacity", "blocks_per_expert", "num_pid_m"])
def _down_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    capacity,
    blocks_per_expert,
    align_m,
    num_pid_m,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    HAS_BIAS: tl.constexpr,
    MASKED: tl.constexpr,
    ATOMIC: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """y = h[slot] @ w2[e].T + b2[e] for N = H output columns, K = I.

    Standard format: y is multiplied by the pair's routing weight and either stored at out[pair]
    (out [P, H], summed over K later) or, with ATOMIC, added into out[token] (out [T, H],
    zeroed before). Masked format: stored unweighted at out[slot] (out [E * capacity, H]).
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    if not MASKED:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    expert, row_ok, pair, token, slot, first_ok = _tile_rows(
        pid_m, sorted_ids_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, capacity,
        blocks_per_expert, align_m, BLOCK_M, MASKED,
    )  # fmt: skip
    if not first_ok:
        return

    offs_k = tl.arange(0, BLOCK_K)
    n_raw = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = n_raw % N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    a_ptrs = h_ptr + slot[:, None] * stride_hm + offs_k[None, :]
    b_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = _load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
        b = _load_w_tile(b_ptrs, k_left, EVEN_K, BLOCK_K)
        acc = _mma(a, b, acc, SWAP_AB, DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)

    if HAS_BIAS:
        acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n).to(tl.float32)[None, :]
    mask = row_ok[:, None] & (n_raw[None, :] < N)
    if MASKED:
        out_rows = slot
    else:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        if ATOMIC:
            out_rows = token.to(tl.int64)
        else:
            out_rows = pair.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + n_raw[None, :]
    val = acc.to(out_ptr.dtype.element_ty)
    if ATOMIC:
        tl.atomic_add(out_ptrs, val, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, val, mask=mask)


# ----------------------------------------------------------------------------------------------
# Sum over the K experts of each token
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _sum_topk_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    T,
    H,
    top_k,
    E,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t, :] = sum over k of y[t*K + k, :] for the k whose id is in [0, E) (others were
    never written). y [P, H], out [T, H], both row-major with row stride H; float32 sum."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = h < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in range(0, top_k):
        pair = t.to(tl.int64) * top_k + k
        e = tl.load(ids_ptr + pair, mask=t_ok, other=-1)
        ok = (e >= 0) & (e < E)
        acc += tl.load(
            y_ptr + pair[:, None] * H + h[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0
        ).to(tl.float32)
    out_ptrs = out_ptr + t.to(tl.int64)[:, None] * H + h[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & h_ok[None, :])
