"""Parallel state (TP / EP / MoE-TP groups) and the MoE layer over ranks: `none` with TP, EP and
the hybrid EP x TP layout, and `alltoall` through the layer, on 2 and 4 spawned gloo ranks."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from moekit import MoE, MoEConfig, ParallelConfig, RunnerConfig
from moekit.config import ConfigError
from moekit.parallel import group_layout, init_parallel, single_rank_state
from moekit.runners.torch import moe_reference_fp64
from tests.dist_utils import get_pool
from tests.helpers import TOLERANCE, rel_err

# ---- single process ------------------------------------------------------------------------


def test_group_layout_follows_the_sglang_convention():
    layout = group_layout(8, 4, 2)
    assert layout["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["moe_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_layout(2, 2, 1) == {"tp": [[0, 1]], "ep": [[0], [1]], "moe_tp": [[0, 1]]}
    assert group_layout(4, 4, 4)["ep"] == [[0, 1, 2, 3]]


def test_layout_and_config_errors_name_the_options():
    with pytest.raises(ConfigError, match=r"--tp-size \(3\) must divide the world size \(4"):
        group_layout(4, 3, 1)
    with pytest.raises(ConfigError, match=r"--ep-size \(3\) must divide --tp-size \(4\)"):
        ParallelConfig(tp_size=4, ep_size=3)
    with pytest.raises(ConfigError, match=r"--ep-size \(3\) must divide --tp-size \(2\)"):
        group_layout(2, 2, 3)
    with pytest.raises(ConfigError, match="--tp-size must be a positive integer, got 0"):
        group_layout(4, 0, 1)
    with pytest.raises(ConfigError, match="the world size must be a positive integer, got 0"):
        group_layout(0, 1, 1)
    with pytest.raises(ConfigError, match="--tp-size 2 needs torch.distributed"):
        single_rank_state(ParallelConfig(tp_size=2))
    with pytest.raises(ConfigError, match="--moe-dense-tp-size"):
        ParallelConfig(tp_size=2, moe_dense_tp_size=2)


def test_single_rank_state_and_layer():
    state = single_rank_state()
    assert (state.tp_rank, state.ep_rank, state.moe_tp_rank, state.tp_group) == (0, 0, 0, None)
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    layer = MoE(cfg, state=state)
    x, logits = torch.randn(5, 16), torch.randn(5, 4)
    ref = moe_reference_fp64(x, layer.route(logits), layer.expert_weights, layer.act)
    assert rel_err(layer(x, logits), ref) < 1e-5
    with pytest.raises(ConfigError, match="differs from the parallel state"):
        MoE(cfg, ParallelConfig(ep_num_redundant_experts=4), state=state)


# ---- multi-process cases -----------------------------------------------------------------------


def run_groups_case(tp: int, ep: int, dense: int | None):
    """Build the groups and check each one really connects the ranks it claims."""
    state = init_parallel(ParallelConfig(tp_size=tp, ep_size=ep, moe_dense_tp_size=dense))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = group_layout(world, tp, ep)
    for kind, group, ranks in (("tp", state.tp_group, state.tp_ranks),
                               ("ep", state.ep_group, state.ep_ranks),
                               ("moe_tp", state.moe_tp_group, state.moe_tp_ranks)):
        assert list(ranks) in layout[kind] and rank in ranks
        t = torch.tensor([rank + 1])
        if group is not None:
            dist.all_reduce(t, group=group)
        assert int(t) == sum(r + 1 for r in ranks), kind
    assert state.ep_rank == state.tp_rank // state.moe_tp_size
    assert state.moe_tp_rank == state.tp_rank % state.moe_tp_size
    assert state.dense_tp_size == (1 if dense == 1 else tp)
    assert (state.dense_tp_group is None) == (dense == 1 or tp == 1)
    return (state.tp_rank, state.ep_rank, state.moe_tp_rank, state.ep_ranks, state.moe_tp_ranks)


def run_bad_world_case():
    world = dist.get_world_size()
    with pytest.raises(ConfigError, match=rf"--tp-size \(3\) must divide the world size \({world}"):
        init_parallel(ParallelConfig(tp_size=3))
    with pytest.raises(ConfigError, match=r"--tp-size \(8\) must divide"):
        init_parallel(ParallelConfig(tp_size=8, ep_size=8))
    return True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only case")
def test_init_parallel_on_a_cuda_device_without_one_is_refused():
    with pytest.raises(ConfigError, match="device cuda:0 asked for; torch sees no CUDA GPU"):
        init_parallel(ParallelConfig(), device="cuda:0")


def test_groups_4_ranks_tp4_ep2():
    got = get_pool(4).run(run_groups_case, 4, 2, None)
    assert got == [(0, 0, 0, (0, 2), (0, 1)), (1, 0, 1, (1, 3), (0, 1)),
                   (2, 1, 0, (0, 2), (2, 3)), (3, 1, 1, (1, 3), (2, 3))]


def test_groups_4_ranks_dp2_tp2_and_dense_tp1():
    got = get_pool(4).run(run_groups_case, 2, 2, 1)
    assert got == [(0, 0, 0, (0, 1), (0,)), (1, 1, 0, (0, 1), (1,)),
                   (0, 0, 0, (2, 3), (2,)), (1, 1, 0, (2, 3), (3,))]


def test_groups_2_ranks_and_world_errors():
    assert get_pool(2).run(run_groups_case, 2, 1, None) == [
        (0, 0, 0, (0,), (0, 1)), (1, 0, 1, (1,), (0, 1))]
    assert get_pool(2).run(run_bad_world_case) == [True, True]


@dataclass(frozen=True)
class LayerCase:
    """The MoE layer on a parallel state; tokens: per rank for alltoall, per TP group for none
    (TP ranks hold the same tokens)."""

    name: str
    tp: int
    ep: int
    backend: str = "none"
    mode: str = "auto"
    tokens: tuple[int, ...] = (9,)  # indexed by rank (alltoall) or dp rank (none), cyclic
    E: int = 8
    K: int = 2
    H: int = 32
    I: int = 16
    activation: str = "silu"
    bias: bool = False
    redundant: int = 0
    dense_tp: int | None = None
    compiled: bool = False  # through torch.compile (dynamo + aot_eager)
    fullgraph: bool = False  # ... as one graph
    dynamic: bool | None = None  # torch.compile's `dynamic`
    dtype: str = "float32"


def hf_experts(name: str, E: int, H: int, I: int, bias: bool = False) -> dict:
    """A transformers-style experts state dict, drawn from a seed of `name`: gate_up [E, 2I, H],
    down [E, H, I] (and their biases)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    sd = {"experts.gate_up_proj": torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
          "experts.down_proj": torch.randn(E, H, I, generator=g) * I**-0.5}
    if bias:
        sd["experts.gate_up_proj_bias"] = torch.randn(E, 2 * I, generator=g) * 0.1
        sd["experts.down_proj_bias"] = torch.randn(E, H, generator=g) * 0.1
    return sd


def run_layer_case(case: LayerCase):
    rank = dist.get_rank()
    parallel = ParallelConfig(
        tp_size=case.tp, ep_size=case.ep, moe_a2a_backend=case.backend, deepep_mode=case.mode,
        max_dispatch_tokens_per_rank=8, ep_num_redundant_experts=case.redundant,
        moe_dense_tp_size=case.dense_tp,
    )
    state = init_parallel(parallel)
    cfg = MoEConfig(num_experts=case.E, top_k=case.K, hidden_size=case.H,
                    intermediate_size=case.I, activation=case.activation, has_bias=case.bias,
                    dtype=case.dtype)
    E, H, I = case.E, case.H, case.I
    sd = hf_experts(case.name, E, H, I, case.bias)
    layer = MoE(cfg, runner=RunnerConfig(moe_runner_backend="torch"), state=state,
                device=state.device)
    layer.load_hf_state_dict(sd)
    full = MoE(cfg, runner=RunnerConfig(moe_runner_backend="torch"))
    full.load_hf_state_dict(sd)
    assert layer.w13.shape == ((E + case.redundant) // case.ep, 2 * I // parallel.moe_tp_size, H)

    who = rank if case.backend != "none" else state.dp_rank  # TP ranks share their tokens
    T = case.tokens[who % len(case.tokens)]
    gi = torch.Generator().manual_seed(1000 + who)
    x, logits = torch.randn(T, H, generator=gi), torch.randn(T, E, generator=gi)
    call = layer
    if case.compiled:
        call = torch.compile(layer, backend="aot_eager", fullgraph=case.fullgraph,
                             dynamic=case.dynamic)  # fmt: skip
    dtype = getattr(torch, case.dtype)
    x = x.to(dtype)
    out = call(x.to(state.device), logits.to(state.device))
    ref = moe_reference_fp64(x.float(), full.route(logits), full.expert_weights, full.act)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    return T


def _layer_cases_2():
    return [
        LayerCase("none-tp2-ep1", 2, 1),
        LayerCase("none-tp2-ep2", 2, 2),
        LayerCase("none-tp2-ep2-redundant", 2, 2, E=6, redundant=2),
        LayerCase("none-tp2-ep1-bias-swiglu", 2, 1, activation="swiglu_oai", bias=True),
        LayerCase("none-tp2-empty", 2, 2, tokens=(0,)),
        LayerCase("alltoall-tp2-auto", 2, 2, backend="alltoall", tokens=(5, 20)),
        LayerCase("alltoall-tp2-ll-bias", 2, 2, backend="alltoall", mode="low_latency",
                  tokens=(0, 7), activation="gelu", bias=True),
        LayerCase("alltoall-tp2-normal-redundant", 2, 2, backend="alltoall", mode="normal",
                  E=6, redundant=2, tokens=(6, 11)),
        # torch.compile: `none` and low-latency all-to-all trace whole; normal mode's
        # asynchronous collectives break the graph (dynamo runs them eagerly)
        LayerCase("compiled-none-tp2-ep2", 2, 2, compiled=True, fullgraph=True),
        LayerCase("compiled-alltoall-tp2-normal", 2, 2, backend="alltoall", mode="normal",
                  tokens=(5, 20), compiled=True),
        LayerCase("compiled-alltoall-tp2-ll", 2, 2, backend="alltoall", mode="low_latency",
                  tokens=(3, 7), compiled=True, fullgraph=True),
        LayerCase("compiled-dynamic-alltoall-tp2-ll", 2, 2, backend="alltoall",
                  mode="low_latency", tokens=(3, 7), compiled=True, fullgraph=True, dynamic=True),
        LayerCase("compiled-dynamic-none-tp2-ep2", 2, 2, compiled=True, fullgraph=True,
                  dynamic=True),
        # bf16 rows packed into the byte send buffer through a bf16 view of it
        LayerCase("compiled-alltoall-tp2-normal-bf16", 2, 2, backend="alltoall", mode="normal",
                  tokens=(5, 20), compiled=True, dtype="bfloat16"),
    ]


def _layer_cases_4():
    return [
        LayerCase("none-tp4-ep2-hybrid", 4, 2),
        LayerCase("none-tp4-ep2-hybrid-bias", 4, 2, activation="swiglu_oai", bias=True),
        LayerCase("none-tp4-ep1", 4, 1),
        LayerCase("none-tp4-ep4", 4, 4),
        LayerCase("none-dp2-tp2-ep2-dense1", 2, 2, tokens=(7, 3), dense_tp=1),
        LayerCase("alltoall-tp4-auto-mixed", 4, 4, backend="alltoall", tokens=(3, 0, 12, 8)),
        LayerCase("alltoall-tp4-ll", 4, 4, backend="alltoall", mode="low_latency",
                  tokens=(8, 1, 0, 5)),
        LayerCase("alltoall-dp2-tp2-normal", 2, 2, backend="alltoall", mode="normal",
                  tokens=(4, 9, 0, 2)),
    ]


@pytest.mark.parametrize("case", _layer_cases_2(), ids=lambda c: c.name)
def test_layer_2_ranks(case):
    get_pool(2).run(run_layer_case, case)


@pytest.mark.parametrize("case", _layer_cases_4(), ids=lambda c: c.name)
def test_layer_4_ranks(case):
    get_pool(4).run(run_layer_case, case)


@pytest.mark.multigpu
@pytest.mark.parametrize("case", _layer_cases_2(), ids=lambda c: c.name)
def test_layer_nccl_2_gpus(case):
    get_pool(2, "nccl").run(run_layer_case, case)


@dataclass(frozen=True)
class GraphCase:
    """The bf16 layer on 2 GPUs (TP 2, EP 2) under torch.compile(mode='reduce-overhead'):
    Inductor, and CUDA graphs recorded per batch size with the collectives inside them.
    tokens: the calls' batch sizes, per rank for alltoall (TP ranks share tokens with none)."""

    name: str
    backend: str = "none"
    mode: str = "auto"
    tokens: tuple[tuple[int, int], ...] = ((1, 1), (16, 16), (64, 64), (1, 1))
    fullgraph: bool = True


def run_graph_layer_case(case: GraphCase) -> dict:
    """Each batch size three times (warm-up, record, replay) on fresh inputs: the compiled
    output against the eager layer's, and the eager one against the float64 reference of the
    whole layer. Returns the worst errors and Inductor's count of skipped CUDA graphs."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank = dist.get_rank()
    parallel = ParallelConfig(tp_size=2, ep_size=2, moe_a2a_backend=case.backend,
                              deepep_mode=case.mode, max_dispatch_tokens_per_rank=64)
    state = init_parallel(parallel)
    E, K, H, I = 16, 4, 512, 256
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I,
                    dtype="bfloat16")
    sd = hf_experts(case.name, E, H, I)
    layer = MoE(cfg, runner=RunnerConfig("auto"), state=state, device=state.device).eval()
    layer.load_hf_state_dict(sd)
    full = MoE(cfg, runner=RunnerConfig("torch"))
    full.load_hf_state_dict(sd)
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=case.fullgraph,
                             dynamic=False)
    who = rank if case.backend != "none" else 0  # TP ranks share their tokens
    worst = {"compiled": 0.0, "eager": 0.0}
    for call, Ts in enumerate(case.tokens):
        for step in range(3):
            gi = torch.Generator().manual_seed(1000 * call + 10 * step + who)
            x = torch.randn(Ts[who], H, generator=gi).to(torch.bfloat16)
            logits = torch.randn(Ts[who], E, generator=gi)
            xd, ld = x.to(state.device), logits.to(state.device)
            with torch.no_grad():
                out = compiled(xd, ld).clone()
                eager = layer(xd, ld)
            ref = moe_reference_fp64(x.float(), full.route(logits), full.expert_weights, full.act)
            worst["compiled"] = max(worst["compiled"], rel_err(out, eager))
            worst["eager"] = max(worst["eager"], rel_err(eager, ref))
    worst["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
    return worst


@pytest.mark.multigpu
@pytest.mark.parametrize("case", [
    GraphCase("graphs-none-tp2-ep2"),
    GraphCase("graphs-alltoall-ll", "alltoall", "low_latency", ((3, 7), (64, 1), (0, 16))),
    # normal mode's asynchronous collectives break the graph: the pieces around them are graphs
    GraphCase("graphs-alltoall-normal", "alltoall", "normal", ((5, 20), (64, 0)),
              fullgraph=False),
], ids=lambda c: c.name)
def test_layer_under_cuda_graphs_nccl_2_gpus(case):
    results = get_pool(2, "nccl").run(run_graph_layer_case, case)
    for r in results:
        assert r["eager"] < TOLERANCE[torch.bfloat16], results
        assert r["compiled"] < TOLERANCE[torch.bfloat16], results
        if case.fullgraph:
            assert r["cudagraph_skips"] == 0, results
