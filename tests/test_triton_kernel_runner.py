"""The triton_kernel runner: routing metadata against its torch twin (and its invariants), the
runner against the float64 reference (CPU through the Triton interpreter: float32 / float16,
tiny shapes), configs and errors; GPU (marked): bf16 on the preset shapes, CUDA graph replay."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
from helpers import TOLERANCE, capture_graph, make_topk, make_weights, rel_err  # noqa: E402

from moekit._triton_host import interpret_mode  # noqa: E402
from moekit.experts import ActivationSpec, ExpertWeights  # noqa: E402
from moekit.hardware import Platform  # noqa: E402
from moekit.router import TopKOutput  # noqa: E402
from moekit.runners.base import RunnerError  # noqa: E402
from moekit.runners.registry import runner_class  # noqa: E402
from moekit.runners.torch import moe_reference_fp64, run_standard  # noqa: E402
from moekit.runners.triton_kernel import TritonKernelRunner, ops, routing  # noqa: E402
from moekit.runners.triton_kernel.configs import (  # noqa: E402
    HEURISTIC,
    KernelConfig,
    Tile,
    config_for,
)
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


# ---------------------------------------------------------------------------------------------
# Routing metadata
# ---------------------------------------------------------------------------------------------

ROUTE_CASES = [  # (T, K, E, block_m, masked, one_expert, chunk)
    (0, 2, 4, 16, 0.0, False, 1024),
    (1, 1, 3, 16, 0.0, False, 1024),
    (1, 4, 5, 16, 0.5, False, 1024),
    (13, 2, 5, 16, 0.0, False, 1024),
    (40, 3, 7, 16, 0.3, False, 16),  # several chunks
    (37, 2, 6, 16, 0.0, True, 16),  # one expert takes every pair
    (25, 4, 130, 32, 0.2, False, 32),  # E not a power of two, EP = 256
    (20, 2, 3, 16, 1.0, False, 16),  # every id masked
    (100, 3, 600, 16, 0.1, False, 16),  # 19 chunks summed 4 at a time ([4, 1024] tiles)
]


def check_invariants(r: routing.Routing, ids_TK: torch.Tensor, E: int) -> None:
    flat = ids_TK.reshape(-1).long().cpu()
    P = flat.numel()
    sp = r.sorted_pairs.long().cpu()
    assert torch.equal(torch.sort(sp).values, torch.arange(P))  # each pair exactly once
    valid = (flat >= 0) & (flat < E)
    n_valid = int(valid.sum())
    off, cnt = r.offsets.long().cpu(), r.counts.long().cpu()
    assert off[0] == 0 and off[E] == n_valid and torch.equal(off[1:] - off[:-1], cnt)
    assert not valid[sp[n_valid:]].any()  # -1 excluded from the experts' rows
    for e in range(E):
        seg = sp[off[e] : off[e + 1]]
        assert (flat[seg] == e).all() and (seg[1:] > seg[:-1]).all()  # stable
    nt = int(r.num_tiles.item())
    assert nt <= r.max_tiles == routing.max_tiles(P, E, r.block_m)
    te, t0, tr = (t.long().cpu() for t in (r.tile_expert, r.tile_row0, r.tile_rows))
    covered = torch.zeros(P, dtype=torch.long)
    for j in range(nt):
        e = int(te[j])
        assert 0 <= e < E and 1 <= tr[j] <= r.block_m + r.fold
        assert off[e] <= t0[j] and t0[j] + tr[j] <= off[e + 1]
        last = t0[j] + tr[j] == off[e + 1]
        assert last or tr[j] == r.block_m  # only an expert's last tile is short or folded
        if last and tr[j] < r.block_m and cnt[e] > r.block_m:  # a short tail after full tiles
            assert tr[j] > r.fold  # ... that was not folded into the tile before
        covered[t0[j] : t0[j] + tr[j]] += 1
    assert torch.equal(covered, (torch.arange(P) < n_valid).long())  # exactly once
    assert (te[nt:] == -1).all() and (tr[nt:] == 0).all()


@pytest.mark.parametrize("scan", ["scan kernel", "summed in scatter"])
@pytest.mark.parametrize("fold", [0, 4])
@pytest.mark.parametrize("T,K,E,bm,masked,one_expert,chunk", ROUTE_CASES)
def test_routing_matches_twin_and_invariants(monkeypatch, T, K, E, bm, masked, one_expert, chunk,
                                             fold, scan):  # fmt: skip
    fused = 0 if scan == "scan kernel" else 1 << 20
    monkeypatch.setattr(routing, "ROUTING", replace(routing.ROUTING, min_chunk=chunk,
                                                    fused_max_chunks=fused))  # fmt: skip
    ids = make_topk(T, K, E, masked, one_expert).ids
    got, want = routing.route(ids, E, bm, fold), routing.route_torch(ids, E, bm, fold)
    for name in ("sorted_pairs", "counts", "offsets", "tile_expert", "tile_row0", "tile_rows",
                 "num_tiles"):  # fmt: skip
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    check_invariants(got, ids, E)
    check_invariants(want, ids, E)


def test_routing_folds_short_last_tiles():
    """Experts of 0, 16, 17, 20, 21, 32, 36, 37, 52 and 3 rows at BM 16, fold 4: a last tile of
    1 ... 4 rows after a full one joins it; a lone short tile, an exact fit and a tail of 5
    rows keep their own tiles."""
    sizes = [0, 16, 17, 20, 21, 32, 36, 37, 52, 3]
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(sizes)])
    ids = ids[torch.randperm(ids.numel())].view(-1, 1).to(DEVICE)
    r = routing.route(ids, len(sizes), 16, fold=4)
    nt = int(r.num_tiles.item())
    got = list(zip(r.tile_expert[:nt].tolist(), r.tile_rows[:nt].tolist()))
    assert got == [(1, 16), (2, 17), (3, 20), (4, 16), (4, 5), (5, 16), (5, 16), (6, 16),
                   (6, 20), (7, 16), (7, 16), (7, 5), (8, 16), (8, 16), (8, 20),
                   (9, 3)]  # fmt: skip
    check_invariants(r, ids, len(sizes))


def test_routing_refuses_bad_input():
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        routing.route(ids, 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        routing.route(ids.int(), 4, 24)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        routing.route(ids.int().view(-1), 4, 16)
    with pytest.raises(ValueError, match=r"fold must be in \[0, block_m=16\), got 16"):
        routing.route(ids.int(), 4, 16, fold=16)


# ---------------------------------------------------------------------------------------------
# Runner against the reference
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    T: int = 7
    K: int = 2
    E: int = 5
    H: int = 48
    I: int = 40
    act: str = "silu"
    interleaved: bool = False
    bias: bool = False
    dtype: torch.dtype = torch.float32
    masked: float = 0.0
    one_expert: bool = False
    config: KernelConfig | None = None


SMALL = KernelConfig(16, Tile(16, 16), Tile(16, 32), group_m=2)  # several column blocks
POINTERS = replace(SMALL, tma=False)
BIG_M = KernelConfig(32, Tile(32, 32), Tile(64, 16), group_m=1, tma=False)
ATOMIC = replace(SMALL, reduce="atomic", gate_up=Tile(16, 16, flatten=True))
ATOMIC_PTR = replace(BIG_M, reduce="atomic", down=Tile(64, 16, warp_specialize=True))

CASES = [
    Case("T0", T=0),
    Case("T1", T=1),
    Case("T1-masked-id", T=1, K=3, masked=0.5, dtype=torch.float16),
    Case("silu"),
    Case("gelu-interleaved", act="gelu", interleaved=True),
    Case("swiglu_oai-bias-interleaved", act="swiglu_oai", interleaved=True, bias=True),
    Case("swiglu_oai-bias", act="swiglu_oai", bias=True, K=3, E=7),
    Case("masked-ids", masked=0.3, T=9),
    Case("one-expert", one_expert=True, T=6, K=1),
    Case("E-not-pow2-odd-H-I", E=6, H=40, I=24, T=11, K=3),
    Case("fp16-gelu-bias", dtype=torch.float16, bias=True, act="gelu"),
    Case("tma-tiles", config=SMALL, T=20, masked=0.2, bias=True, act="swiglu_oai"),
    Case("pointer-tiles", config=POINTERS, T=20, masked=0.2, bias=True, act="swiglu_oai",
         interleaved=True),  # fmt: skip
    Case("pointer-bigger-bm-odd", config=BIG_M, T=13, H=40, I=24, E=3, one_expert=True,
         dtype=torch.float16),  # fmt: skip
    Case("atomic-tma", config=ATOMIC, T=20, masked=0.2, bias=True, act="swiglu_oai",
         interleaved=True),  # fmt: skip
    Case("atomic-fp16-one-expert", config=ATOMIC, T=9, K=3, one_expert=True, dtype=torch.float16),
    Case("atomic-pointers-odd", config=ATOMIC_PTR, T=13, H=40, I=24, E=3, masked=0.3),
    Case("atomic-all-masked", config=ATOMIC, T=5, masked=1.0),
    Case("hardware-scheduled-grid", config=replace(ATOMIC, gate_up=Tile(16, 16, persistent=False),
         down=Tile(16, 32, persistent=False)), T=20, masked=0.2, K=3),  # fmt: skip
    Case("one-tile-interleaved-tma", config=replace(SMALL, interleaved_one_tile=True), T=20,
         act="swiglu_oai", interleaved=True, bias=True),  # fmt: skip
    Case("one-tile-interleaved-pointers", config=replace(POINTERS, interleaved_one_tile=True),
         T=11, H=40, I=24, act="gelu", interleaved=True, bias=True),  # fmt: skip    # routing widths of models `--model` can name by their config.json: 512 experts, 10 a token
    # (Qwen3-Next), 384 (Kimi-K2), one a token (Llama 4)
    Case("E512-K10", E=512, K=10, T=13, H=32, I=32),
    Case("E384-K8-masked", E=384, K=8, T=9, H=32, I=32, masked=0.2),
    Case("K1", K=1, E=16, T=21),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_standard_matches_reference(case: Case):
    w = make_weights(case.E, case.H, case.I, case.dtype, case.bias)
    act = ActivationSpec(case.act, case.interleaved)
    x = torch.randn(case.T, case.H, device=DEVICE, dtype=case.dtype)
    topk = make_topk(case.T, case.K, case.E, case.masked, case.one_expert)
    if case.config is None:
        out = TritonKernelRunner().run(StandardDispatchOutput(x, topk), w, act).out
    else:
        out = ops.fused_moe(x, topk, w, act, config=case.config)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = moe_reference_fp64(x, topk, w, act)
    assert rel_err(out, ref) < TOLERANCE[case.dtype]
    if case.T:  # same function as the torch runner, not only close to fp64
        assert rel_err(out, run_standard(x, topk, w, act)) < TOLERANCE[case.dtype]


def test_persistent_grid_sizes_agree(monkeypatch):
    """One program looping over every work item and many programs give the same bits."""
    from moekit.runners.triton_kernel import configs

    w = make_weights(3, 32, 32, torch.float32, True)
    x = torch.randn(10, 32, device=DEVICE)
    topk = make_topk(10, 2, 3)
    cfg = KernelConfig(16, Tile(16, 16), Tile(16, 16), group_m=3, tma=False)
    outs = []
    for n in (1, 7):
        monkeypatch.setattr(ops, "ROUTING", replace(configs.ROUTING, cpu_programs=n))
        outs.append(ops.fused_moe(x, topk, w, ActivationSpec(), config=cfg))
    if not ON_GPU:
        assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], moe_reference_fp64(x, topk, w, ActivationSpec())) < 1e-5


# ---------------------------------------------------------------------------------------------
# Configs, registry, errors
# ---------------------------------------------------------------------------------------------


def test_config_for_picks_by_rows_per_expert_and_clamps():
    small = config_for(1, 8, 128, 2048, 768)
    large = config_for(16384, 8, 128, 2048, 768)
    assert small.block_m < large.block_m == HEURISTIC[-1][1].block_m
    assert large.block_m >= 64  # wgmma-sized tiles at large batches
    tiny = config_for(4, 2, 3, 40, 24)
    assert tiny.gate_up.block_n == 32 and tiny.down.block_k == 32 and tiny.down.block_n == 64
    inter = config_for(16384, 4, 128, 2880, 2880, interleaved=True)
    assert 2 * inter.gate_up.block_n <= 256
    bounds = [b for b, _ in HEURISTIC]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")


def _write_table(path, configs: dict):
    path.write_text(json.dumps({"configs": {str(b): c.to_dict() for b, c in configs.items()}}))


def test_tuned_table_is_used_near_its_batch_sizes(monkeypatch, tmp_path):
    from moekit.runners.triton_kernel import configs

    monkeypatch.setattr(configs, "table_dir", lambda: tmp_path)
    tuned = KernelConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3, flatten=True),
                         reduce="atomic")  # fmt: skip
    name = configs.table_name(128, 8, 2048, 768, "silu", False, "bfloat16", "NVIDIA H100",
                              triton.__version__)  # fmt: skip
    assert " " not in name and name.endswith(".json")
    _write_table(tmp_path / name, {4096: tuned, 16384: replace(tuned, group_m=16)})
    configs.read_table.cache_clear()
    try:
        args = (8, 128, 2048, 768, False, "silu", "bfloat16", "NVIDIA H100")
        assert config_for(4096, *args) == tuned
        assert config_for(3000, *args) == tuned  # nearest in log2, within a factor 2
        assert config_for(20000, *args).group_m == 16
        assert config_for(256, *args) == configs.heuristic_config(256, 8, 128, 2048, 768)
        other = (8, 128, 2048, 768, True, "silu", "bfloat16", "NVIDIA H100")  # interleaved
        assert config_for(4096, *other) == configs.heuristic_config(4096, 8, 128, 2048, 768, True)
        (tmp_path / name).write_text('{"configs": {"4096": {"block_m": 48}}}')
        configs.read_table.cache_clear()
        with pytest.raises(ValueError, match="bad triton_kernel config file"):
            config_for(4096, *args)
    finally:
        configs.read_table.cache_clear()


def test_table_of_another_triton_version_is_used_and_said(monkeypatch, tmp_path, caplog):
    from moekit.runners.triton_kernel import configs

    monkeypatch.setattr(configs, "table_dir", lambda: tmp_path)
    monkeypatch.setattr(configs, "triton_version", lambda: "9.9.9")
    tuned = KernelConfig(128, Tile(128, 64, 8, 4), Tile(256, 64, 8, 3), reduce="atomic")
    args = (128, 8, 2048, 768, "silu", False, "bfloat16", "NVIDIA H100")
    _write_table(tmp_path / configs.table_name(*args, "3.6.0"), {4096: tuned})
    _write_table(tmp_path / configs.table_name(*args, "3.5.0"), {4096: replace(tuned, group_m=16)})
    configs.read_table.cache_clear()
    try:
        with caplog.at_level("INFO", logger="moekit"):
            got = config_for(4096, 8, 128, 2048, 768, False, "silu", "bfloat16", "NVIDIA H100")
        assert got == tuned  # the newest other version
        assert "tuned with Triton 3.6.0, running 9.9.9" in caplog.text
    finally:
        configs.read_table.cache_clear()


def test_config_dict_round_trip_and_unknown_keys():
    cfg = KernelConfig(64, Tile(64, 32, 4, 3, warp_specialize=True), Tile(128, 64), reduce="atomic")
    assert KernelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown keys"):
        KernelConfig.from_dict({**cfg.to_dict(), "swap_ab": True})


def test_shipped_tables_load():
    from moekit.runners.triton_kernel import configs

    files = sorted(configs.table_dir().glob("*.json"))
    for f in files:
        table = configs.read_table(f)
        assert table and all(isinstance(c, KernelConfig) for c in table.values())


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="reduce"):
        KernelConfig(reduce="mean")
    with pytest.raises(ValueError, match="flatten"):
        Tile(flatten=1)
    with pytest.raises(ValueError, match="block_m"):
        KernelConfig(block_m=48)
    with pytest.raises(ValueError, match="num_warps"):
        Tile(num_warps=3)
    with pytest.raises(ValueError, match="programs_per_sm"):
        KernelConfig(programs_per_sm=0)


def test_registered_and_caps():
    assert runner_class("triton_kernel") is TritonKernelRunner
    caps = TritonKernelRunner.caps
    assert caps.cuda_graph and caps.formats == {"standard"}
    assert caps.activations == {"silu", "gelu", "swiglu_oai"}
    assert caps.weight_formats == {"unquantized", "fp8_w8a8"}  # fp8: Gluon engine only


def test_refuses_what_it_cannot_run():
    why = TritonKernelRunner.unsupported("standard", "unquantized", "silu", "bfloat16", "cpu", False)
    if interpret_mode():  # CPU through the interpreter, which computes bf16 wrongly
        assert why and "float16" in why and "interpreter" in why
    else:  # compiled Triton: no CPU at all
        assert why and "device 'cpu'" in why
    why = TritonKernelRunner.unsupported("masked", "unquantized", "silu", "float16", "cuda", False)
    assert why and "standard" in why
    why = TritonKernelRunner.unsupported("standard", "int4_w4a16", "silu", "float16", "cuda", False)
    assert why and "unquantized" in why
    w = make_weights(2, 32, 16, torch.float32, False)
    x = torch.randn(2, 3, 32, device=DEVICE)
    with pytest.raises(RunnerError, match="dispatch format"):
        TritonKernelRunner().run(MaskedDispatchOutput(x, torch.ones(2, dtype=torch.int32)), w,
                                 ActivationSpec())  # fmt: skip


def test_availability_says_why():
    no_triton = Platform("cuda", "gpu", (9, 0), 1, {"triton": None})
    assert "triton" in TritonKernelRunner.availability(no_triton).reason
    assert not TritonKernelRunner.availability(Platform("cuda", "gpu", (7, 0), 1, {"triton": "3.6.0"}))
    assert TritonKernelRunner.availability(Platform("cuda", "H100", (9, 0), 1, {"triton": "3.6.0"}))
    cpu = Platform("cpu", "cpu", None, 0, {"triton": "3.6.0"})
    assert bool(TritonKernelRunner.availability(cpu)) == (not ON_GPU)  # conftest interprets on CPU


def test_bad_inputs_are_refused():
    w = make_weights(2, 32, 16, torch.float32, False)
    with pytest.raises(ValueError, match="hidden size"):
        ops.fused_moe(torch.randn(3, 24, device=DEVICE), make_topk(3, 1, 2), w, ActivationSpec())
    with pytest.raises(ValueError, match="activation"):
        ops.fused_moe(torch.randn(3, 32, device=DEVICE), make_topk(3, 1, 2), w,
                      ActivationSpec("relu"))  # fmt: skip
    with pytest.raises(ValueError, match="must match x"):
        ops.fused_moe(torch.randn(3, 32, device=DEVICE, dtype=torch.float16), make_topk(3, 1, 2),
                      w, ActivationSpec())  # fmt: skip


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

PRESET_SHAPES = [
    ("qwen3-30b-a3b", 1, 1),
    ("mixtral-8x7b", 2, 1),
    ("deepseek-v3", 8, 8),
    ("gpt-oss-120b", 1, 1),
]


def reference_fp32_sparse(x, topk: TopKOutput, w: ExpertWeights, act):
    """Float32 reference of the experts in use only (preset weights are too big for float64)."""
    used = torch.unique(topk.ids[topk.ids >= 0]).long()
    remap = torch.full((w.num_experts,), -1, dtype=torch.int32, device=x.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=x.device)
    ids = torch.where(topk.ids >= 0, remap[topk.ids.long().clamp(min=0)], -1)

    def pick(t):
        return None if t is None else t[used].float()

    w32 = ExpertWeights(pick(w.w13), pick(w.w2), pick(w.b13), pick(w.b2))
    return run_standard(x.float(), TopKOutput(topk.weights, ids), w32, act)


@pytest.mark.gpu
@pytest.mark.parametrize("model,tp,ep", PRESET_SHAPES, ids=lambda v: str(v))
def test_presets_bf16_gpu(model, tp, ep):
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    w = random_weights(shape, "cuda")
    for T in (1, 300, 2048):
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.02 if T > 1 else 0.0)
        out = TritonKernelRunner().run(StandardDispatchOutput(x, topk), w, shape.act).out
        err = rel_err(out, reference_fp32_sparse(x, topk, w, shape.act))
        assert err < TOLERANCE[torch.bfloat16], (model, T, err)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False])
def test_routing_matches_twin_gpu(monkeypatch, tma):
    tuning = routing.ROUTING
    for T, K, E, bm in ((16384, 8, 128, 128), (4096, 8, 128, 128), (3000, 2, 8, 64),
                        (5, 4, 32, 16)):  # fmt: skip
        ids = make_topk(T, K, E, masked=0.05).ids
        want = routing.route_torch(ids, E, bm)
        for fused in (0, 1 << 20):  # the scan kernel, and the sums in the scatter kernel
            monkeypatch.setattr(routing, "ROUTING",
                                replace(tuning, fused_max_chunks=fused))  # fmt: skip
            got = routing.route(ids, E, bm)
            for name in ("sorted_pairs", "counts", "offsets", "tile_expert", "tile_row0",
                         "tile_rows", "num_tiles"):  # fmt: skip
                assert torch.equal(getattr(got, name), getattr(want, name)), (T, fused, name)
    monkeypatch.undo()
    # both load paths on odd shapes
    cfg = KernelConfig(64, Tile(64, 64, 4, 3), Tile(64, 64, 4, 3), tma=tma)
    w = make_weights(6, 328, 200, torch.bfloat16, True)
    act = ActivationSpec("swiglu_oai", interleaved=True)
    x = torch.randn(301, 328, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(301, 3, 6, masked=0.1)
    out = ops.fused_moe(x, topk, w, act, config=cfg)
    assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["sum", "atomic"])
def test_cuda_graph_replay_equals_eager(reduce):
    """'sum' is bit-identical between replay and eager; 'atomic' adds in a varying order."""
    E, K, H, I, T = 32, 4, 1024, 512, 700
    cfg = replace(config_for(T, K, E, H, I), reduce=reduce)
    w = make_weights(E, H, I, torch.bfloat16, False)
    act = ActivationSpec()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, K, E)
    static_x, static_w, static_ids = x.clone(), topk.weights.clone(), topk.ids.clone()

    def step():
        return ops.fused_moe(static_x, TopKOutput(static_w, static_ids), w, act, config=cfg)

    graph, static_out = capture_graph(step)
    for skew in (False, True):  # new inputs and a new routing (tile count) each replay
        x2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk2 = make_topk(T, K, E, masked=0.1, one_expert=skew)
        static_x.copy_(x2), static_w.copy_(topk2.weights), static_ids.copy_(topk2.ids)
        graph.replay()
        eager = ops.fused_moe(x2, topk2, w, act, config=cfg)
        if reduce == "sum":
            assert torch.equal(static_out, eager)  # deterministic: bit-identical
        else:
            assert rel_err(static_out, eager) < 1e-2
        assert rel_err(static_out, moe_reference_fp64(x2, topk2, w, act)) < 3e-2
