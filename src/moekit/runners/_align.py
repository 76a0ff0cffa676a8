"""Token alignment: the (token, k) pairs sorted by expert into blocks of `block_m` rows.

Every block of `block_m` consecutive rows belongs to one expert, so a grouped GEMM program
loads one weight tile for its whole block. Each expert's segment is padded up to a multiple of
`block_m` with the sentinel P (= number of pairs); masked ids (-1, or >= E) are left out and
experts without pairs take no rows. All shapes depend on (P, E, block_m) only and nothing is
read back to the host, so the alignment can be captured in a CUDA graph.

`align_block_size` runs the Triton kernels; `align_block_size_torch` is the reference twin and
produces the same layout (pairs of one expert in increasing pair order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._triton_host import cdiv, next_pow2


@dataclass(frozen=True)
class AlignTuning:
    """single_max: largest P done by one program; above it, P is cut into at most max_chunks
    chunks of at least min_chunk pairs (powers of two), sorted by one program each; up to
    fused_max_chunks chunks the programs that scatter them sum the chunk histograms themselves
    (two kernels), above it a one-program scan runs between (three).

    Timed alone on the H100 (scripts/gpu_probe_routing.py, benchmarks/triton_kernel_notes.md,
    session 48), us a call at block_m 64, E = 128, K = 8, T = 64 / 256 / 1024 / 16384: 9.5 /
    8.5 / 8.7 / 17.3 with single_max 256 and the scan kernel, 7.3 / 6.2 / 5.9 / 13.2 with
    these; E = 8, K = 2, T = 256 (P = 512): 6.3 against 3.1 (one program)."""

    single_max: int = 512
    min_chunk: int = 256
    max_chunks: int = 64
    fused_max_chunks: int = 64

    def chunk(self, num_pairs: int) -> int:
        return pairs_per_chunk(num_pairs, self.min_chunk, self.max_chunks)


ALIGN_TUNING = AlignTuning()


@dataclass(frozen=True)
class AlignOutput:
    """sorted_ids [max_rows] int32: pair index p = t*K + k of each row, P on padding rows (rows
    at or past num_rows are not written); block_expert [max_blocks] int32: the expert of each
    block of block_m rows, -1 past the used ones; num_rows [1] int32: rows in use (a multiple of
    block_m). With `groups=True`: counts [E] int32, the pairs of each expert, and ends [E]
    int32, the padded end row of each expert's segment (cumulative); else None."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_rows: torch.Tensor
    block_m: int
    num_pairs: int
    counts: torch.Tensor | None = None
    ends: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        return self.sorted_ids.shape[0]

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks any routing of `num_pairs` pairs over `num_experts` experts can need:
    sum_e ceil(c_e / BM) <= n + (P - n) // BM with n = min(E, P) experts in use."""
    n = min(num_experts, num_pairs)
    return n + (num_pairs - n) // block_m


def pairs_per_chunk(num_pairs: int, min_chunk: int, max_chunks: int,
                    max_chunk: int | None = None) -> int:  # fmt: skip
    """Pairs per program of a chunked sort of `num_pairs` pairs (both Triton runners'): the
    power of two that cuts them into at most `max_chunks` chunks, at least `min_chunk` (and at
    most `max_chunk`, where given)."""
    chunk = max(min_chunk, next_pow2(cdiv(num_pairs, max_chunks)))
    return chunk if max_chunk is None else min(max_chunk, chunk)


def _check(ids_TK: torch.Tensor, num_experts: int, block_m: int) -> None:
    if ids_TK.dtype != torch.int32:
        raise ValueError(f"topk ids must be int32, got {ids_TK.dtype}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if not 1 <= num_experts <= 1024:
        raise ValueError(f"the alignment kernels support 1..1024 local experts, got {num_experts}")


def _empty(P: int, E: int, block_m: int, device, groups: bool = False) -> AlignOutput:
    blocks = max_blocks(P, E, block_m)

    def groups_buffer():  # written by the kernels unless there are no pairs
        make = torch.zeros if P == 0 else torch.empty
        return make(E, dtype=torch.int32, device=device)

    return AlignOutput(
        sorted_ids=torch.empty(blocks * block_m, dtype=torch.int32, device=device),
        block_expert=torch.empty(blocks, dtype=torch.int32, device=device),
        # written by the kernels (no memset) unless there are no pairs
        num_rows=(torch.zeros if P == 0 else torch.empty)(1, dtype=torch.int32, device=device),
        block_m=block_m,
        num_pairs=P,
        counts=groups_buffer() if groups else None,
        ends=groups_buffer() if groups else None,
    )


def align_block_size(
    ids_TK: torch.Tensor,
    num_experts: int,
    block_m: int,
    tuning: AlignTuning | None = None,
    *,
    groups: bool = False,
    pdl: bool = False,
) -> AlignOutput:
    """Sort the pairs of `ids_TK` [T, K] int32 (ids in [0, E) or masked) by expert, on device;
    `groups`: also the per-expert counts and padded ends. `pdl`: a single-kernel alignment
    runs as a programmatic dependent launch that lets the next kernel be placed at once (the
    triton runner's decode chain, `moekit.runners.triton.ops.decode_pdl`)."""
    from moekit.runners import _align_kernels as k

    tuning = tuning or ALIGN_TUNING
    _check(ids_TK, num_experts, block_m)
    ids = ids_TK.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    P, E = ids.numel(), num_experts
    out = _empty(P, E, block_m, ids.device, groups)
    if P == 0:
        return out
    counts = out.counts if groups else out.num_rows  # (not written without groups)
    ends = out.ends if groups else out.num_rows
    EP = next_pow2(E + 1)
    pad_step = min(block_m, 16)
    blocks_step = max(16, min(128, 4096 // EP))
    if P <= tuning.single_max:
        chunk = next_pow2(max(P, 16))
        k._align_small_kernel[(1,)](
            ids, out.sorted_ids, out.block_expert, out.num_rows, counts, ends, P, E,
            out.max_blocks, BLOCK_M=block_m, CHUNK=chunk, EP=EP, PAD_STEP=pad_step,
            BLOCKS_STEP=blocks_step, GROUPS=groups, num_warps=4 if chunk <= 512 else 8,
            PDL=pdl, **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip
        return out
    chunk = tuning.chunk(P)
    C = cdiv(P, chunk)
    dev = ids.device
    expert = torch.empty(C * chunk, dtype=torch.int32, device=dev)
    pair = torch.empty_like(expert)
    rank = torch.empty_like(expert)
    hist = torch.empty(C * EP, dtype=torch.int32, device=dev)
    base = torch.empty_like(hist)
    pad_end = torch.empty(EP, dtype=torch.int32, device=dev)
    warps = 4 if chunk <= 512 else 8
    k._align_chunk_kernel[(C,)](
        ids, expert, pair, rank, hist, P, E, CHUNK=chunk, EP=EP, num_warps=warps
    )
    scan_here = C <= tuning.fused_max_chunks
    cb = max(1, min(64, 8192 // EP))
    if not scan_here:
        k._align_scan_kernel[(1,)](
            hist, base, pad_end, out.sorted_ids, out.num_rows, counts, ends, C, P, E,
            BLOCK_M=block_m, EP=EP, PAD_STEP=pad_step, CB=cb, GROUPS=groups, num_warps=8,
        )  # fmt: skip
    k._align_scatter_kernel[(C,)](
        expert, pair, rank, hist, base, pad_end, out.sorted_ids, out.block_expert, out.num_rows,
        counts, ends, C, P, E, out.max_blocks, cdiv(out.max_blocks, C),
        BLOCK_M=block_m, CHUNK=chunk, EP=EP, BLOCKS_STEP=blocks_step, PAD_STEP=pad_step,
        CB=cb, GROUPS=groups, SCAN=scan_here, num_warps=warps,
    )  # fmt: skip
    return out


def align_block_size_torch(
    ids_TK: torch.Tensor, num_experts: int, block_m: int, *, groups: bool = False
) -> AlignOutput:
    """Reference twin of `align_block_size` in plain PyTorch (reads counts on the host)."""
    _check(ids_TK, num_experts, block_m)
    ids = ids_TK.reshape(-1).long()
    P, E = ids.numel(), num_experts
    out = _empty(P, E, block_m, ids.device, groups)
    valid = (ids >= 0) & (ids < E)
    counts = torch.bincount(ids[valid], minlength=E).tolist()
    order = torch.argsort(torch.where(valid, ids, E), stable=True)
    rows, experts, start = [], [], 0
    for e, n in enumerate(counts):
        padded = -(-n // block_m) * block_m
        pad = torch.full((padded - n,), P, dtype=torch.long, device=ids.device)
        rows.append(torch.cat([order[start : start + n], pad]))
        experts += [e] * (padded // block_m)
        start += n
    sorted_rows = torch.cat(rows) if rows else order[:0]
    used = sorted_rows.numel()
    out.sorted_ids[:used] = sorted_rows.to(torch.int32)
    out.block_expert.fill_(-1)
    out.block_expert[: len(experts)] = torch.tensor(experts, dtype=torch.int32, device=ids.device)
    out.num_rows.fill_(used)
    if groups:
        n = torch.tensor(counts, dtype=torch.int32, device=ids.device)
        out.counts.copy_(n)
        out.ends.copy_(torch.cumsum((n + block_m - 1) // block_m * block_m, 0))
    return out
