"""The `alltoall` dispatcher (normal, low_latency, auto; fp8; torch and Triton row kernels)
against the single-process reference twin (`moekit.dispatch.reference`), on 2 and 4 spawned
gloo ranks; the same cases on GPUs with NCCL, plus CUDA-graph capture of low-latency mode."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

from moekit.config import DTYPES, ConfigError, ParallelConfig
from moekit.dispatch import registry
from moekit.dispatch.alltoall import NEEDS_DIST, AllToAllDispatcher, CapacityError
from moekit.dispatch.factory import make_dispatcher
from moekit.dispatch.reference import ReferenceAllToAll, moe_reference_ranks
from moekit.dispatch.rows import (
    gather_reduce,
    gather_reduce_torch,
    scatter_rows,
    scatter_rows_torch,
)
from moekit.dispatch.slots import SlotMap
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import detect
from moekit.parallel import init_parallel
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.runners.torch import TorchRunner
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput, StandardRunnerOutput
from tests.dist_utils import ep_inputs, get_pool
from tests.helpers import TOLERANCE, capture_graph, rel_err

FP8_TOL = 1e-5  # fp8 cases compare against the reference fed the same dequantized x


# ---- single process: row kernels, slot map, reference twin --------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_gather_reduce_triton_matches_torch(dtype, weighted):
    src = torch.randn(23, 40).to(dtype)
    src[5] = float("nan")  # never referenced: must not leak
    rows = torch.randint(-3, 27, (9, 4))
    rows[rows == 5] = 6
    w = torch.rand(9, 4) if weighted else None
    ref = gather_reduce_torch(src, rows, w)
    out = gather_reduce(src, rows, w, impl="triton")
    assert torch.isfinite(ref).all() and out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]
    dense = torch.zeros(9, 40, dtype=torch.float64)
    for n in range(9):
        for k in range(4):
            if 0 <= rows[n, k] < 23:
                dense[n] += (1.0 if w is None else w[n, k].item()) * src[rows[n, k]].double()
    assert rel_err(ref, dense) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_triton_matches_torch(dtype):
    src_wide = torch.randn(7, 50).to(dtype)
    src = src_wide[:, 3:43]  # strided rows, as in a packed receive buffer
    dest = torch.randperm(40)[:21].view(7, 3)
    dest[0, 1], dest[3, 2], dest[6, 0] = -1, 40, 99  # skipped
    a = scatter_rows(src, dest, 40, impl="triton")
    b = scatter_rows_torch(src, dest, 40)
    for n in range(7):
        for k in range(3):
            d = int(dest[n, k])
            if 0 <= d < 40:
                assert torch.equal(a[d], src[n]) and torch.equal(b[d], src[n])


def test_gather_reduce_of_empty_inputs():
    assert gather_reduce(torch.randn(0, 8), torch.zeros(3, 2, dtype=torch.long)).abs().sum() == 0
    assert gather_reduce(torch.randn(4, 8), torch.zeros(0, 2, dtype=torch.long)).shape == (0, 8)


@pytest.mark.parametrize("T, redundant", [(0, 0), (5, 0), (8, 0), (7, 3)])
def test_low_latency_plans_triton_match_torch(T, redundant):
    from moekit.dispatch.layout import recv_plan, recv_plan_torch, send_plan, send_plan_torch

    R, E_logical, K, C = 3, 9, 3, 8
    P = E_logical + redundant
    placement = ExpertPlacement(torch.arange(P) % E_logical, R)
    slots, E = SlotMap(placement, E_logical), P // R
    _, (topk,) = ep_inputs(T + 3 * redundant, (T,), E_logical, K, 4, "masked")
    bufs = [torch.zeros(R * C, 3 * K, dtype=torch.int32) for _ in range(2)]
    outs = []
    for buf, fn in zip(bufs, (send_plan_torch, send_plan)):
        ids_v, w_v = buf[:, 1:K + 1], buf[:, K + 1:2 * K + 1].view(torch.float32)
        args = (topk.ids, topk.weights, slots, R, E, C, ids_v, w_v)
        rows = fn(*args) if fn is send_plan_torch else fn(*args, impl="triton")
        outs.append((rows, ids_v, w_v))
    (r0, i0, w0), (r1, i1, w1) = outs
    assert torch.equal(r0, r1) and torch.equal(i0, i1) and torch.equal(w0, w1)
    assert torch.equal(bufs[0][:, 0], bufs[1][:, 0])  # nothing outside the views written
    d0, c0, ww0 = recv_plan_torch(i0, w0, E)
    d1, c1, ww1 = recv_plan(i1, w1, E, impl="triton")
    assert torch.equal(d0, d1) and torch.equal(c0, c1) and torch.equal(ww0, ww1)
    assert int(c0.sum()) == int((topk.ids >= 0).sum())  # every routed pair lands once
    assert sorted(d0[d0 < E * R * C].tolist()) == sorted(set(d0[d0 < E * R * C].tolist()))


@pytest.mark.parametrize("T, redundant, dtype, chunks",
                         [(0, 0, torch.float32, 1), (6, 0, torch.float16, 2),
                          (37, 3, torch.float32, 1), (5, 0, torch.uint8, 1),
                          (300, 0, torch.float32, 3), (300, 3, torch.float16, 4)])
def test_normal_plan_and_pack_triton_match_torch(T, redundant, dtype, chunks):
    """Normal mode's device plan and packing kernel (chunk by chunk, metadata in the same rows
    as the payload) against their twins, and against a direct construction: each token once
    per destination rank; chunks back to back, in a chunk the rank blocks back to back."""
    from moekit.dispatch.layout import (
        MAX_CHUNKS,
        normal_plan,
        normal_plan_torch,
        pack_rows,
        pack_rows_torch,
    )

    R, E_logical, K, H = 3, 9, 3, 10
    P = E_logical + redundant
    placement = ExpertPlacement(torch.arange(P) % E_logical, R)
    slots, E = SlotMap(placement, E_logical), P // R
    _, (topk,) = ep_inputs(T + 11 * redundant, (T,), E_logical, K, 4, "masked")
    if dtype == torch.uint8:  # an odd byte width: the kernel copies byte words
        x = torch.randint(0, 255, (T, 7), dtype=torch.uint8)
    else:
        x = torch.randn(T, H + 4).to(dtype)[:, 2:H + 2]  # strided rows
    ticket = torch.zeros(1, dtype=torch.int32)
    plans = [normal_plan_torch(topk.ids, slots, R, E, chunks),
             normal_plan(topk.ids, slots, R, E, chunks, impl="triton", ticket=ticket)]
    assert plans[0].block == plans[1].block
    for name in ("slot", "local", "base", "counts"):
        assert torch.equal(getattr(plans[0], name).long(), getattr(plans[1], name).long()), name
    assert ticket.item() == 0  # the kernel leaves its counter ready for the next launch
    plan = plans[0]
    assert (plan.counts[:, MAX_CHUNKS] == T).all()
    assert (plan.counts[:, chunks:MAX_CHUNKS] == 0).all()
    # packed rows: payload bytes, then 2K int32 words of metadata
    pbytes = -(-x.shape[1] * x.element_size() // 4) * 4
    fill = 0x2B
    bufs = [torch.full((T * R, pbytes + 8 * K), fill, dtype=torch.uint8) for _ in range(2)]
    outs = [b[:, :x.shape[1] * x.element_size()].view(dtype) for b in bufs]
    metas = [b[:, pbytes:].view(torch.int32) for b in bufs]
    rows = [torch.full((T, R), -7, dtype=torch.int64) for _ in range(2)]
    for bounds in plan.chunk_bounds():
        pack_rows_torch(x, plans[0], topk.weights, E, outs[0], metas[0], rows[0], bounds)
        pack_rows(x, plans[1], topk.weights, E, outs[1], metas[1], rows[1], bounds, impl="triton")
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], plan.rows())
    assert torch.equal(bufs[0], bufs[1])
    # direct construction
    phys = slots.physical(topk.ids)
    n = 0
    for c, (t0, t1) in enumerate(plan.chunk_bounds()):
        for r in range(R):
            start = n
            for t in range(t0, t1):
                here = (phys[t] >= r * E) & (phys[t] < (r + 1) * E)
                if not here.any():
                    assert rows[0][t, r] == -1
                    continue
                assert rows[0][t, r] == n
                assert torch.equal(outs[0][n], x[t])
                ids, w = metas[0][n, :K], metas[0][n, K:].view(torch.float32)
                assert ids.tolist() == torch.where(here, phys[t] - r * E, -1).tolist()
                assert torch.equal(w, torch.where(here, topk.weights[t].float(), 0.0))
                n += 1
            assert plan.counts[r, c] == n - start
    assert (bufs[0][n:] == fill).all()
    assert sum(b - a for a, b in plan.chunk_bounds()) == T


@pytest.mark.parametrize("T, chunks", [(0, 1), (37, 1), (150, 2), (300, 3)])
def test_normal_plan_and_pack_indirect_match_direct(T, chunks):
    """The plan and packing kernels in INDIRECT mode (what the normal-mode CUDA graphs replay:
    T and the input addresses read from an args vector, the grid sized for a larger capacity)
    against the direct launches on the same inputs."""
    from moekit.dispatch._kernels import launch_pack_rows
    from moekit.dispatch.exchange import bucket
    from moekit.dispatch.layout import blocks_per_chunk, normal_plan, pack_rows

    R, E_logical, K, H = 3, 9, 3, 12
    E = E_logical // R
    Tb = bucket(T) + 40  # a capacity well past T
    slots = SlotMap(ExpertPlacement.contiguous(E_logical, R), E_logical)
    _, (topk,) = ep_inputs(T, (T,), E_logical, K, 4, "masked")
    x = torch.randn(T, H + 2).to(torch.float16)[:, :H]  # strided rows of whole 4-byte words
    ids, w = topk.ids.to(torch.int32).contiguous(), topk.weights.float().contiguous()
    nw = H * 2 // 4
    args = torch.tensor([T, ids.data_ptr(), x.data_ptr(), w.data_ptr(), x.stride(0) // 2, 0])
    ticket = torch.zeros(1, dtype=torch.int32)
    direct = normal_plan(ids, slots, R, E, chunks, impl="triton", ticket=ticket)
    shape_ids = torch.empty(Tb, K, dtype=torch.int32)
    ind = normal_plan(shape_ids, slots, R, E, chunks, impl="triton", ticket=ticket, args=args)
    assert torch.equal(ind.counts, direct.counts)  # T in the last column: the real T
    assert direct.block == ind.block
    assert torch.equal(ind.local[:T], direct.local) and torch.equal(ind.slot[:T], direct.slot)
    nb = -(-T // direct.block)
    assert torch.equal(ind.base[:nb], direct.base)
    assert blocks_per_chunk(T, ind.block, chunks) == direct.blocks_per_chunk
    row = H * 2 + 8 * K
    bufs = [torch.zeros(Tb * R, row, dtype=torch.uint8) for _ in range(2)]
    rows = [torch.full((Tb, R), -7, dtype=torch.int64) for _ in range(2)]
    pack_rows(x, direct, w, E, bufs[0][:, :H * 2].view(torch.float16),
              bufs[0][:, H * 2:].view(torch.int32), rows[0], None, "triton")
    shape_x = torch.empty(1, nw, dtype=torch.int32).expand(Tb, nw)
    shape_w = torch.empty(1, K, dtype=torch.float32).expand(Tb, K)
    launch_pack_rows(shape_x, ind.slot, shape_w, ind.local, ind.base, rows[1],
                     bufs[1][:, :H * 2].view(torch.int32), bufs[1][:, H * 2:].view(torch.int32),
                     E, ind.block, 0, Tb, args)
    assert torch.equal(bufs[0], bufs[1])
    assert torch.equal(rows[0][:T], rows[1][:T]) and (rows[1][T:] == -7).all()


def test_normal_plan_block_grows_for_large_batches():
    """Past PLAN_TILE / R blocks the plan block doubles (the last program's tile stays small);
    the kernel and its twin agree there too."""
    from moekit.dispatch.layout import PLAN_TILE, _plan_block, normal_plan, normal_plan_torch

    R, K, E_logical = 33, 2, 66  # 64 rank lanes: at most PLAN_TILE / 64 = 64 blocks
    assert _plan_block(R, K, 64 * 64) == 64 and _plan_block(R, K, 64 * 64 + 1) == 128
    assert -(-(10 ** 7) // _plan_block(4, 8, 10 ** 7)) <= PLAN_TILE // 4
    slots = SlotMap(ExpertPlacement.contiguous(E_logical, R), E_logical)
    g = torch.Generator().manual_seed(5)
    T = 64 * 64 + 300
    ids = torch.stack([torch.randperm(E_logical, generator=g)[:K] for _ in range(T)])
    a = normal_plan_torch(ids, slots, R, 2, 3)
    b = normal_plan(ids, slots, R, 2, 3, impl="triton", ticket=torch.zeros(1, dtype=torch.int32))
    assert a.block == b.block == 128
    for name in ("slot", "local", "base", "counts"):
        assert torch.equal(getattr(a, name).long(), getattr(b, name).long()), name


def test_normal_plan_many_blocks_and_ranks():
    """The plan kernel's cross-block prefix (its last program) over several chunks of blocks,
    and a rank count that is not a power of two, against the twin."""
    from moekit.dispatch.layout import _plan_block, normal_plan, normal_plan_torch

    R, E_logical, K = 6, 24, 4
    slots = SlotMap(ExpertPlacement.contiguous(E_logical, R), E_logical)
    block = _plan_block(R, K)
    T = block * 9 + 5
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E_logical, generator=g)[:K] for _ in range(T)])
    ids[::7, 1] = -1
    ticket = torch.zeros(1, dtype=torch.int32)
    for chunks in (1, 3):
        a = normal_plan_torch(ids, slots, R, E_logical // R, chunks)
        b = normal_plan(ids, slots, R, E_logical // R, chunks, impl="triton", ticket=ticket)
        for name in ("slot", "local", "base", "counts"):
            assert torch.equal(getattr(a, name).long(), getattr(b, name).long()), name
        rows = a.rows()
        sent = rows[rows >= 0]
        n = int(a.counts[:, :-1].sum())
        assert sorted(sent.tolist()) == list(range(n))  # a permutation, no gaps


@pytest.mark.parametrize("dtype, H", [(torch.float32, 300), (torch.float16, 256)])
def test_fp8_unpack_scatter_triton_matches_torch(dtype, H):
    """Low-latency fp8 receive: the fused dequantize + scatter kernel against unpack, then
    scatter_rows, on strided rows of a packed buffer (metadata after the payload)."""
    from moekit.dispatch.alltoall import RowLayout

    layout = RowLayout(H, dtype, top_k=2, fp8=True)
    N, M = 9, 20
    x = (torch.randn(N, H) * 3).to(dtype)
    buf = torch.zeros(N, layout.row_bytes, dtype=torch.uint8)
    layout.payload_view(buf).copy_(layout.pack_tokens(x))
    dest = torch.tensor([[3, 17], [0, -1], [5, 20], [1, 2], [4, 6], [7, 8], [9, 10], [11, 12],
                         [-1, 19]])
    payload = layout.payload_view(buf)
    ref = layout.unpack_scatter(payload, dest, M, impl="torch")
    got = layout.unpack_scatter(payload, dest, M, impl="triton")
    written = dest[(dest >= 0) & (dest < M)]
    assert torch.equal(got[written], ref[written])
    assert rel_err(got[written[:2]], x[[0, 0]]) < 0.07  # row 0 went to 3 and 17


def test_slot_map_spreads_copies_like_the_reference():
    placement = ExpertPlacement(torch.tensor([0, 1, 2, 3, 0, 1, 0, 2]), ep_size=2)
    ids = torch.tensor([[0, 1], [0, 3], [2, -1], [0, 1], [1, 2]], dtype=torch.int32)
    ref = ReferenceAllToAll(placement)
    assert torch.equal(SlotMap(placement, 4).physical(ids).int(), ref.physical_ids(TopKOutput(
        torch.rand(5, 2), ids)))
    first = SlotMap(placement, 4, spread=False).physical(ids)
    assert first.tolist() == [[0, 1], [0, 3], [2, -1], [0, 1], [1, 2]]
    with pytest.raises(ValueError, match="no slot for logical experts"):
        SlotMap(ExpertPlacement(torch.tensor([0, 1, 1, 3]), 2), 4)


@pytest.mark.parametrize("T, spread", [(0, False), (1, False), (37, False), (37, True)])
def test_local_ids_kernel_matches_torch_twin(T, spread):
    # 10 slots over 2 ranks: logical experts 0, 1 and 3 have a second copy on rank 1
    placement = ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 6]), ep_size=2)
    slots = SlotMap(placement, 7, spread=spread)
    _, (topk,) = ep_inputs(T + 5, (T,), 7, 3, 4, "masked")
    for rank in range(2):
        ref = slots.local_ids_torch(topk.ids, rank)
        got = slots.local_ids(topk.ids, rank, impl="triton")
        assert got.dtype == torch.int32 and got.shape == (T, 3)
        assert torch.equal(got, ref)
    if T:  # every routed pair is local on exactly one rank
        hits = sum((slots.local_ids(topk.ids, r, impl="triton") >= 0).int() for r in range(2))
        assert torch.equal(hits, (topk.ids >= 0).int())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 300])
def test_local_ids_kernel_after_the_routing_kernel_gpu(T):
    """On sm_90+ the routing kernel lets the local-ids kernel start early and that one waits
    on the GPU for the ids (programmatic dependent launches): the ids it maps are the new ones,
    eagerly and in a CUDA graph replayed on other logits."""
    from moekit.router import select_experts_fused

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    placement = ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 3, 6]), ep_size=2)
    slots = SlotMap(placement, 7)
    logits = torch.randn(T, 7, device="cuda")

    def step():
        return slots.local_ids(select_experts_fused(logits, 3).ids, 1)

    assert torch.equal(step(), slots.local_ids_torch(select_experts_fused(logits, 3).ids, 1))
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        want = slots.local_ids_torch(select_experts_fused(logits, 3).ids, 1)
        assert torch.equal(out, want)


def _global_weights(seed: int, E: int, H: int, I: int, dtype, p2l: torch.Tensor):
    """Logical experts from `seed`, laid out per physical slot (copies share weights)."""
    g = torch.Generator().manual_seed(seed + 7)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5)[p2l]
    w2 = (torch.randn(E, H, I, generator=g) * I**-0.5)[p2l]
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("routing", ["random", "masked", "skewed", "one_expert"])
def test_reference_twin_matches_dense_moe(routing):
    """The reference's dispatch -> torch runner -> combine equals the plain MoE per rank."""
    R, E, K, H, I, C = 3, 6, 2, 16, 8, 5
    placement = ExpertPlacement(torch.arange(9) % E, R)
    xs, topks = ep_inputs(11, (4, 0, 5), E, K, H, routing, skew_experts=3)
    w13, w2 = _global_weights(3, E, H, I, torch.float32, placement.physical_to_logical)
    act, runner, ref = ActivationSpec(), TorchRunner(), ReferenceAllToAll(placement)
    local = [ExpertWeights(w13[r * 3:(r + 1) * 3], w2[r * 3:(r + 1) * 3]) for r in range(R)]
    expected = moe_reference_ranks(xs, topks, placement, ExpertWeights(w13, w2), act)
    d = ref.dispatch_normal(xs, topks)
    normal = ref.combine_normal([runner.run(d[r], local[r], act).out for r in range(R)], d[0].handle)
    m = ref.dispatch_masked(xs, topks, C)
    masked = ref.combine_masked([runner.run(m[r], local[r], act).out for r in range(R)], m[0].handle)
    for s in range(R):
        assert rel_err(normal[s], expected[s]) < 1e-5
        assert rel_err(masked[s], expected[s]) < 1e-5


def test_masked_expected_rows_is_the_mean_count_under_uniform_routing():
    """expected_rows (the runners' size hint) is the mean rows per local expert of uniformly
    routed tokens, redundant copies included: rank 0 holds two of expert 0's three copies."""
    R, E, K, H, T = 2, 4, 2, 8, 3000
    placement = ExpertPlacement(torch.tensor([0, 1, 2, 0, 3, 4, 5, 0]), R)
    ref = ReferenceAllToAll(placement)
    assert ref.local_share(0) == pytest.approx((2 / 3 + 2) / 6)
    xs, topks = ep_inputs(2, (T, T), 6, K, H)
    for r, m in enumerate(ref.dispatch_masked(xs, topks, T)):
        mean = m.counts.float().mean().item()
        assert m.expected_rows == math.ceil(R * T * K * ref.local_share(r) / E)
        assert abs(mean - m.expected_rows) < 0.05 * m.expected_rows, (r, mean)


def test_single_rank_dispatcher_and_capacity_error():
    E, K, H, I = 6, 2, 16, 8
    placement = ExpertPlacement.contiguous(E)
    (x,), (topk,) = ep_inputs(5, (9,), E, K, H)
    w13, w2 = _global_weights(1, E, H, I, torch.float32, placement.physical_to_logical)
    w, act = ExpertWeights(w13, w2), ActivationSpec()
    (expected,) = moe_reference_ranks([x], [topk], placement, w, act)
    for mode, impl in (("normal", "torch"), ("normal", "triton"), ("low_latency", "torch"),
                       ("low_latency", "triton"), ("auto", "auto")):
        d = AllToAllDispatcher(placement, mode=mode, max_dispatch_tokens_per_rank=9, impl=impl)
        out = d.dispatch(x, topk)
        assert isinstance(out, StandardDispatchOutput if mode == "normal" else MaskedDispatchOutput)
        assert rel_err(d.combine(TorchRunner().run(out, w, act), out), expected) < 1e-5
    small = AllToAllDispatcher(placement, mode="low_latency", max_dispatch_tokens_per_rank=8)
    with pytest.raises(CapacityError, match="9 tokens.*--max-dispatch-tokens-per-rank 8"):
        small.dispatch(x, topk)
    auto = AllToAllDispatcher(placement, mode="auto", max_dispatch_tokens_per_rank=8)
    assert isinstance(auto.dispatch(x, topk), StandardDispatchOutput)  # falls back to normal


def test_availability_and_factory_errors():
    platform, parallel = detect(), ParallelConfig()
    avail = registry.availability("alltoall", platform, parallel)
    assert not avail and avail.reason == NEEDS_DIST
    assert "several processes" in NEEDS_DIST
    for name in ("deepep", "mooncake", "flashinfer", "ascend_fuseep"):
        reason = registry.availability(name, platform, parallel).reason
        assert reason and reason == registry.UNAVAILABLE_REASONS[name]
        with pytest.raises(ConfigError, match=f"--moe-a2a-backend {name}"):
            make_dispatcher(ParallelConfig(moe_a2a_backend=name), ExpertPlacement.contiguous(4), 4)
    with pytest.raises(ConfigError, match="several processes"):
        make_dispatcher(ParallelConfig(moe_a2a_backend="alltoall"), ExpertPlacement.contiguous(4), 4)
    with pytest.raises(ConfigError, match="--deepep-mode"):
        AllToAllDispatcher(ExpertPlacement.contiguous(4), mode="fast")
    with pytest.raises(ConfigError, match="must equal the EP group size"):
        AllToAllDispatcher(ExpertPlacement.contiguous(4, ep_size=2))


@pytest.mark.gpu
def test_row_kernels_and_plans_on_gpu_bf16():
    from moekit.dispatch.layout import recv_plan, recv_plan_torch, send_plan, send_plan_torch

    dev = "cuda"
    src = torch.randn(300, 7168, device=dev).to(torch.bfloat16)
    src[7] = float("nan")
    rows = torch.randint(-1, 310, (128, 8), device=dev)
    rows[rows == 7] = 8
    w = torch.rand(128, 8, device=dev)
    assert rel_err(gather_reduce(src, rows, w), gather_reduce_torch(src, rows, w)) < 1e-2
    dest = torch.randperm(400, device=dev)[:256].view(128, 2)
    a, b = scatter_rows(src[:128], dest, 400), scatter_rows_torch(src[:128], dest, 400)
    # a bit copy, NaN row 7 included (NaN != NaN, so compare the bits)
    assert torch.equal(a[dest.flatten()].view(torch.int16), b[dest.flatten()].view(torch.int16))
    R, C, E_logical, K = 4, 128, 256, 8
    placement = ExpertPlacement(torch.arange(E_logical), R)
    slots = SlotMap(placement, E_logical)
    _, (topk,) = ep_inputs(0, (100,), E_logical, K, 4, "masked")
    topk = TopKOutput(topk.weights.to(dev), topk.ids.to(dev))
    got = []
    for fn in (send_plan_torch, send_plan):
        buf = torch.zeros(R * C, 2 * K, dtype=torch.int32, device=dev)
        ids_v, w_v = buf[:, :K], buf[:, K:].view(torch.float32)
        rows_TR = fn(topk.ids, topk.weights, slots, R, 64, C, ids_v, w_v)
        got.append((rows_TR, ids_v, w_v) + tuple(recv_plan(ids_v, w_v, 64)))
    ref = recv_plan_torch(got[0][1], got[0][2], 64)
    for x, y in zip(got[0][:3] + ref, got[1]):
        assert torch.equal(x, y)
    for rank in (0, 3):  # the none dispatcher's local ids: kernel against its twin
        assert torch.equal(slots.local_ids(topk.ids, rank), slots.local_ids_torch(topk.ids, rank))
    # normal mode: device plan + packing kernel against the twins at the deepseek-v3 row size
    from moekit.dispatch.layout import normal_plan, normal_plan_torch, pack_rows, pack_rows_torch

    _, (topk,) = ep_inputs(1, (700,), E_logical, K, 4, "masked")
    topk = TopKOutput(topk.weights.to(dev), topk.ids.to(dev))
    x = torch.randn(700, 7168, device=dev).to(torch.bfloat16)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)
    plans = [normal_plan_torch(topk.ids, slots, R, 64, 3),
             normal_plan(topk.ids, slots, R, 64, 3, ticket=ticket)]
    for _ in range(2):  # the ticket is reused: the second launch must see it zeroed
        plans[1] = normal_plan(topk.ids, slots, R, 64, 3, ticket=ticket)
    for name in ("slot", "local", "base", "counts"):
        assert torch.equal(getattr(plans[0], name).long(), getattr(plans[1], name).long()), name
    row_bytes = 7168 * 2 + 8 * K  # packed rows: payload, then ids and weights
    bufs = [torch.zeros(700 * R, row_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]
    rows = [torch.empty(700, R, dtype=torch.int64, device=dev) for _ in range(2)]
    for bounds in plans[0].chunk_bounds():
        for fn, p, b, r in ((pack_rows_torch, plans[0], bufs[0], rows[0]),
                            (pack_rows, plans[1], bufs[1], rows[1])):
            fn(x, p, topk.weights, 64, b[:, :7168 * 2].view(torch.bfloat16),
               b[:, 7168 * 2:].view(torch.int32), r, bounds)
    assert torch.equal(rows[0], rows[1]) and torch.equal(bufs[0], bufs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_single_rank_low_latency_has_no_host_sync_and_captures(fp8):
    """Low-latency dispatch -> masked torch runner -> combine on one GPU: no host
    synchronisation (sync debug mode 'error'), then a CUDA graph replay matches eager."""
    E, K, H, I, T, dev = 16, 4, 256, 64, 24, "cuda"
    placement = ExpertPlacement.contiguous(E)
    d = AllToAllDispatcher(placement, mode="low_latency", max_dispatch_tokens_per_rank=32,
                           fp8_dispatch=fp8)
    w13, w2 = _global_weights(2, E, H, I, torch.bfloat16, placement.physical_to_logical)
    w, act, runner = ExpertWeights(w13.to(dev), w2.to(dev)), ActivationSpec(), TorchRunner()
    (x,), (topk,) = ep_inputs(3, (T,), E, K, H, "masked", torch.bfloat16)
    x, topk = x.to(dev), TopKOutput(topk.weights.to(dev), topk.ids.to(dev))

    def layer():
        out = d.dispatch(x, topk)
        return d.combine(runner.run(out, w, act), out)

    eager = layer()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    (ref,) = moe_reference_ranks([x.cpu()], [TopKOutput(topk.weights.cpu(), topk.ids.cpu())],
                                 placement, ExpertWeights(w13, w2), act)
    assert rel_err(eager, ref) < (0.08 if fp8 else TOLERANCE[torch.bfloat16])
    graph, static = capture_graph(layer)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(static, layer()) < 1e-3


# ---- multi-process cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class A2A:
    """One dispatcher case: Ts = tokens of each rank of the world."""

    name: str
    Ts: tuple[int, ...]
    mode: str = "normal"
    routing: str = "random"
    E: int = 8
    K: int = 2
    H: int = 32
    I: int = 16
    capacity: int = 8
    fp8: bool = False
    impl: str = "torch"
    dtype: str = "float32"
    redundant: int = 0
    tp: int | None = None  # EP group size; default the world (smaller: data-parallel replicas)
    expect: str | None = None  # 'standard' / 'masked': the format auto must pick
    overflow: bool = False  # every rank is over capacity: CapacityError before communicating
    chunks: int | None = None  # --normal-chunks (None: by payload size, chunk_bytes each)
    chunk_bytes: int | None = None  # the dispatcher's payload per chunk (default: its own)


def run_a2a_case(case: A2A, device_type: str = "cpu") -> str:
    """On every rank: dispatch -> torch runner -> combine, checked stage by stage against the
    reference twin simulating this rank's EP group, and end to end against the fp64 MoE."""
    world = dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else None
    dev = dev or torch.device("cpu")
    R = case.tp or world
    parallel = ParallelConfig(
        tp_size=R, ep_size=R, moe_a2a_backend="alltoall", deepep_mode=case.mode,
        max_dispatch_tokens_per_rank=case.capacity, ep_num_redundant_experts=case.redundant,
    )
    state = init_parallel(parallel)
    P = case.E + case.redundant
    placement = ExpertPlacement(torch.arange(P) % case.E, R)
    dtype = DTYPES[case.dtype]
    xs_all, topks_all = ep_inputs(zlib.crc32(case.name.encode()) % 1000, case.Ts, case.E, case.K, case.H,
                                  case.routing, dtype, skew_experts=P // R)
    xs = [xs_all[r] for r in state.ep_ranks]
    topks = [topks_all[r] for r in state.ep_ranks]
    me = state.ep_rank
    d = make_dispatcher(parallel, placement, case.E, state=state, ep_rank=me, fp8_dispatch=case.fp8)
    d.impl = case.impl
    d.normal_chunks = case.chunks
    d.chunk_bytes = case.chunk_bytes or d.chunk_bytes
    if case.chunks not in (None, 1) or case.chunk_bytes:
        d.p2p = None  # chunks are the NCCL transport's (p2p, the default on GPUs, has none)
    x_me = xs[me].to(dev)
    topk_me = TopKOutput(topks[me].weights.to(dev), topks[me].ids.to(dev))
    if case.overflow:
        with pytest.raises(CapacityError, match="--max-dispatch-tokens-per-rank"):
            d.dispatch(x_me, topk_me)
        return "overflow"
    out = d.dispatch(x_me, topk_me)
    if case.expect:
        assert out.format == case.expect, (out.format, case.expect)

    def same_rows(got, want):  # bit-exact moves; fp8 rows within one fp8 step
        return torch.equal(got.cpu(), want) if not case.fp8 else rel_err(got, want) < 0.07

    if case.fp8:  # the reference gets the values the receiver dequantizes
        from moekit.quant.act_quant import fake_quantize_act

        xs = [fake_quantize_act(x, "token_group", torch.float8_e4m3fn, group_size=128)
              for x in xs]
    ref = ReferenceAllToAll(placement)
    w13, w2 = _global_weights(zlib.crc32(case.name.encode()) % 1000, case.E, case.H, case.I, dtype,
                              placement.physical_to_logical)
    n = placement.slots_per_rank
    local = [ExpertWeights(w13[r * n:(r + 1) * n], w2[r * n:(r + 1) * n]) for r in range(R)]
    mine = ExpertWeights(local[me].w13.to(dev), local[me].w2.to(dev))
    act, runner = ActivationSpec(), TorchRunner()

    if isinstance(out, MaskedDispatchOutput):
        ref_d = ref.dispatch_masked(xs, topks, case.capacity)
        assert out.x.shape == (n, R * case.capacity, case.H)
        assert torch.equal(out.counts.cpu(), ref_d[me].counts)
        assert out.expected_rows == ref_d[me].expected_rows
        for e, c in enumerate(ref_d[me].counts.tolist()):
            assert same_rows(out.x[e, :c], ref_d[me].x[e, :c]), f"expert {e} rows"
        ref_y = [runner.run(ref_d[r], local[r], act).out for r in range(R)]
        ref_out = ref.combine_masked(ref_y, ref_d[0].handle)[me]
    else:
        from moekit.dispatch.alltoall import RowLayout
        from moekit.dispatch.layout import _plan_block, chunk_tokens

        row_bytes = RowLayout(case.H, dtype, case.K, case.fp8).row_bytes
        sizes = [chunk_tokens(x.shape[0], _plan_block(R, case.K, x.shape[0]),
                              d.chunks_for(x.shape[0], row_bytes)) for x in xs]
        ref_d = ref.dispatch_normal(xs, topks, sizes)
        assert len(out.handle.send_splits) == max(d.chunks_for(x.shape[0], row_bytes) for x in xs)
        assert same_rows(out.x, ref_d[me].x), "received rows"
        assert torch.equal(out.topk.ids.cpu(), ref_d[me].topk.ids), "local ids"
        assert torch.equal(out.topk.weights.cpu(), ref_d[me].topk.weights), "weights"
        ref_y = [runner.run(ref_d[r], local[r], act).out for r in range(R)]
        ref_out = ref.combine_normal(ref_y, ref_d[0].handle)[me]
    result = d.combine(runner.run(out, mine, act), out)
    assert result.shape == x_me.shape and result.dtype == dtype
    tol = TOLERANCE[dtype]
    assert rel_err(result, ref_out) < tol, "combine vs reference combine"
    expected = moe_reference_ranks(xs, topks, placement, ExpertWeights(w13, w2), act)[me]
    assert rel_err(result, expected) < tol, "end to end vs fp64 MoE"
    return out.format


def _cases_2() -> list[A2A]:
    base = [
        A2A("normal", (7, 5)),
        A2A("normal-zero-rank", (0, 6)),
        A2A("normal-all-empty", (0, 0)),
        A2A("normal-skewed", (6, 9), routing="skewed"),
        A2A("normal-masked-ids", (8, 3), routing="masked"),
        A2A("normal-one-expert", (5, 4), routing="one_expert"),
        A2A("normal-redundant", (9, 7), E=6, redundant=2),
        A2A("normal-odd", (13, 2), E=6, K=3, H=24, I=10),
        A2A("normal-fp8", (6, 5), H=160, fp8=True),
        A2A("normal-triton-fp16", (7, 4), impl="triton", dtype="float16"),
        A2A("normal-3-chunks", (300, 200), chunks=3),
        A2A("normal-chunks-by-size-uneven", (300, 40), chunk_bytes=12000, routing="skewed"),
        A2A("normal-chunks-triton-fp8", (260, 0), H=160, chunks=2, impl="triton",
            dtype="float16", fp8=True),
        A2A("ll", (7, 5), mode="low_latency"),
        A2A("ll-zero-rank", (0, 3), mode="low_latency"),
        A2A("ll-full-one-expert", (8, 8), mode="low_latency", routing="one_expert"),
        A2A("ll-skewed", (8, 2), mode="low_latency", routing="skewed"),
        A2A("ll-masked-ids", (6, 6), mode="low_latency", routing="masked"),
        A2A("ll-redundant", (5, 7), mode="low_latency", E=6, redundant=2),
        A2A("ll-fp8", (4, 6), mode="low_latency", H=160, fp8=True),
        A2A("ll-triton-fp16", (6, 3), mode="low_latency", impl="triton", dtype="float16"),
        A2A("ll-overflow", (9, 12), mode="low_latency", overflow=True),
        A2A("auto-decode", (3, 8), mode="auto", expect="masked"),
        A2A("auto-prefill-one-rank-over", (3, 9), mode="auto", expect="standard"),
    ]
    return base


def _cases_4() -> list[A2A]:
    return [
        A2A("4-normal-uneven", (5, 0, 9, 3)),
        A2A("4-normal-skewed", (4, 6, 2, 7), routing="skewed"),
        A2A("4-normal-chunks-uneven", (140, 0, 300, 20), chunk_bytes=10000),
        A2A("4-ll-uneven", (4, 8, 0, 2), mode="low_latency"),
        A2A("4-ll-one-expert", (8, 8, 8, 8), mode="low_latency", routing="one_expert"),
        A2A("4-auto-mixed", (2, 3, 11, 0), mode="auto", expect="standard"),
        A2A("4-dp2-ep2-normal", (5, 3, 0, 6), tp=2, E=6),
        A2A("4-dp2-ep2-ll", (5, 3, 8, 1), tp=2, mode="low_latency"),
    ]


@pytest.mark.parametrize("case", _cases_2(), ids=lambda c: c.name)
def test_alltoall_2_ranks(case):
    get_pool(2).run(run_a2a_case, case)


@pytest.mark.parametrize("case", _cases_4(), ids=lambda c: c.name)
def test_alltoall_4_ranks(case):
    get_pool(4).run(run_a2a_case, case)


# ---- GPUs: NCCL, no host sync in low-latency mode, CUDA-graph capture ------------------------


def _gpu_world() -> int:
    return min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0


def _gpu_cases() -> list[A2A]:
    out = []
    for c in _cases_2() + _cases_4():
        if c.tp is None and len(c.Ts) != 2:
            continue
        out.append(replace(c, impl="auto", dtype="bfloat16" if c.dtype == "float32" else c.dtype))
    out.append(A2A("gpu-normal-big", (300, 257), H=256, I=64, E=16, K=4, dtype="bfloat16",
                   impl="auto"))
    out.append(A2A("gpu-ll-big", (64, 33), mode="low_latency", capacity=64, H=256, I=64, E=16,
                   K=4, dtype="bfloat16", impl="auto"))
    return out


@pytest.mark.multigpu
@pytest.mark.parametrize("case", _gpu_cases(), ids=lambda c: c.name)
def test_alltoall_nccl_2_gpus(case):
    get_pool(2, "nccl").run(run_a2a_case, case, "cuda")


def run_graph_case(T: int, capacity: int, fp8: bool) -> float:
    """Low-latency dispatch -> masked torch runner -> combine over NCCL, captured in a CUDA graph
    and replayed on fresh inputs (eager calls in between); returns the max rel. error vs eager."""
    R, E, K, H, I = dist.get_world_size(), 16, 4, 256, 64
    dev = torch.device("cuda", torch.cuda.current_device())
    placement = ExpertPlacement(torch.arange(E), R)
    d = AllToAllDispatcher(placement, group=dist.group.WORLD, mode="low_latency",
                           max_dispatch_tokens_per_rank=capacity, fp8_dispatch=fp8)
    n = E // R
    w13, w2 = _global_weights(4, E, H, I, torch.bfloat16, placement.physical_to_logical)
    me = dist.get_rank()
    w = ExpertWeights(w13[me * n:(me + 1) * n].to(dev), w2[me * n:(me + 1) * n].to(dev))
    act, runner = ActivationSpec(), TorchRunner()

    def layer(x, topk):
        out = d.dispatch(x, topk)
        return d.combine(runner.run(out, w, act), out)

    def inputs(seed):
        xs, topks = ep_inputs(seed, (T,) * R, E, K, H, "random", torch.bfloat16)
        return xs[me].to(dev), TopKOutput(topks[me].weights.to(dev), topks[me].ids.to(dev))

    x0, t0 = inputs(1)
    layer(x0, t0)  # warm-up: NCCL communicator, kernels
    torch.cuda.synchronize()
    # a host synchronisation inside the capture below would fail it
    static_x, static_w, static_ids = x0.clone(), t0.weights.clone(), t0.ids.clone()
    graph, static_out = capture_graph(lambda: layer(static_x, TopKOutput(static_w, static_ids)))
    worst = 0.0
    for seed in (2, 3):
        x, topk = inputs(seed)
        static_x.copy_(x)
        static_w.copy_(topk.weights)
        static_ids.copy_(topk.ids)
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, rel_err(static_out, layer(x, topk)))
    return worst


@pytest.mark.multigpu
@pytest.mark.parametrize("fp8", [False, True])
def test_low_latency_cuda_graph_capture(fp8):
    results = get_pool(2, "nccl").run(run_graph_case, 32, 32, fp8)
    assert max(results) < 1e-3, results


def run_normal_graphs_case() -> list[int]:
    """Normal mode with the plan + counts exchange ('plan') and also the packing ('pack')
    replayed from CUDA graphs, call after call with changing T per rank (new buckets, a
    shrinking T inside one bucket, a bucket larger than the shared buffers, several chunks),
    against the same dispatcher without graphs: the same rows, ids, weights and combine, bit
    for bit. Returns the number of graphs each captured."""
    R, E, K, H = dist.get_world_size(), 16, 4, 256
    dev = torch.device("cuda", torch.cuda.current_device())
    me = dist.get_rank()
    placement = ExpertPlacement(torch.arange(E), R)
    ds = {m: AllToAllDispatcher(placement, group=dist.group.WORLD, mode="normal",
                                normal_graphs=m.removesuffix("2"), normal_transport="nccl")
          for m in ("none", "plan", "pack", "pack2")}  # two 'pack' ones share the send buffer
    for d in ds.values():
        d.chunk_bytes = 64 * (2 * H + 8 * K)  # chunks of 64 tokens
    for i, Ts in enumerate([(37, 300), (300, 37), (200, 150), (130, 150), (0, 9), (290, 290),
                            (600, 20)]):
        xs, topks = ep_inputs(i, Ts[:R] + (5,) * (R - 2), E, K, H, "random", torch.bfloat16)
        x = xs[me].to(dev)
        topk = TopKOutput(topks[me].weights.to(dev), topks[me].ids.to(dev))
        outs = {m: d.dispatch(x, topk) for m, d in ds.items()}
        y = StandardRunnerOutput(outs["none"].x.float().mul(1.5).to(x.dtype))  # a fake runner
        want = ds["none"].combine(y, outs["none"])
        for m in ("plan", "pack", "pack2"):
            a, b = outs[m], outs["none"]
            assert a.handle.send_splits == b.handle.send_splits, (m, i)
            assert torch.equal(a.x, b.x) and torch.equal(a.topk.ids, b.topk.ids), (m, i)
            assert torch.equal(a.topk.weights, b.topk.weights), (m, i)
            assert torch.equal(ds[m].combine(y, a), want), (m, i)
    return [ds[m].exchange.captures for m in ("plan", "pack", "pack2")]


@pytest.mark.multigpu
def test_normal_mode_plan_graphs_match_eager():
    captured = get_pool(2, "nccl").run(run_normal_graphs_case)
    assert min(min(c) for c in captured) >= 3, captured  # graphs were used (not on call 1)


# ---- the EP benchmark's code path, tiny shapes on gloo ----------------------------------------


def run_bench_case(out_dir: str) -> dict:
    from moekit.bench_ep import main

    return main(["--out", f"{out_dir}/ep_bench.json", "--num-experts", "8", "--top-k", "2",
                 "--hidden-size", "32", "--intermediate-size", "16", "--dtype", "float32",
                 "--prefill-tokens", "24", "--decode-tokens", "4", "--iters", "2", "--warmup", "1",
                 "--graph-reps", "2", "--runner", "torch", "--routing", "zipf",
                 "--normal-chunks", "3,default,auto/pack,1/none"])


def test_ep_bench_runs_on_gloo(tmp_path):
    import json

    docs = get_pool(2).run(run_bench_case, str(tmp_path))
    doc = json.loads((tmp_path / "ep_bench.json").read_text())
    assert doc["errors"] == {} and docs[1]["errors"] == {}
    assert doc["world_size"] == 2 and doc["shape"]["num_experts"] == 8
    n = doc["normal"]
    assert [r["rank"] for r in n["per_rank"]] == [0, 1]
    assert all(r["rows_sent"] > 0 and r["dispatch_combine_ms"] > 0 for r in n["per_rank"])
    assert n["aggregate"]["ratio_of_max"] > 0 and "meets_target" in n["aggregate"]
    phases = n["aggregate"]["phases_ms_max"]
    assert set(phases) == {"plan", "gather", "count_sync", "payload_a2a", "unpack",
                           "combine"} and all(v >= 0 for v in phases.values())
    assert n["aggregate"]["headline_chunks"] == "3" and n["aggregate"]["calls_max"] == 3
    assert set(n["aggregate"]["variants_ratio_of_max"]) == {"3", "default", "auto/pack", "1/none"}
    ll = doc["low_latency"]["aggregate"]
    assert ll["dispatch_ms_max"] > 0 and ll["combine_ms_max"] > 0
    layer = doc["layer"]["aggregate"]
    assert [r["batch"] for r in layer] == ["prefill", "decode"]
    assert all(r["ep_ms_max"] > 0 and r["tp_ms_max"] > 0 for r in layer)
    assert layer[0]["global_tokens"] == 48 and layer[0]["ep_runner"] == "torch"


def test_packing_stage_is_shared_and_growth_drops_stale_graphs():
    """The NCCL path's packing stage: one per (device, ranks, layout) in the process, shared by
    every exchange; when a larger bucket grows it, every exchange forgets the graphs that
    captured the old one (CPU tensors stand in for the device ones)."""
    from types import SimpleNamespace

    from moekit.dispatch import exchange as ex
    from moekit.dispatch.exchange import PackJob, PlanExchange

    slots = SlotMap(ExpertPlacement.contiguous(8, 2), 8)
    a, b = PlanExchange(slots, 2, 4, None), PlanExchange(slots, 2, 4, None)
    dev = torch.device("cpu")
    job = PackJob(torch.zeros(3, 16), torch.zeros(3, 2), 4, 64, 80)
    layout = ("test-layout", id(a))  # a key no other test uses
    small = a._stage(dev, 32, job, layout)
    assert b._stage(dev, 16, job, layout) is small  # shared, and big enough
    assert small.send.shape == (32 * 2, 80) and small.rows.shape == (32, 2)
    a._graphs["g"] = SimpleNamespace(stage=small)
    b._graphs["g"] = SimpleNamespace(stage=small)
    b._graphs["other"] = SimpleNamespace(stage=None)
    big = b._stage(dev, 64, job, layout)
    assert big is not small and big.tokens == 64
    assert "g" not in a._graphs and "g" not in b._graphs and "other" in b._graphs
    assert a._stage(dev, 40, job, layout) is big
    ex._STAGES.pop((dev, 2, layout))


def test_local_share_of_each_rank():
    contiguous = SlotMap(ExpertPlacement.contiguous(8, 4), 8)
    assert [contiguous.local_share(r) for r in range(4)] == [0.25] * 4
    # logical 0 has copies on ranks 0 and 1: spread halves it, first-copy keeps it on rank 0
    placement = ExpertPlacement(torch.tensor([0, 1, 0, 2]), ep_size=2)
    assert [SlotMap(placement, 3).local_share(r) for r in range(2)] == [0.5, 0.5]
    first = SlotMap(placement, 3, spread=False)
    assert [first.local_share(r) for r in range(2)] == pytest.approx([2 / 3, 1 / 3])
