"""Triton device helpers shared by the Triton runners (`triton` and `triton_kernel`): the
activation codes and epilogue, the per-chunk sort of (token, k) pairs by expert and the sums of
the chunk histograms, the grouped
program order, tile loads and the grid-stride zeroing. Private: `@triton.jit` functions only
(inlined into the runners' kernels), no launches.

Vocabulary: P = T*K (token, k) pairs with pair index p = t*K + k, E local experts, EP a power of
two > E (bucket E holds masked ids), tiles [BLOCK_K, rows] for weights (K along dim 0) and
[BLOCK_M, BLOCK_K] for activations.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation codes (constexpr ACT of the gate_up kernels), by ActivationSpec.name.
ACT_SILU, ACT_GELU, ACT_SWIGLU_OAI = 0, 1, 2
ACT_CODES = {"silu": ACT_SILU, "gelu": ACT_GELU, "swiglu_oai": ACT_SWIGLU_OAI}


@triton.jit
def activate(g, u, alpha, limit, ACT: tl.constexpr):
    """float32 gate g, up u -> act(g) * u: silu, exact-erf gelu, or swiglu_oai (gate clamped
    above at limit, up to +-limit; g * sigmoid(alpha * g) * (u + 1))."""
    if ACT == 0:
        out = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        out = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476)) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    return out


@triton.jit
def sort_chunk(ids_ptr, start, P, E, CHUNK: tl.constexpr, EP: tl.constexpr):
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
def chunk_sums(hist_ptr, num_chunks, c, EP: tl.constexpr, BLOCK_C: tl.constexpr):
    """From the chunk histograms hist [num_chunks, EP] (read BLOCK_C rows at a time): the
    totals [EP] and the sums over the chunks before chunk c [EP]."""
    cols = tl.arange(0, EP)
    total = tl.zeros([EP], dtype=tl.int32)
    before = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        h = tl.load(hist_ptr + cc[:, None] * EP + cols[None, :],
                    mask=(cc < num_chunks)[:, None], other=0)  # fmt: skip
        total += tl.sum(h, 0)
        before += tl.sum(tl.where((cc < c)[:, None], h, 0), 0)
    return total, before


@triton.jit
def tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped program order: GROUP_M row blocks share each weight tile while it is in L2.
    Returns (pid_m, pid_n)."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def zero_fill(ptr, numel, pid, num_programs, ZBLOCK: tl.constexpr):
    """Grid-stride zeroing of ptr[0:numel] (the atomic down GEMM's output, zeroed by the
    gate_up launch before it so that no separate memset runs)."""
    for start in range(pid * ZBLOCK, numel, num_programs * ZBLOCK):
        offs = start + tl.arange(0, ZBLOCK)
        tl.store(ptr + offs, tl.zeros([ZBLOCK], dtype=ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def load_w_tile(ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight tile [BLOCK_K, rows] through pointers (K along dim 0), as stored; columns at or
    past k_left read as zero unless EVEN_K."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
    return tile


@triton.jit
def desc_w_tile(desc, row0, k0):
    """Weight tile [BLOCK_K, rows] through a TMA descriptor of block [rows, BLOCK_K]
    (out-of-bounds rows and columns read as zero)."""
    return tl.trans(desc.load([row0, k0]))


@triton.jit
def load_a_tile(ptrs, k_left, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation tile [BLOCK_M, BLOCK_K]; columns at or past k_left read as zero unless
    EVEN_K."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
    return tile
