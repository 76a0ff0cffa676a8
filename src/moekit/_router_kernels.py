"""The fused routing kernel (`moekit.router.select_experts_fused`): scores, optional correction
bias and grouped top-k, top-k, renormalisation, scaling and the fused shared-expert columns of a
block of tokens in one launch, and optionally the routed pairs per expert added to a load
counter (EPLB's recorder). Private: launched only by moekit.router.

Vocabulary: T tokens, E experts (EP: E rounded up to a power of two, the tile's width), K routed
columns (KP: K rounded up), S fused shared experts (SP), G expert groups of E / G experts (GP).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORE_SOFTMAX, SCORE_SIGMOID = 0, 1


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] any float dtype, row stride stride_t
    bias_ptr,  # [E] float32 (read when HAS_BIAS)
    weights_ptr,  # [T, K + S] float32 out
    ids_ptr,  # [T, K + S] int32 out
    counts_ptr,  # [E + S] int64, pairs per expert added to (COUNT > 0)
    T,
    E,
    stride_t,
    scale,  # routed_scaling_factor
    K: tl.constexpr,
    S: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    G: tl.constexpr,  # expert groups (1: no grouped top-k)
    TOPK_GROUP: tl.constexpr,
    TOP2: tl.constexpr,  # a group's score is the sum of its best two (else its best)
    GROUP_TILE: tl.constexpr,  # group scores from a [BLOCK_T, G, EP // G] view (E == EP)
    COUNT: tl.constexpr,  # 0: no counting, 1: an add per pair, 2 / 3: per expert a program
    GDC_LAUNCH: tl.constexpr,  # let the next kernel, if a programmatic dependent launch, start
    GP: tl.constexpr,  # G rounded up to a power of two
    BLOCK_T: tl.constexpr,
    EP: tl.constexpr,
    KP: tl.constexpr,
    SP: tl.constexpr,
):
    if GDC_LAUNCH:
        # its programs may be placed now; they wait on the GPU for this kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, EP)
    row_ok = rows < T
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=ok,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    if SCORE == 0:
        m = tl.max(x, axis=1)
        x = x - tl.where(m == float("-inf"), 0.0, m)[:, None]  # rows past T: no -inf - -inf
        e = tl.where(ok, tl.exp(x), 0.0)
        scores = e / tl.maximum(tl.sum(e, axis=1), 1e-30)[:, None]
    else:
        scores = tl.where(ok, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    # NaN scores rank first, as in torch.topk (and argmax never meets a NaN, whose comparisons
    # could hand it a padding column or an expert already taken); padding stays -inf
    choice = tl.where(ok, tl.where(choice != choice, float("inf"), choice), float("-inf"))
    if G > 1:
        # a group's score: its best expert, or with a bias the sum of its best two
        width = E // G
        group = cols // width
        gcols = tl.arange(0, GP)
        if GROUP_TILE:  # E == EP (so G, dividing it, == GP): G groups of EP // G columns
            c3 = tl.reshape(choice, [BLOCK_T, G, EP // G])
            gscore = tl.max(c3, axis=2)
            if TOP2:
                first = tl.argmax(c3, axis=2)
                within = tl.arange(0, EP // G)[None, None, :]
                c3 = tl.where(within == first[:, :, None], float("-inf"), c3)
                gscore = gscore + tl.max(c3, axis=2)
        else:  # one masked pass over the row per group
            gscore = tl.full([BLOCK_T, GP], float("-inf"), tl.float32)
            for g in tl.static_range(G):
                in_g = (group == g)[None, :] & ok
                c = tl.where(in_g, choice, float("-inf"))
                best = tl.max(c, axis=1)
                s = best
                if TOP2:
                    first = tl.argmax(c, axis=1)
                    c = tl.where(cols[None, :] == first[:, None], float("-inf"), c)
                    s = best + tl.max(c, axis=1)
                gscore = tl.where(gcols[None, :] == g, s[:, None], gscore)
        keep = tl.zeros([BLOCK_T, GP], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            gbest = tl.argmax(gscore, axis=1)
            hit = gcols[None, :] == gbest[:, None]
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
        if GROUP_TILE:
            kept = tl.reshape(tl.broadcast_to(keep[:, :, None], [BLOCK_T, G, EP // G]),
                              [BLOCK_T, EP])  # fmt: skip
        else:
            kept = tl.zeros([BLOCK_T, EP], dtype=tl.int1)
            for g in tl.static_range(G):
                g_kept = tl.max(tl.where(gcols[None, :] == g, keep.to(tl.int32), 0), axis=1) > 0
                kept = kept | (g_kept[:, None] & (group == g)[None, :])
        choice = tl.where(kept, choice, float("-inf"))
    kcols = tl.arange(0, KP)
    w = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    taken = tl.zeros([BLOCK_T, EP], dtype=tl.int1)  # the experts picked (COUNT 2)
    for k in tl.static_range(K):
        best = tl.argmax(choice, axis=1)
        hit = cols[None, :] == best[:, None]
        wk = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        w = tl.where(kcols[None, :] == k, wk[:, None], w)
        ids = tl.where(kcols[None, :] == k, best[:, None].to(tl.int32), ids)
        choice = tl.where(hit, float("-inf"), choice)
        if COUNT == 2:
            taken = taken | hit
    kmask = row_ok[:, None] & (kcols < K)[None, :]
    if COUNT == 1:  # the block's pairs in one add: no layout change per pick
        one = tl.full([BLOCK_T, KP], 1, tl.int64)
        tl.atomic_add(counts_ptr + ids, one, mask=kmask, sem="relaxed")
    if COUNT == 2:
        # one add per expert the block's tokens picked, not one per pair
        per_expert = tl.sum((taken & row_ok[:, None]).to(tl.int32), axis=0).to(tl.int64)
        tl.atomic_add(counts_ptr + cols, per_expert, mask=(per_expert > 0) & col_ok, sem="relaxed")
    if COUNT == 3:  # the same adds, the block's pairs counted by a histogram of their ids
        per_expert = tl.histogram(tl.reshape(ids, [BLOCK_T * KP]), EP,
                                  mask=tl.reshape(kmask, [BLOCK_T * KP])).to(tl.int64)
        tl.atomic_add(counts_ptr + cols, per_expert, mask=per_expert > 0, sem="relaxed")
    if RENORM:
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-20)[:, None]
    w = w * scale
    width_out = K + S
    out = rows[:, None] * width_out + kcols[None, :]
    tl.store(weights_ptr + out, w, mask=kmask)
    tl.store(ids_ptr + out, ids, mask=kmask)
    if S > 0:
        scols = tl.arange(0, SP)
        sout = rows[:, None] * width_out + K + scols[None, :]
        smask = row_ok[:, None] & (scols < S)[None, :]
        shared = tl.zeros([BLOCK_T, SP], dtype=tl.int32) + E + scols[None, :]
        tl.store(ids_ptr + sout, shared, mask=smask)
        tl.store(weights_ptr + sout, tl.full([BLOCK_T, SP], 1.0, tl.float32), mask=smask)
        if COUNT > 0:
            rows_here = tl.sum(row_ok.to(tl.int32), axis=0).to(tl.int64)
            tl.atomic_add(counts_ptr + E + scols, tl.zeros([SP], tl.int64) + rows_here,
                          mask=scols < S, sem="relaxed")  # fmt: skip
