"""Grouped-GEMM row layout shared by the `cutlass` and `deep_gemm` runners.

A grouped GEMM wants the (token, expert) pairs as rows sorted by expert, each expert's rows
contiguous. `group_rows` builds that layout from the top-k ids on the device, with no host
synchronisation and a row count that depends only on (T, K, E, align), so the whole runner can be
captured in a CUDA graph.

Row layout (M rows): expert 0's pairs, then expert 1's, ..., each group padded up to a multiple of
`align` rows; after the last group come unused rows (masked pairs, or slack of the static bound).
Padding and unused rows have expert -1 and token 0.
`group_rows_reference` is the plain-Python twin used by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupedRows:
    """The expert-sorted row layout of one call.

    token_M   [M] int64: the token each row reads (0 for padding / unused rows: a valid index).
    expert_M  [M] int32: the expert of each row; -1 for padding and unused rows (DeepGEMM's
              `m_indices`).
    row_TK    [T, K] int64: the row of each (token, k) pair; -1 for masked pairs (id -1 or >= E).
    ends_E    [E] int32: cumulative end row of each expert's group (padded); the `offs` of
              `torch._grouped_mm`. Rows at or past ends_E[-1] belong to no group.
    counts_E  [E] int32: routed pairs per expert (unpadded).
    """

    token_M: torch.Tensor
    expert_M: torch.Tensor
    row_TK: torch.Tensor
    ends_E: torch.Tensor
    counts_E: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.token_M.shape[0]


def max_rows(num_pairs: int, num_experts: int, align: int) -> int:
    """Static row bound M for `num_pairs` = P pairs over E experts with groups padded to
    `align`: sum_e ceil(c_e / align) <= n + (P - n) // align groups of `align` rows, n =
    min(E, P) experts in use (the triton runner's `align.max_blocks`)."""
    busy = min(num_experts, num_pairs)
    return (busy + (num_pairs - busy) // align) * align


def group_rows(
    ids_TK: torch.Tensor, num_experts: int, align: int = 1, *, use_triton: bool = False
) -> GroupedRows:
    """Sort the pairs of `ids_TK` [T, K] (int, -1 = masked) by expert, on ids' device, without
    host synchronisation. Ids outside [0, E) are treated as masked. `use_triton`: the triton
    runner's alignment kernels and one layout kernel (5 launches) where they apply (align a
    power of two, E <= 1024), else the torch ops below (about 25 launches)."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if use_triton and align & (align - 1) == 0 and 1 <= num_experts <= 1024:
        return _group_rows_triton(ids_TK, num_experts, align)
    T, K = ids_TK.shape
    E, dev = num_experts, ids_TK.device
    n = T * K
    flat = ids_TK.reshape(-1)
    valid = (flat >= 0) & (flat < E)
    # int32 keys: half the radix passes of int64. The counts come from where each expert's run
    # starts in the sorted keys (a scatter_add of ones serialises on the one bucket that all
    # masked pairs share; bincount would read its size back to the host).
    key = torch.where(valid, flat, E).to(torch.int32)
    sorted_key, order = torch.sort(key, stable=True)
    starts = torch.searchsorted(sorted_key, torch.arange(E + 1, dtype=torch.int32, device=dev))
    counts = starts[1:] - starts[:-1]
    sorted_key = sorted_key.long()
    padded = counts if align == 1 else (counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    r = torch.arange(n, device=dev)
    valid_r = sorted_key < E
    expert_r = torch.where(valid_r, sorted_key, torch.full_like(sorted_key, -1))
    if align == 1:
        # Valid rows keep their sorted position; masked pairs sort last (key E).
        M = n
        dest = r
        token_M = torch.where(valid_r, order // K, 0)
        expert_M = expert_r.to(torch.int32)
    else:
        M = max_rows(n, E, align)
        e = sorted_key.clamp(max=E - 1)
        group_start = (ends - padded)[e]
        sorted_start = (torch.cumsum(counts, 0) - counts)[e]
        # Masked pairs go to a scratch row M, dropped below.
        dest = torch.where(valid_r, group_start + (r - sorted_start), torch.full_like(r, M))
        token_M = torch.zeros(M + 1, dtype=torch.int64, device=dev)
        token_M[dest] = order // K
        token_M = token_M[:M]
        expert_full = torch.full((M + 1,), -1, dtype=torch.int32, device=dev)
        expert_full[dest] = expert_r.to(torch.int32)
        expert_M = expert_full[:M]
    row_flat = torch.empty(n, dtype=torch.int64, device=dev)
    row_flat[order] = torch.where(valid_r, dest, torch.full_like(dest, -1))
    return GroupedRows(
        token_M=token_M,
        expert_M=expert_M.contiguous(),
        row_TK=row_flat.view(T, K),
        ends_E=ends.to(torch.int32),
        counts_E=counts.to(torch.int32),
    )


def _group_rows_triton(ids_TK: torch.Tensor, num_experts: int, align: int) -> GroupedRows:
    from moekit.runners._align import align_block_size
    from moekit.runners._cutlass_kernels import rows_layout_triton

    ids = ids_TK if ids_TK.dtype == torch.int32 else ids_TK.to(torch.int32)
    lay = align_block_size(ids, num_experts, align, groups=True)
    token_M, expert_M, row_TK = rows_layout_triton(lay, ids_TK.shape)
    return GroupedRows(token_M, expert_M, row_TK, lay.ends, lay.counts)


def group_rows_reference(ids_TK: torch.Tensor, num_experts: int, align: int = 1) -> GroupedRows:
    """Plain-Python twin of `group_rows` (CPU, loops): the same layout, for tests."""
    ids = ids_TK.cpu().tolist()
    T = len(ids)
    K = ids_TK.shape[1]
    E = num_experts
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(E)]
    for t in range(T):
        for k in range(K):
            e = ids[t][k]
            if 0 <= e < E:
                pairs[e].append((t, k))
    M = max_rows(T * K, E, align)
    token = [0] * M
    expert = [-1] * M
    row = [[-1] * K for _ in range(T)]
    ends, counts = [], []
    nxt = 0
    for e in range(E):
        for t, k in pairs[e]:
            token[nxt], expert[nxt], row[t][k] = t, e, nxt
            nxt += 1
        counts.append(len(pairs[e]))
        nxt = -(-nxt // align) * align
        ends.append(nxt)
    return GroupedRows(
        token_M=torch.tensor(token, dtype=torch.int64),
        expert_M=torch.tensor(expert, dtype=torch.int32),
        row_TK=torch.tensor(row, dtype=torch.int64).view(T, K),
        ends_E=torch.tensor(ends, dtype=torch.int32),
        counts_E=torch.tensor(counts, dtype=torch.int32),
    )
