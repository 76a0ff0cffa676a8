"""The triton runner's token alignment: kernels vs the torch twin, and the layout's invariants
checked directly (each valid pair once, padding only at segment ends, masked ids left out)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")

from moekit._triton_host import cdiv, next_pow2  # noqa: E402
from moekit.runners._align import (  # noqa: E402
    AlignTuning,
    align_block_size,
    align_block_size_torch,
    max_blocks,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small chunks so that the chunked paths (P > single_max) run in the interpreter quickly; with
# the one-program scan between the chunk kernels (fused_max_chunks 0) unless a case says so.
SMALL_CHUNKS = AlignTuning(single_max=32, min_chunk=16, max_chunks=4, fused_max_chunks=0)


@dataclass(frozen=True)
class Case:
    name: str
    T: int
    K: int
    E: int
    block_m: int
    masked: float = 0.0  # fraction of ids set to -1
    one_expert: bool = False
    tuning: AlignTuning = AlignTuning()


CASES = [
    Case("T0", 0, 2, 4, 16),
    Case("T1", 1, 2, 5, 16),
    Case("odd-E", 9, 3, 7, 16, masked=0.2),
    Case("one-expert", 11, 1, 6, 16, one_expert=True),
    Case("all-masked", 4, 2, 3, 16, masked=1.0),
    Case("bm64", 21, 4, 5, 64, masked=0.1),
    Case("chunked", 23, 3, 6, 16, masked=0.15, tuning=SMALL_CHUNKS),
    Case("chunked-one-expert", 40, 2, 5, 32, one_expert=True, tuning=SMALL_CHUNKS),
    Case("bm1", 37, 4, 9, 1, masked=0.1),
    Case("many-experts", 40, 3, 600, 4, one_expert=True),
    # 10 chunks, scanned 8 at a time (E = 600: [8, 1024] tiles)
    Case("chunked-many-experts", 100, 3, 600, 16, masked=0.1,
         tuning=replace(SMALL_CHUNKS, max_chunks=16)),  # fmt: skip
    # the same two, the chunk histograms summed by the scattering programs (no scan kernel)
    Case("chunked-summed", 23, 3, 6, 16, masked=0.15,
         tuning=replace(SMALL_CHUNKS, fused_max_chunks=64)),
    Case("chunked-many-experts-summed", 100, 3, 600, 16, masked=0.1,
         tuning=replace(SMALL_CHUNKS, max_chunks=16, fused_max_chunks=64)),
]


def make_ids(c: Case) -> torch.Tensor:
    if c.one_expert:
        ids = torch.full((c.T, c.K), c.E - 2, dtype=torch.int32)
    else:
        ids = torch.rand(c.T, c.E).argsort(dim=1)[:, : c.K].to(torch.int32)
    if c.masked:
        ids[torch.rand(c.T, c.K) < c.masked] = -1
    return ids.to(DEVICE)


def check_invariants(out, ids: torch.Tensor, E: int) -> None:
    """The layout's contract, checked without the twin."""
    BM = out.block_m
    P = ids.numel()
    flat = ids.reshape(-1).long().cpu()
    n = int(out.num_rows.item())
    assert n % BM == 0
    rows = out.sorted_ids[:n].long().cpu()
    blocks = out.block_expert.long().cpu()
    valid = (flat >= 0) & (flat < E)
    # each valid pair exactly once, nothing else but the sentinel
    real = rows[rows < P]
    assert torch.equal(torch.sort(real).values, torch.nonzero(valid).flatten())
    assert bool((rows <= P).all())
    # every real row sits in a block of its expert; padding only after the expert's pairs
    counts = torch.bincount(flat[valid], minlength=E)
    assert n == int(sum(-(-int(c) // BM) * BM for c in counts))
    for b in range(n // BM):
        e = int(blocks[b])
        assert 0 <= e < E
        block = rows[b * BM : (b + 1) * BM]
        is_pad = block == P
        assert bool((flat[block[~is_pad]] == e).all())
        if is_pad.any():  # padding is a suffix of the block, and the block ends the segment
            first = int(torch.nonzero(is_pad)[0])
            assert bool(is_pad[first:].all())
            assert b + 1 == n // BM or int(blocks[b + 1]) != e
    assert bool((blocks[n // BM :] == -1).all())
    assert blocks[: n // BM].tolist() == sorted(blocks[: n // BM].tolist())
    assert out.max_blocks == max_blocks(P, E, BM) >= n // BM


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_align_matches_twin_and_invariants(case: Case):
    ids = make_ids(case)
    out = align_block_size(ids, case.E, case.block_m, case.tuning, groups=True)
    ref = align_block_size_torch(ids, case.E, case.block_m, groups=True)
    n = int(ref.num_rows.item())
    assert int(out.num_rows.item()) == n
    assert torch.equal(out.sorted_ids[:n].cpu(), ref.sorted_ids[:n].cpu())
    assert torch.equal(out.block_expert.cpu(), ref.block_expert.cpu())
    assert torch.equal(out.counts.cpu(), ref.counts.cpu())
    assert torch.equal(out.ends.cpu(), ref.ends.cpu())
    check_invariants(out, ids, case.E)
    check_invariants(ref, ids, case.E)
    # the groups: pairs per expert, and each segment ends where its blocks end
    flat = ids.reshape(-1).long().cpu()
    valid = (flat >= 0) & (flat < case.E)
    assert torch.equal(ref.counts.long().cpu(), torch.bincount(flat[valid], minlength=case.E))
    blocks = ref.block_expert.long().cpu()
    for e in range(case.E):
        assert int(ref.ends[e]) == case.block_m * int((blocks[: n // case.block_m] <= e).sum())


def test_ids_out_of_range_are_left_out():
    ids = torch.tensor([[0, 5], [7, 1], [-1, 2]], dtype=torch.int32, device=DEVICE)
    out = align_block_size(ids, 3, 16)
    n = int(out.num_rows.item())
    real = out.sorted_ids[:n].cpu()
    assert sorted(real[real < 6].tolist()) == [0, 3, 5]


def test_max_blocks_is_tight():
    # P pairs all on distinct experts need P blocks; all on one expert need ceil(P / BM)
    assert max_blocks(8, 128, 16) == 8
    assert max_blocks(100, 4, 16) == 4 + 96 // 16
    ids = torch.arange(8, dtype=torch.int32, device=DEVICE).view(1, 8)
    out = align_block_size(ids, 128, 16)
    assert int(out.num_rows.item()) == out.max_blocks * 16


def test_host_sizes_agree_with_triton():
    """cdiv / next_pow2 (the launch wrappers' host twins of triton.cdiv / next_power_of_2)."""
    import triton

    for n in range(1, 5000, 7):
        assert next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d)
    assert next_pow2(0) == 1 and cdiv(0, 64) == 0


def test_bad_arguments():
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        align_block_size(ids.long(), 4, 16)
    with pytest.raises(ValueError, match="power of two"):
        align_block_size(ids, 4, 24)
    with pytest.raises(ValueError, match="local experts"):
        align_block_size(ids, 5000, 16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,K,E,BM", [(1, 8, 128, 16), (64, 8, 128, 16), (300, 8, 128, 64), (8192, 8, 256, 64),
                 (16384, 8, 32, 128)],
)  # fmt: skip
def test_align_gpu_large(T, K, E, BM):
    ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
    ids[torch.rand(T, K, device="cuda") < 0.05] = -1
    ref = align_block_size_torch(ids, E, BM, groups=True)
    n = int(ref.num_rows.item())
    for fused in (0, 64):  # the scan kernel, and the sums in the scatter kernel
        out = align_block_size(ids, E, BM, AlignTuning(fused_max_chunks=fused), groups=True)
        assert int(out.num_rows.item()) == n
        assert torch.equal(out.sorted_ids[:n], ref.sorted_ids[:n])
        assert torch.equal(out.block_expert, ref.block_expert)
        assert torch.equal(out.counts, ref.counts) and torch.equal(out.ends, ref.ends)
