"""EPLB: the balanced placement (pure), the on-device load recorder, and moving a layer's experts
to a new placement, on one process and on 2 / 4 gloo ranks (the layer's output must not change)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moekit import MoE, MoEConfig, ParallelConfig, RunnerConfig, metrics
from moekit.config import ConfigError
from moekit.dispatch.slots import SlotMap
from moekit.eplb import (
    ExpertBalancer,
    ExpertLoadRecorder,
    balanced_placement,
    balancedness,
    pack,
    rank_loads,
    read_load,
    rebalance_,
    replicate,
    transfer_plan,
)
from moekit.parallel import init_parallel
from moekit.placement import ExpertPlacement, load_placements, save_placements
from moekit.router import TopKOutput
from moekit.runners.torch import moe_reference_fp64
from tests.dist_utils import get_pool
from tests.helpers import rel_err


def _zipf_load(E: int, s: float = 1.2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randperm(E, generator=g).to(torch.float64) + 1
    return (1e4 / ranks**s).round()


# ---- the algorithm -----------------------------------------------------------------------------


def test_replicate_gives_extra_slots_to_the_heaviest_per_copy():
    load = torch.tensor([100.0, 10, 40, 0])
    # per copy: 100 -> 50 -> 33.3 (expert 0), then 40 (expert 2), then 33.3 (expert 0) again
    assert replicate(load, 4).tolist() == [1, 1, 1, 1]
    assert replicate(load, 6).tolist() == [3, 1, 1, 1]
    assert replicate(load, 7).tolist() == [3, 1, 2, 1]
    assert replicate(load, 8).tolist() == [4, 1, 2, 1]
    # a tie (40 per copy each) goes to the lower expert id
    assert replicate(torch.tensor([40.0, 80.0]), 4).tolist() == [2, 2]
    assert replicate(torch.tensor([40.0, 80.0]), 3).tolist() == [1, 2]


def test_pack_fills_every_rank_and_keeps_copies_apart():
    load = torch.tensor([90.0, 30, 30, 20, 10, 10])
    copies = torch.tensor([3, 1, 1, 1, 1, 1])  # 8 slots
    p2l = pack(load, copies, 4)
    assert p2l.numel() == 8
    assert torch.bincount(p2l, minlength=6).tolist() == copies.tolist()
    per_rank = p2l.view(4, 2)
    for r in range(4):  # expert 0's 3 copies land on 3 different ranks
        assert (per_rank[r] == 0).sum() <= 1
    loads = rank_loads(load, ExpertPlacement(p2l, 4))
    assert loads.sum() == pytest.approx(float(load.sum()))
    assert float(loads.max()) <= 60.0  # 190 over 4 ranks: 47.5 at best; greedy within one item


@pytest.mark.parametrize("E,redundant,ep", [(16, 0, 4), (16, 4, 4), (64, 16, 8), (32, 32, 8)])
def test_balanced_placement_beats_the_contiguous_one(E, redundant, ep):
    load = _zipf_load(E, seed=E + redundant)
    slots = E + redundant
    contiguous = ExpertPlacement.contiguous(E, ep, slots)
    placement = balanced_placement(load, slots, ep)
    p2l = placement.physical_to_logical
    assert p2l.numel() == slots and set(p2l.tolist()) == set(range(E))
    loads = rank_loads(load, placement)
    # greedy packing: the busiest rank is within one (heaviest) copy of the mean
    copies = torch.bincount(p2l, minlength=E).to(torch.float64)
    assert float(loads.max()) <= float(loads.mean()) + float((load / copies).max()) + 1e-9
    assert balancedness(load, placement) >= balancedness(load, contiguous)
    if redundant:  # copies of the hot experts: strictly better than no redundancy
        assert balancedness(load, placement) > balancedness(load, balanced_placement(load, E, ep))


def test_balancedness_and_rank_loads_by_hand():
    load = torch.tensor([6.0, 2, 2, 2])
    p = ExpertPlacement(torch.tensor([0, 0, 1, 2, 3, 1]), 2)  # expert 0 and 1 have 2 copies
    assert rank_loads(load, p).tolist() == [3 + 3 + 1, 2 + 2 + 1]
    assert balancedness(load, p) == pytest.approx(6 / 7)
    assert balancedness(torch.zeros(4), p) == 1.0
    with pytest.raises(ValueError, match=r"load \[3\] must be \[E\].*experts up to 3"):
        rank_loads(load[:3], p)


def test_bad_loads_and_slot_counts_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="one value per expert"):
        balanced_placement(torch.ones(2, 3), 6, 2)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balanced_placement(torch.tensor([1.0, -1.0]), 2, 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balanced_placement(torch.tensor([1.0, float("nan")]), 2, 1)
    with pytest.raises(ValueError, match=r"num_slots \(3\) must be >= the experts \(4\)"):
        balanced_placement(torch.ones(4), 3, 1)
    with pytest.raises(ValueError, match=r"divisible by ep_size \(4\)"):
        balanced_placement(torch.ones(4), 6, 4)
    with pytest.raises(ValueError, match="at least one slot"):
        pack(torch.ones(3), torch.tensor([2, 0, 2]), 2)


def test_transfer_plan_prefers_a_local_copy():
    old = ExpertPlacement(torch.tensor([0, 1, 2, 3, 0, 1]), 2)  # rank 0: 0 1 2, rank 1: 3 0 1
    new = ExpertPlacement(torch.tensor([0, 3, 1, 2, 1, 0]), 2)
    assert transfer_plan(old, new) == [[(0, 0), (1, 0), (0, 1)], [(0, 2), (1, 2), (1, 1)]]
    with pytest.raises(ValueError, match=r"no copy of logical experts \[4\]"):
        transfer_plan(old, ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 1]), 2))


# ---- the recorder ------------------------------------------------------------------------------


def test_recorder_counts_routed_pairs_and_skips_masked_ids():
    rec = ExpertLoadRecorder(5)
    ids = torch.tensor([[0, 3], [3, -1], [4, 0]], dtype=torch.int32)
    rec.record(ids)
    rec.record(ids[:1])
    rec.record(torch.tensor([[5, -2]]))  # outside [0, E): not counted either
    assert rec.counts.tolist() == [3, 0, 0, 3, 1]
    assert rec.total().tolist() == [3, 0, 0, 3, 1]
    rec.reset()
    assert rec.counts.tolist() == [0] * 5
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        ExpertLoadRecorder(0)


def _layer(E=8, redundant=4, fmt=None, bias=False):
    cfg = MoEConfig(num_experts=E, top_k=2, hidden_size=128, intermediate_size=128,
                    dtype="float32", has_bias=bias,
                    activation="swiglu_oai" if bias else "silu")  # fmt: skip
    torch.manual_seed(0)
    return MoE(cfg, ParallelConfig(ep_num_redundant_experts=redundant),
               runner=RunnerConfig(moe_runner_backend="torch"), weight_format=fmt)  # fmt: skip


def test_enable_eplb_records_from_the_start():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    layer = MoE(cfg, ParallelConfig(enable_eplb=True), runner=RunnerConfig("torch"))
    logits = torch.randn(5, 8)
    layer(torch.randn(5, 32, dtype=torch.bfloat16), logits)
    assert layer.expert_load.counts.sum() == 10
    assert MoE(cfg, runner=RunnerConfig("torch")).expert_load is None


def test_layer_records_its_load_also_when_compiled():
    layer = _layer()
    rec = layer.record_expert_load()
    x, logits = torch.randn(20, 128), torch.randn(20, 8)
    layer(x, logits)
    ids = layer.route(logits).ids
    want = torch.bincount(ids.flatten().long(), minlength=8)
    assert rec.counts.tolist() == want.tolist()
    torch.compile(layer, backend="aot_eager")(x, logits)
    assert rec.counts.tolist() == (2 * want).tolist()
    assert layer.record_expert_load(False) is None and layer.expert_load is None
    layer(x, logits)
    assert rec.counts.tolist() == (2 * want).tolist()


@pytest.mark.parametrize("fmt,bias", [(None, False), (None, True), ("fp8_w8a8", False),
                                      ("int4_w4a16", False)])  # fmt: skip
def test_rebalance_on_one_rank_keeps_the_output(fmt, bias):
    layer = _layer(fmt=fmt, bias=bias)
    x, logits = torch.randn(40, 128), torch.randn(40, 8)
    logits[:, 2] += 4  # expert 2 is hot
    rec = layer.record_expert_load()
    before = layer(x, logits)
    w13 = layer.w13
    placement = balanced_placement(rec.counts, layer.placement.num_slots, 1)
    assert (placement.physical_to_logical == 2).sum() > 1
    table = layer.dispatcher.slots._table
    assert rebalance_(layer, placement) is True  # in place: graphs captured before stay valid
    assert layer.w13 is w13 and layer.dispatcher.slots._table is table
    assert torch.equal(layer.placement.physical_to_logical, placement.physical_to_logical)
    assert rel_err(layer(x, logits), before) < 1e-6  # copies split a hot expert: the sums run in another order


def test_rebalance_refuses_another_slot_count_and_a_layer_without_ranks():
    layer = _layer()
    with pytest.raises(ValueError, match="the layer has 12 over 1"):
        rebalance_(layer, ExpertPlacement(torch.arange(8), 1))
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    rank1 = MoE(cfg, ParallelConfig(tp_size=2, ep_size=2), tp_rank=1,
                runner=RunnerConfig(moe_runner_backend="torch"))  # fmt: skip
    with pytest.raises(ValueError, match="needs the layer built on a parallel state"):
        rebalance_(rank1, ExpertPlacement(torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]), 2))


@pytest.mark.parametrize("slots, needle", [
    ([0, 0, 2, 3, 4, 5, 6, 7, 0, 0, 2, 3], r"no slot for logical experts \[1\]"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], r"outside \[0, 8\): \[8\]"),
    ([0, 1, 2, 3, 4, 5, 6, 7, -1, 1, 2, 3], r"outside \[0, 8\): \[-1\]"),
])
def test_rebalance_refuses_a_placement_that_drops_an_expert_before_moving_anything(slots, needle):
    layer = _layer()
    x, logits = torch.randn(6, 128), torch.randn(6, 8)
    before, w13 = layer(x, logits), layer.w13.clone()
    with pytest.raises(ValueError, match=needle):
        rebalance_(layer, ExpertPlacement(torch.tensor(slots), 1))
    assert torch.equal(layer.w13, w13)
    assert torch.equal(layer.placement.physical_to_logical, torch.arange(12) % 8)
    assert torch.equal(layer(x, logits), before)
    with pytest.raises(TypeError, match="takes an ExpertPlacement, got Tensor"):
        rebalance_(layer, torch.arange(12) % 8)


@pytest.mark.parametrize("args, needle", [
    ((torch.arange(8.0), 1), r"1-D integer tensor \[slots\], got torch.float32 \[8\]"),
    ((torch.arange(8).view(2, 4), 1), r"got torch.int64 \[2, 4\]"),
    (([0, 1, 2, 3], 1), "got list"),
    ((torch.arange(8), 0), "ep_size must be a positive integer, got 0"),
    ((torch.arange(8), -2), "ep_size must be a positive integer, got -2"),
    ((torch.arange(0), 1), r"slots \(0\) must be a positive multiple"),
])  # fmt: skip
def test_placement_refuses_malformed_maps(args, needle):
    with pytest.raises(ValueError, match=needle):
        ExpertPlacement(*args)
    with pytest.raises(ValueError, match=r"ep_rank must be in \[0, ep_size = 2\), got 2"):
        ExpertPlacement.contiguous(8, 2).local_experts(2)


@pytest.mark.parametrize("E,redundant,ep", [(8, 0, 1), (8, 4, 1), (8, 8, 4), (6, 2, 2)])
def test_slot_map_is_rewritten_in_place_for_a_new_placement(E, redundant, ep):
    """update_ keeps the map's tensors and gives what a map built for the new placement gives."""
    g = torch.Generator().manual_seed(E + redundant + ep)
    slots = SlotMap(ExpertPlacement.contiguous(E, ep, E + redundant), E)
    table, copies = slots._table, slots._copies
    ids = torch.randint(-1, E, (37, 3), generator=g)
    for seed in range(3):
        load = torch.rand(E, generator=torch.Generator().manual_seed(seed)) ** 4 * 1000
        new = balanced_placement(load, E + redundant, ep)
        slots.update_(new)
        fresh = SlotMap(new, E)
        assert slots._table is table and slots._copies is copies
        assert torch.equal(slots.physical(ids), fresh.physical(ids))
        for r in range(ep):
            assert torch.equal(slots.local_ids_torch(ids, r), fresh.local_ids_torch(ids, r))
            assert slots.local_share(r) == pytest.approx(fresh.local_share(r))
    with pytest.raises(ValueError, match="must keep the slots and ranks"):
        slots.update_(ExpertPlacement.contiguous(E, ep, E + redundant + ep))


def test_none_dispatcher_rebuilds_when_its_ids_turn_mapped():
    """One rank, no copies: slot i = expert i needs no mapping. A permutation does; the
    dispatcher then rebuilds (rebalance_ says so) and the output stays right."""
    layer = _layer(redundant=0)
    x, logits = torch.randn(16, 128), torch.randn(16, 8)
    before = layer(x, logits)
    assert rebalance_(layer, ExpertPlacement(torch.arange(8).flip(0), 1)) is False
    assert rel_err(layer(x, logits), before) < 1e-6
    assert rebalance_(layer, ExpertPlacement(torch.arange(8).roll(1), 1)) is True
    assert rel_err(layer(x, logits), before) < 1e-6


def test_placements_round_trip_through_a_file(tmp_path):
    path = tmp_path / "placements.json"
    ours = [ExpertPlacement(torch.tensor([3, 0, 1, 2, 0, 3]), 2),
            ExpertPlacement.contiguous(4, 2, 6)]  # fmt: skip
    save_placements(path, ours)
    back = load_placements(path)
    assert [p.ep_size for p in back] == [2, 2]
    assert all(torch.equal(a.physical_to_logical, b.physical_to_logical) for a, b in zip(ours, back))
    with pytest.raises(ValueError, match="different ep_size values"):
        save_placements(path, [ExpertPlacement(torch.arange(4), 2), ExpertPlacement(torch.arange(4), 4)])
    for text, needle in [("[1, 2]", "not a placement file"), ("{oops", "not a placement file"),
                         ('{"ep_size": 2, "placements": []}', "non-empty list of placements"),
                         ('{"ep_size": 2, "placements": [[0, -1]]}', "placement 0 must be"),
                         ('{"ep_size": 2, "placements": [[0, 1, 2]]}', "positive multiple of ep_size")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_placements(path)
    with pytest.raises(ValueError, match="not a placement file"):
        load_placements(tmp_path / "missing.json")


def test_balancer_refuses_what_it_cannot_balance():
    with pytest.raises(ValueError, match=r"balances moekit MoE layers, got \['Linear'\]"):
        ExpertBalancer([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"min_gain must be in \[0, 1\), got '0.1'"):
        ExpertBalancer([_layer()], min_gain="0.1")


def test_balancer_checks_every_n_steps_and_starts_afresh(tmp_path):
    """One rank: the balance is always perfect, so nothing moves; the cadence, the reset of the
    recorders, the metrics and the saved load are what is checked."""
    metrics.reset()
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype="float32")
    layers = torch.nn.ModuleList(
        MoE(cfg, ParallelConfig(eplb_rebalance_num_iterations=3), runner=RunnerConfig("torch"))
        for _ in range(2)
    )
    balancer = ExpertBalancer(layers)
    assert balancer.every == 3 and balancer.group is None
    assert all(layer.expert_load is not None for layer in layers)
    x, logits = torch.randn(5, 32), torch.randn(5, 8)
    for step in range(1, 7):
        for layer in layers:
            layer(x, logits)
        if step == 2:
            path = tmp_path / "load.json"
            load = balancer.save_load(path)
            assert load.shape == (2, 8) and load.sum() == 2 * 2 * 5 * 2
            assert read_load(str(path)).tolist() == load.tolist()  # `moekit eplb --load` reads it
        assert balancer.step() is False  # on one rank nothing ever moves
        done = step % 3 == 0
        assert int(layers[0].expert_load.counts.sum()) == (0 if done else 10 * (step % 3))
    assert metrics.expert_balancedness() == {0: 1.0, 1: 1.0} and metrics.eplb_rebalances() == 0
    metrics.reset()


def test_balancer_refuses_bad_settings():
    with pytest.raises(ValueError, match="found no moekit MoE layer"):
        ExpertBalancer(torch.nn.Linear(2, 2))
    layer = _layer()
    with pytest.raises(ValueError, match="every .*must be >= 1, got 0"):
        ExpertBalancer(layer, every=0)
    with pytest.raises(ValueError, match=r"min_gain must be in \[0, 1\)"):
        ExpertBalancer(layer, min_gain=1.0)
    with pytest.raises(ValueError, match="1 placements for 2 MoE layers"):
        ExpertBalancer([layer, _layer()]).apply([layer.placement])
    with pytest.raises(ConfigError, match="--eplb-rebalance-num-iterations must be a positive"):
        ParallelConfig(eplb_rebalance_num_iterations=0)


def test_none_dispatcher_splits_a_copied_experts_pairs_over_its_copies():
    """`none` (every rank holds every token): expert 0 has a copy on each of 2 ranks; its pairs
    alternate between them by token, and every pair is computed on exactly one rank."""
    from moekit.dispatch.none import NoneDispatcher

    placement = ExpertPlacement(torch.tensor([0, 1, 2, 3, 0, 4, 5, 6]), 2)
    ranks = [NoneDispatcher(placement, ep_rank=r, num_logical_experts=7) for r in range(2)]
    ids = torch.randint(0, 7, (41, 3), dtype=torch.int32)
    ids[:, 0] = 0  # every token routes to expert 0 first
    ids[5, 1] = -1
    topk = TopKOutput(torch.rand(41, 3), ids)
    local = [d.dispatch(torch.randn(41, 8), topk).topk.ids for d in ranks]
    assert torch.equal(sum((ids_ >= 0).int() for ids_ in local), (ids >= 0).int())
    on_rank0 = local[0][:, 0] >= 0
    assert torch.equal(on_rank0, torch.arange(41) % 2 == 0)  # token t -> copy t mod 2
    assert local[1][~on_rank0, 0].tolist() == [0] * int((~on_rank0).sum())  # rank 1's slot 0


# ---- across ranks (gloo) -----------------------------------------------------------------------


@dataclass(frozen=True)
class EplbCase:
    name: str
    tp: int
    ep: int
    backend: str = "alltoall"
    E: int = 8
    redundant: int = 2
    tokens: int = 24


def run_eplb_case(case: EplbCase):
    parallel = ParallelConfig(tp_size=case.tp, ep_size=case.ep, moe_a2a_backend=case.backend,
                              ep_num_redundant_experts=case.redundant)  # fmt: skip
    state = init_parallel(parallel)
    cfg = MoEConfig(num_experts=case.E, top_k=2, hidden_size=32, intermediate_size=16,
                    dtype="float32")  # fmt: skip
    g = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    sd = {"experts.gate_up_proj": torch.randn(case.E, 32, 32, generator=g) * 32**-0.5,
          "experts.down_proj": torch.randn(case.E, 32, 16, generator=g) * 16**-0.5}
    layer = MoE(cfg, runner=RunnerConfig(moe_runner_backend="torch"), state=state,
                device=state.device)  # fmt: skip
    layer.load_hf_state_dict(sd)
    full = MoE(cfg, runner=RunnerConfig(moe_runner_backend="torch"))
    full.load_hf_state_dict(sd)
    rank = dist.get_rank()
    gi = torch.Generator().manual_seed(100 + (rank if case.backend == "alltoall" else 0))
    x, logits = torch.randn(case.tokens, 32, generator=gi), torch.randn(case.tokens, case.E,
                                                                        generator=gi)  # fmt: skip
    logits[:, 1] += 3  # a hot expert
    rec = layer.record_expert_load()
    before = layer(x.to(state.device), logits.to(state.device)).cpu()
    group = state.ep_group if case.backend == "alltoall" else None  # none: same tokens everywhere
    load = rec.total(group).cpu()
    placement = balanced_placement(load, layer.placement.num_slots, case.ep)
    old = layer.placement
    moved = sum(src != r for r, row in enumerate(transfer_plan(old, placement)) for src, _ in row)
    table = layer.dispatcher.slots._table
    assert rebalance_(layer, placement) is True and layer.dispatcher.slots._table is table
    after = layer(x.to(state.device), logits.to(state.device)).cpu()
    ref = moe_reference_fp64(x, full.route(logits), full.expert_weights, full.act)
    assert rel_err(before, ref) < 1e-5 and rel_err(after, ref) < 1e-5
    return balancedness(load, old), balancedness(load, placement), moved


@pytest.mark.parametrize("case", [
    EplbCase("alltoall-2", 2, 2),
    EplbCase("none-2", 2, 2, backend="none"),
], ids=lambda c: c.name)  # fmt: skip
def test_rebalance_2_ranks(case):
    results = get_pool(2).run(run_eplb_case, case)
    before, after, moved = results[0]
    assert after >= before and results[0] == results[1]
    assert moved > 0  # slots filled from the other rank


def run_balancer_case(tmp_dir: str):
    """Two layers on 2 ranks (alltoall, 2 redundant slots): one with a hot expert, one not. The
    balancer sums both ranks' loads, moves what pays, and `apply` moves them back from a file."""
    parallel = ParallelConfig(tp_size=2, ep_size=2, moe_a2a_backend="alltoall",
                              ep_num_redundant_experts=2)  # fmt: skip
    state = init_parallel(parallel)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype="float32")
    g = torch.Generator().manual_seed(7)
    layers, fulls = torch.nn.ModuleList(), []
    for _ in range(2):
        sd = {"experts.gate_up_proj": torch.randn(8, 32, 32, generator=g) * 32**-0.5,
              "experts.down_proj": torch.randn(8, 32, 16, generator=g) * 16**-0.5}  # fmt: skip
        layers.append(MoE(cfg, runner=RunnerConfig("torch"), state=state, device=state.device))
        layers[-1].load_hf_state_dict(sd)
        fulls.append(MoE(cfg, runner=RunnerConfig("torch")))
        fulls[-1].load_hf_state_dict(sd)

    def inputs(rank):
        gi = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(24, 32, generator=gi)
        logits = [torch.randn(24, 8, generator=gi) for _ in layers]
        logits[0][:, 6] += 4  # layer 0 has a hot expert, with one slot (contiguous: 0..7, 0, 1)
        return x, logits

    x, logits = inputs(dist.get_rank())

    def check_outputs():
        for layer, full, lg in zip(layers, fulls, logits):
            out = layer(x.to(state.device), lg.to(state.device)).cpu()
            ref = moe_reference_fp64(x, full.route(lg), full.expert_weights, full.act)
            assert rel_err(out, ref) < 1e-5

    metrics.reset()
    balancer = ExpertBalancer(layers, every=2)
    check_outputs()  # records one call per layer
    assert balancer.step() is False
    both = [inputs(rank)[1] for rank in range(2)]  # the load is summed over both ranks
    want = [sum(torch.bincount(full.route(lg[i]).ids.flatten().long(), minlength=8) for lg in both)
            for i, full in enumerate(fulls)]  # fmt: skip
    assert balancer.loads().tolist() == torch.stack(want).tolist()
    reports = balancer.rebalance()
    assert reports[0].moved and reports[0].after > reports[0].before
    for r in reports:
        assert r.moved == (r.after * (1 - balancer.min_gain) > r.before)
    assert all(int(layer.expert_load.counts.sum()) == 0 for layer in layers)
    check_outputs()
    path = f"{tmp_dir}/contiguous.json"
    if dist.get_rank() == 0:
        save_placements(path, [ExpertPlacement.contiguous(8, 2, 10)] * 2)
    dist.barrier()
    balancer.apply(load_placements(path))
    assert all(torch.equal(layer.placement.physical_to_logical, torch.arange(10) % 8)
               for layer in layers)  # fmt: skip
    check_outputs()
    return reports, metrics.expert_balancedness()


def test_balancer_on_2_ranks(tmp_path):
    results = get_pool(2).run(run_balancer_case, str(tmp_path))
    (reports, balance), other = results
    assert other == results[0]  # both ranks took the same decisions
    assert reports[0].moved and set(balance) == {0, 1}


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("case", [
    EplbCase("nccl-alltoall-2", 2, 2),
    EplbCase("nccl-none-2", 2, 2, backend="none"),
], ids=lambda c: c.name)  # fmt: skip
def test_rebalance_nccl_2_gpus(case):
    before, after, moved = get_pool(2, "nccl").run(run_eplb_case, case)[0]
    assert after >= before and moved > 0


@pytest.mark.parametrize("case", [
    EplbCase("alltoall-4", 4, 4, E=8, redundant=4, tokens=16),
    EplbCase("alltoall-dp2-ep2", 2, 2, E=6, redundant=2, tokens=10),
], ids=lambda c: c.name)  # fmt: skip
def test_rebalance_4_ranks(case):
    results = get_pool(4).run(run_eplb_case, case)
    before, after, moved = results[0]
    assert after > before and moved > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorder_counts_inside_cuda_graph_replays():
    """The layer's load recorder in a captured CUDA graph (bf16, auto runner): each replay adds
    the routing's counts, with no host synchronisation to break the capture."""
    from tests.helpers import capture_graph

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128)
    layer = MoE(cfg, device="cuda")
    rec = layer.record_expert_load()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(64, 16, device="cuda")
    graph, out = capture_graph(lambda: layer(x, logits))  # one eager warm-up, then captured
    want = torch.bincount(layer.route(logits).ids.flatten().long(), minlength=16)
    assert torch.equal(rec.counts, want)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(rec.counts, 4 * want)
    assert torch.equal(out, layer(x, logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_recorder_keeps_reduce_overhead_graphs():
    """Recording under torch.compile(mode='reduce-overhead'): the counts are a static address,
    so Inductor keeps its CUDA graphs (it skips a graph that mutates another input), and each
    call, warm-up, recording and replays, counts once."""
    from torch._dynamo.utils import counters

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=256, intermediate_size=128)
    layer = MoE(cfg, device="cuda")
    rec = layer.record_expert_load()
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(32, 16, device="cuda", dtype=torch.bfloat16)
    counters.clear()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with torch.no_grad():
        for _ in range(4):
            compiled(x, logits)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    want = torch.bincount(layer.route(logits).ids.flatten().long(), minlength=16)
    assert torch.equal(rec.counts, 4 * want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,fmt", [("triton", None), ("triton_kernel", None),
                                         ("cutlass", None), ("w4a16", "int4_w4a16")])  # fmt: skip
def test_cuda_graph_captured_before_a_rebalance_runs_the_new_placement(backend, fmt):
    """A graph of the layer's forward captured under the contiguous placement, replayed after
    its experts moved (a hot expert given several copies, the others shifted): the output is
    the same function (a stale slot map or weight copy would mix experts up). cutlass at
    H = 196 keeps a padded copy of the weights, w4a16 a packed one: both rewritten in place."""
    from tests.helpers import capture_graph

    H = 196 if backend == "cutlass" else 256
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=H, intermediate_size=128)
    torch.manual_seed(0)
    layer = MoE(cfg, ParallelConfig(ep_num_redundant_experts=8), device="cuda",
                runner=RunnerConfig(moe_runner_backend=backend), weight_format=fmt)  # fmt: skip
    T = 32  # 128 (token, expert) pairs: within w4a16's decode batches
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, 16, device="cuda")
    logits[:, 3] += 4  # expert 3 is hot
    rec = layer.record_expert_load()
    graph, out = capture_graph(lambda: layer(x, logits))
    graph.replay()
    before = out.clone()
    assert rel_err(before.float(), layer(x, logits).float()) < 1e-2
    placement = balanced_placement(rec.counts.cpu(), layer.placement.num_slots, 1)
    assert (placement.physical_to_logical == 3).sum() > 1
    assert rebalance_(layer, placement) is True
    graph.replay()
    eager = layer(x, logits)
    torch.cuda.synchronize()
    assert rel_err(out.float(), before.float()) < 1e-2
    assert rel_err(eager.float(), before.float()) < 1e-2
