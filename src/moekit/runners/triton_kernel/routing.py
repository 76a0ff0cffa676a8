"""Routing metadata of the `triton_kernel` runner: the (token, k) pairs counting-sorted by
expert, and the list of work tiles, without padding.

For ids [T, K] (P = T*K pairs, pair p = t*K + k) and E local experts:
  sorted_pairs [P] int32  a stable sort of the pairs by expert: rows [offsets[e], offsets[e] +
                          counts[e]) hold expert e's pairs in increasing pair order; the masked
                          pairs (id -1 or >= E) follow from offsets[E] on, so it is a
                          permutation of [0, P)
  counts [E], offsets [E + 1] int32
  tile_expert / tile_row0 / tile_rows [max_tiles] int32: work tile j of BM rows covers sorted
                          rows [tile_row0, tile_row0 + tile_rows) of expert tile_expert; tiles
                          at or past num_tiles have expert -1 and 0 rows. With fold > 0 an
                          expert's last 1 ... fold rows after a full tile are that tile's too
                          (tile_rows up to BM + fold): its program multiplies them by the
                          weight tiles it already holds, and no tile of a few rows streams
                          them again (benchmarks/triton_kernel_notes.md, session 38)
  num_tiles [1] int32     on device: never read on the host, so the whole thing is CUDA-graph
                          safe; every shape depends on (P, E, BM) only.
max_tiles = P // BM + min(E, P) bounds the tiles of any routing (each expert adds at most one
partial tile). `route` runs Triton kernels: a histogram per chunk, then a scatter + tile list per
chunk, whose programs sum the chunk histograms they need (`RoutingTuning.sums_in_scatter`; else
a one-program scan runs between the two); `route_torch` is the reference twin and
gives identical tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._triton_host import cdiv, next_pow2
from moekit.runners.triton_kernel.configs import ROUTING


@dataclass(frozen=True)
class Routing:
    """See the module docstring. block_m: rows per tile; num_pairs: P; fold: rows a full
    tile may take past block_m."""

    sorted_pairs: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_row0: torch.Tensor
    tile_rows: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int
    num_pairs: int
    fold: int = 0

    @property
    def max_tiles(self) -> int:
        return self.tile_expert.numel()


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of work tiles over every routing of num_pairs pairs."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def _check(ids_TK: torch.Tensor, num_experts: int, block_m: int, fold: int) -> None:
    if ids_TK.dim() != 2:
        raise ValueError(f"topk ids must be [T, K], got shape {list(ids_TK.shape)}")
    if ids_TK.dtype != torch.int32:
        raise ValueError(f"topk ids must be int32, got {ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if not 0 <= fold < block_m:
        raise ValueError(f"fold must be in [0, block_m={block_m}), got {fold}")


def _alloc(P: int, E: int, block_m: int, fold: int, device) -> Routing:
    n = max_tiles(P, E, block_m)
    i32 = dict(dtype=torch.int32, device=device)
    return Routing(
        sorted_pairs=torch.empty(P, **i32),
        counts=torch.empty(E, **i32),
        offsets=torch.empty(E + 1, **i32),
        tile_expert=torch.empty(n, **i32),
        tile_row0=torch.empty(n, **i32),
        tile_rows=torch.empty(n, **i32),
        num_tiles=torch.empty(1, **i32),
        block_m=block_m,
        num_pairs=P,
        fold=fold,
    )


def route(ids_TK: torch.Tensor, num_experts: int, block_m: int, fold: int = 0) -> Routing:
    """The routing metadata (module docstring) of ids [T, K] int32, on ids' device."""
    _check(ids_TK, num_experts, block_m, fold)
    ids = ids_TK.contiguous()
    P, E = ids.numel(), num_experts
    r = _alloc(P, E, block_m, fold, ids.device)
    if P == 0:
        r.counts.zero_(), r.offsets.zero_(), r.num_tiles.zero_()
        r.tile_expert.fill_(-1), r.tile_row0.zero_(), r.tile_rows.zero_()
        return r
    from moekit.runners.triton_kernel import _kernels as k

    EP = next_pow2(E + 1)
    chunk = ROUTING.chunk(P)
    nc = cdiv(P, chunk)
    hist = torch.empty(nc, EP, dtype=torch.int32, device=ids.device)
    warps = ROUTING.num_warps
    k._chunk_hist_kernel[(nc,)](ids, hist, P, E, CHUNK=chunk, EP=EP, num_warps=warps)
    block_c = max(1, min(next_pow2(nc), ROUTING.scan_elems // EP))
    scan_here = ROUTING.sums_in_scatter(nc)
    base = hist if scan_here else torch.empty_like(hist)  # (not read when summed in scatter)
    if not scan_here:
        k._scan_tiles_kernel[(1,)](
            hist, base, r.counts, r.offsets, r.num_tiles, P, E, nc,
            BLOCK_M=block_m, EP=EP, BLOCK_C=block_c, FOLD=fold, num_warps=warps,
        )  # fmt: skip
    per_program = cdiv(r.max_tiles, nc)
    block_t = max(16, min(next_pow2(per_program), ROUTING.scan_elems // EP))
    k._scatter_kernel[(nc,)](
        ids, hist, base, r.counts, r.offsets, r.num_tiles, r.sorted_pairs, r.tile_expert,
        r.tile_row0, r.tile_rows, P, E, nc, per_program, r.max_tiles,
        CHUNK=chunk, EP=EP, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_C=block_c, FOLD=fold,
        SCAN=scan_here, num_warps=warps,
    )  # fmt: skip
    return r


def route_torch(ids_TK: torch.Tensor, num_experts: int, block_m: int, fold: int = 0) -> Routing:
    """Reference twin of `route` in plain PyTorch (reads counts on the host)."""
    _check(ids_TK, num_experts, block_m, fold)
    flat = ids_TK.reshape(-1).long()
    P, E = flat.numel(), num_experts
    r = _alloc(P, E, block_m, fold, ids_TK.device)
    valid = (flat >= 0) & (flat < E)
    key = torch.where(valid, flat, E)
    r.sorted_pairs.copy_(torch.argsort(key, stable=True).to(torch.int32))
    counts = torch.bincount(key, minlength=E + 1)[:E]
    r.counts.copy_(counts.to(torch.int32))
    offsets = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    r.offsets.copy_(offsets.to(torch.int32))
    r.tile_expert.fill_(-1), r.tile_row0.zero_(), r.tile_rows.zero_()
    j = 0
    for e, (n, start) in enumerate(zip(counts.tolist(), offsets.tolist())):
        row0 = start
        while row0 < start + n:
            left = start + n - row0
            rows = left if left <= block_m + fold else block_m
            r.tile_expert[j], r.tile_row0[j], r.tile_rows[j] = e, row0, rows
            row0 += rows
            j += 1
    r.num_tiles.fill_(j)
    return r
