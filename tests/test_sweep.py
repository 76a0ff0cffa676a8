"""The bench sweep: synthetic routing, per-rank cost and floor arithmetic, records, reports."""

import json
from pathlib import Path

import pytest
import torch

from moekit import bench, report, sweep
from moekit.bench import Ceilings
from moekit.config import ConfigError, MoEConfig, ParallelConfig, validate
from moekit.hardware import Availability
from moekit.layer import MoE
from moekit.presets import PRESETS
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.base import Runner, RunnerCaps
from moekit.sweep import (
    SweepSpec,
    cpu_scaled,
    layer_over_sets,
    make_routing,
    point_cost,
    run_sweep,
    weight_bytes_per_expert,
    winners,
)

CEILINGS = Ceilings(copy_bytes_per_s=1e10, matmul_flops_per_s=1e11, dtype="float32")


def tiny(**kw) -> MoEConfig:
    base = dict(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    base.update(kw)
    return MoEConfig(**base)


def spec(**kw) -> SweepSpec:
    base = dict(
        preset="tiny",
        moe=tiny(),
        parallel=ParallelConfig(),
        batch_sizes=(0, 1, 5),
        backends=("torch",),
        device="cpu",
    )
    base.update(kw)
    return SweepSpec(**base)


# ---------------------------------------------------------------------------- cost arithmetic


def test_point_cost_hand_computed_rank0_of_ep2():
    """E=4 over ep=2 (rank 0 holds experts 0, 1), K=2, H=8, I=6, float32, T=3."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=6, dtype="float32")
    module = MoE(cfg, ParallelConfig(tp_size=2, ep_size=2), tp_rank=0)
    ids = torch.tensor([[0, 3], [2, 1], [1, 0]], dtype=torch.int32)
    topk = TopKOutput(torch.full((3, 2), 0.5), ids)
    x = torch.randn(3, 8)
    cost, local_ids = point_cost(module, x, topk)
    # Local ids: experts 2, 3 are on rank 1 -> -1.
    assert local_ids.tolist() == [[0, -1], [-1, 1], [1, 0]]
    # 4 local pairs; weights per expert (2I*H + H*I) * 4 bytes = (96 + 48) * 4 = 576 bytes.
    assert weight_bytes_per_expert(module.expert_weights) == 576
    assert cost.flops == 2 * 4 * 3 * 8 * 6  # 1152
    # 2 touched experts + activations in and out: 2*576 + 2*3*8*4 = 1152 + 192
    assert cost.bytes == 1344
    ceil = Ceilings(copy_bytes_per_s=1344.0, matmul_flops_per_s=576.0, dtype="float32")
    assert cost.floor_s(ceil) == pytest.approx(2.0)  # max(1344/1344, 1152/576)
    ceil = Ceilings(copy_bytes_per_s=672.0, matmul_flops_per_s=1152.0, dtype="float32")
    assert cost.floor_s(ceil) == pytest.approx(2.0)  # memory bound this time


def test_weight_bytes_count_biases():
    cfg = tiny(has_bias=True, activation="swiglu_oai", interleaved=True)
    module = MoE(cfg)
    H, I = cfg.hidden_size, cfg.intermediate_size
    assert weight_bytes_per_expert(module.expert_weights) == (3 * H * I + 2 * I + H) * 4


def test_tp_slices_intermediate_in_cost():
    """tp 4, ep 2: moe_tp 2, so I_local = I / 2 and FLOPs halve against tp 2 ep 2."""
    cfg = tiny(num_experts=4, intermediate_size=8)
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    topk = TopKOutput(torch.ones(1, 2) / 2, ids)
    x = torch.randn(1, cfg.hidden_size)
    full, _ = point_cost(MoE(cfg, ParallelConfig(2, 2)), x, topk)
    half, _ = point_cost(MoE(cfg, ParallelConfig(4, 2)), x, topk)
    assert half.flops * 2 == full.flops == 2 * 2 * 3 * 16 * 8


# ---------------------------------------------------------------------------- routing


@pytest.mark.parametrize("routing", ["uniform", "zipf"])
def test_routing_distinct_in_range(routing):
    g = torch.Generator().manual_seed(1)
    topk = make_routing(300, 12, 4, routing=routing, generator=g)
    assert topk.ids.dtype == torch.int32 and topk.weights.dtype == torch.float32
    assert topk.ids.shape == (300, 4)
    assert int(topk.ids.min()) >= 0 and int(topk.ids.max()) < 12
    assert all(len(set(row)) == 4 for row in topk.ids.tolist())
    torch.testing.assert_close(topk.weights.sum(1), torch.ones(300))


def test_zipf_is_skewed_uniform_is_not():
    g = torch.Generator().manual_seed(2)
    T, E, K = 4000, 32, 2
    uni = torch.bincount(make_routing(T, E, K, generator=g).ids.flatten().long(), minlength=E)
    zipf = torch.bincount(
        make_routing(T, E, K, routing="zipf", zipf_s=1.2, generator=g).ids.flatten().long(),
        minlength=E,
    )
    mean = T * K / E
    assert uni.max() < 1.5 * mean
    assert zipf.max() > 4 * mean


def test_routing_empty_and_shared():
    assert make_routing(0, 8, 2, routing="zipf").ids.shape == (0, 2)
    topk = make_routing(5, 8, 2, num_shared=1)
    assert topk.ids[:, 2].tolist() == [8] * 5
    assert topk.weights[:, 2].tolist() == [1.0] * 5


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 2), (8, 8)])
def test_cpu_scale_down_is_valid_and_small(name, tp, ep):
    parallel = ParallelConfig(tp, ep)
    small = cpu_scaled(PRESETS[name], parallel)
    validate(small, parallel)
    assert small.hidden_size == 256 and small.intermediate_size // parallel.moe_tp_size == 128
    assert small.num_experts <= 16 and small.top_k == PRESETS[name].top_k
    assert small.activation == PRESETS[name].activation


# ---------------------------------------------------------------------------- the sweep


def test_sweep_records_and_arithmetic():
    result = run_sweep(spec(backends=("torch", "auto")), ceilings=CEILINGS)
    assert [(r.backend, r.T) for r in result.records] == [
        (b, t) for t in (0, 1, 5) for b in ("torch", "auto")
    ]
    for r in result.records:
        assert r.error is None and r.ms > 0
        assert r.rel_err == 0.0  # on CPU auto runs torch, the reference
        if r.T == 0:
            assert r.flops == 0 and r.time_over_floor is None
            continue
        assert r.pairs == r.T * 2  # ep 1: every pair is local
        c = CEILINGS
        floor_ms = max(r.bytes / c.copy_bytes_per_s, r.flops / c.matmul_flops_per_s) * 1e3
        assert r.floor_ms == pytest.approx(floor_ms)
        assert r.time_over_floor == pytest.approx(r.ms / floor_ms)
        assert r.tflops == pytest.approx(r.flops / (r.ms * 1e-3) / 1e12)
        assert r.gbps == pytest.approx(r.bytes / (r.ms * 1e-3) / 1e9)
    assert {r.chosen for r in result.records if r.backend == "auto"} == {"torch"}
    assert result.auto_choice == {0: "torch", 1: "torch", 5: "torch"}
    assert set(winners(result.records)) == {0, 1, 5}
    assert all(w.backend == "torch" for w in winners(result.records).values())


def test_sweep_ep_counts_only_local_pairs():
    s = spec(moe=tiny(num_experts=8, top_k=4), parallel=ParallelConfig(2, 2), batch_sizes=(64,))
    (r,) = run_sweep(s, ceilings=CEILINGS).records
    assert 0 < r.pairs < 64 * 4  # about half the pairs are on rank 1
    assert r.touched_experts <= 4


class _Broken(Runner):
    name = "flashinfer_cutedsl"
    caps = RunnerCaps(
        formats=frozenset({"standard"}),
        weight_formats=frozenset({"unquantized"}),
        activations=frozenset({"silu"}),
        devices=frozenset({"cpu"}),
    )

    @classmethod
    def availability(cls, platform):
        return Availability(True)

    def run(self, dispatch_out, weights, act):
        raise RuntimeError("kernel exploded")


def test_failing_backend_is_recorded_and_sweep_goes_on(monkeypatch):
    registry.registered()  # load the built-in runners first
    monkeypatch.setitem(registry._RUNNERS, "flashinfer_cutedsl", _Broken)
    result = run_sweep(spec(backends=("flashinfer_cutedsl", "torch")), ceilings=CEILINGS)
    broken = [r for r in result.records if r.backend == "flashinfer_cutedsl"]
    assert broken and all(r.ms is None and "kernel exploded" in r.error for r in broken)
    assert all(r.ms is not None for r in result.records if r.backend == "torch")


def test_unavailable_backends_skipped_with_reason():
    result = run_sweep(spec(backends=("torch", "flashinfer_trtllm")), ceilings=CEILINGS)
    assert "flashinfer_trtllm" in result.skipped and result.skipped["flashinfer_trtllm"]
    assert {r.backend for r in result.records} == {"torch"}


def test_time_budget_skips_points():
    result = run_sweep(spec(time_budget_s=1e-9), ceilings=CEILINGS)
    assert all(r.ms is None and r.error.startswith("skipped") for r in result.records)


def test_spec_rejects_bad_values():
    with pytest.raises(ConfigError, match="--routing"):
        spec(routing="pareto")
    with pytest.raises(ConfigError, match="--batch-sizes"):
        spec(batch_sizes=(-1,))
    with pytest.raises(ConfigError, match="--backends.*allowed"):
        spec(backends=("nope",))
    with pytest.raises(ConfigError, match="--zipf-s"):
        spec(routing="zipf", zipf_s=0.0)


# ---------------------------------------------------------------------------- reports


def _doc(timestamp: str, ms_scale: float = 1.0, **meta_over) -> dict:
    result = run_sweep(spec(batch_sizes=(1, 5)), ceilings=CEILINGS)
    for r in result.records:
        r.ms *= ms_scale
    meta = report.metadata(["moekit", "bench"])
    meta["timestamp"] = timestamp
    meta.update(meta_over)
    return report.result_dict(result, meta)


def test_json_roundtrip_and_benchmarks_md(tmp_path):
    root = tmp_path
    results = root / "benchmarks" / "results"
    old = _doc("2026-01-01T00:00:00Z", ms_scale=1000.0)
    new = _doc("2026-02-01T00:00:00Z")
    other = _doc("2025-01-01T00:00:00Z", device={**new["device"], "name": "Fake GPU"})
    paths = [report.save(d, results, plot=False)[0] for d in (old, new, other)]
    assert len({p.name for p in paths}) == 3
    loaded = json.loads(paths[1].read_text())
    for key in ("device", "libraries", "commit", "command", "ceilings", "records",
                "timed", "parallel", "routing", "auto_choice", "winners"):
        assert key in loaded
    assert loaded["command"] == "moekit bench"
    newest = report.newest_per_key(report.load_results(results))
    assert sorted(d["timestamp"] for _, d in newest) == [
        "2025-01-01T00:00:00Z", "2026-02-01T00:00:00Z"
    ]
    md_path = report.update_benchmarks_md(root)
    md = md_path.read_text()
    assert md.count("| T | torch | winner | auto picks |") == 2
    assert "## Fake GPU" in md and "Do not edit by hand" in md
    r1 = next(r for r in new["records"] if r["T"] == 1)
    assert f"| 1 | {r1['ms']:.4g} ({r1['time_over_floor']:.2f}x) | torch | torch |" in md
    assert paths[1].name in md and paths[0].name not in md  # only the newest per key
    # a probe's result beside them (points keyed by name, not a list) does not stop the page
    probe = {"meta": {"commit": "abc"}, "points": {"job T=1": {"ms": 1.0}}}
    (results / "20260301T0000Z_H100_some_probe.json").write_text(json.dumps(probe))
    assert "Do not edit by hand" in report.update_benchmarks_md(root).read_text()


def test_script_sections_show_the_newest_run_per_kind_and_device(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)

    def quant(device, value):
        return {"device": device, "commit": "c0ffee", "targets": {},
                "summary": [{"what": "mxfp4 T=1 speed-up", "value": value, "target": ">= 2.5",
                             "met": value >= 2.5}]}  # fmt: skip

    def kernel(speedup):
        return {"device": "H100", "triton": "3.9.0", "commit": "c0ffee",
                "points": [{"model": "qwen3", "T": 4096, "triton_kernel_ms": 1.0,
                            "triton_over_floor": 1.5, "triton_kernel_over_floor": 1.4,
                            "speedup": speedup}]}  # fmt: skip

    runs = {"20260101T0000Z_quant_old.json": quant("H100", 1.11),
            "20260201T0000Z_quant_new.json": quant("H100", 2.22),
            "20250101T0000Z_quant_h200.json": quant("H200", 3.33),
            "20260101T0000Z_kernel_old.json": kernel(0.91),
            "20260201T0000Z_kernel_new.json": kernel(1.07)}  # fmt: skip
    for name, doc in runs.items():
        (results / name).write_text(json.dumps(doc))
    md = report.render_script_md(results, tmp_path)
    for name in ("quant_new", "quant_h200", "kernel_new"):
        assert f"{name}.json" in md
    assert "_old.json" not in md and "| 1.11 |" not in md and "| 0.91 |" not in md
    assert "| mxfp4 T=1 speed-up | 2.22 | >= 2.5 | no |" in md
    assert "| mxfp4 T=1 speed-up | 3.33 | >= 2.5 | yes |" in md
    assert "| qwen3 | 4096 | 1.50x | 1.40x | 1.07 |" in md


def test_target_tables_of_the_scripts(tmp_path, monkeypatch):
    """The rows of issue 4's targets that scripts/gpu_fp8_vs_bf16.py and gpu_w4a16.py write, and
    a table rendered beside scripts/gpu_triton_quant.py's of the same device."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    probe_out = importlib.import_module("probe_out")
    fp8 = importlib.import_module("gpu_fp8_vs_bf16")
    assert probe_out.target_row("a", 1.29, "<=", 1.3)["met"]
    assert not probe_out.target_row("a", 1.31, "<=", 1.3)["met"]
    assert probe_out.target_row("a", None, ">=", 2.5) == {
        "what": "a", "value": None, "target": ">= 2.5", "met": False}
    points = [{"model": "deepseek-v3", "tp": 8, "ep": 8, "T": T,
               "bf16_over_fp8": {"auto": ratio}}
              for T, ratio in ((1, 1.81234), (1024, 1.2), (4096, 1.4))]  # fmt: skip
    rows = fp8.target_rows(points)
    assert rows == [
        {"what": "deepseek-v3 TP8 EP8 T=1 bf16 triton / fp8 auto", "value": 1.812,
         "target": ">= 1.7", "met": True},
        {"what": "deepseek-v3 TP8 EP8 T=4096 bf16 triton / fp8 auto", "value": 1.4,
         "target": ">= 1.5", "met": False},
    ]  # fmt: skip
    w4a16 = importlib.import_module("gpu_w4a16")
    point = {"job": "mixtral-8x7b --tp-size 2", "format": "mxfp4", "T": 1, "triton_ms": 0.07,
             "w4a16_ms": 0.04, "auto_ms": 0.04, "bf16_over_w4a16": 2.9,
             "w4a16_over_floor": 1.31}  # fmt: skip
    never_ran = {**point, "job": "gpt-oss-120b", "format": "int4_w4a16", "triton_ms": None,
                 "w4a16_ms": None, "auto_ms": None, "bf16_over_w4a16": None,
                 "w4a16_over_floor": None}  # fmt: skip
    assert [(r["what"], r["met"]) for r in w4a16.target_rows([point, never_ran])] == [
        ("mxfp4 mixtral-8x7b TP2 T=1 bf16 triton / w4a16", True),
        ("mxfp4 mixtral-8x7b TP2 T=1 w4a16 time / own floor", False),
    ]
    results = tmp_path / "results"
    results.mkdir()
    doc = {"device": "H100", "commit": "abc1234", "script": "scripts/gpu_fp8_vs_bf16.py",
           "title": "fp8 against bf16", "targets": fp8.TARGETS, "summary": rows}  # fmt: skip
    (results / "20260102T0000Z_fp8.json").write_text(json.dumps(doc))
    quant = {"device": "H100", "commit": "def5678", "targets": {},
             "summary": [probe_out.target_row("mxfp4 T=1", 2.6, ">=", 2.5)]}  # fmt: skip
    (results / "20260101T0000Z_quant.json").write_text(json.dumps(quant))
    md = report.render_script_md(results, tmp_path)
    assert "## fp8 against bf16 (H100, scripts/gpu_fp8_vs_bf16.py)" in md
    assert "| deepseek-v3 TP8 EP8 T=4096 bf16 triton / fp8 auto | 1.4 | >= 1.5 | no |" in md
    assert "## Quantized `triton` against bf16 `triton` (H100, scripts/gpu_triton_quant.py)" in md
    assert "| mxfp4 T=1 | 2.6 | >= 2.5 | yes |" in md


def test_plot_written(tmp_path):
    doc = _doc("2026-01-01T00:00:00Z")
    json_path, png = report.save(doc, tmp_path, plot=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(json_path.read_text())["plot"] == png.name


def test_git_commit_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEKIT_GIT_COMMIT", "abc123")
    assert report.git_commit(Path(tmp_path)) == ("abc123", None)
    assert report.git_commit() == ("abc123", None)  # set: wins over the checkout's HEAD
    monkeypatch.delenv("MOEKIT_GIT_COMMIT")
    assert report.git_commit(Path(tmp_path))[0] == "unknown"
    root = report.repo_root()
    if root is not None and (root / ".git").exists():
        commit, _ = report.git_commit()
        assert len(commit) == 40 and int(commit, 16) >= 0


def test_eight_bit_rate_only_on_cuda():
    from moekit.bench import ceilings_for_format, measure_matmul_rate

    assert measure_matmul_rate("cpu", "float8_e4m3fn") is None
    assert ceilings_for_format("cpu", torch.float32, "fp8_w8a8").dtype == "float32"


@pytest.mark.gpu
def test_fp8_matmul_rate_beats_bf16_on_hopper():
    from moekit.bench import measure_ceilings, measure_matmul_rate

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm_89+")
    fp8 = measure_matmul_rate("cuda", "float8_e4m3fn")
    bf16 = measure_ceilings("cuda", torch.bfloat16).matmul_flops_per_s
    assert fp8 is not None and fp8 > 1.3 * bf16


def test_interleaved_timing_alternates_the_order_and_keeps_each_median():
    """Samples of several functions are taken in rounds whose order changes (so no function
    always runs right after the same one), and each function gets its own median."""
    import time as _time

    from moekit.bench import time_ms_interleaved

    calls = []

    def make(name, seconds):
        def fn():
            calls.append(name)
            _time.sleep(seconds)

        return fn

    fns = {"slow": make("slow", 0.004), "fast": make("fast", 0.001)}
    ms = time_ms_interleaved(fns, "cpu", rounds=3, warmup=1, samples=3)
    assert calls[:2] == ["slow", "fast"]  # warm-up
    assert calls[2:] == ["slow", "fast", "fast", "slow"] * 2  # rounds 3 -> two designs of 2
    assert ms["fast"] >= 1.0 and ms["slow"] >= 4.0 and ms["slow"] > ms["fast"]

    # by default, one sample of each function a round: every block of len(fns) calls has each once
    calls.clear()
    fns["mid"] = make("mid", 0.002)
    time_ms_interleaved(fns, "cpu", warmup=0, samples=12)
    assert len(calls) == 36
    assert all(sorted(calls[i : i + 3]) == ["fast", "mid", "slow"] for i in range(0, 36, 3))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_round_orders_put_every_function_after_every_other_equally_often(n):
    """A rotation would not: with three functions, c would follow b in every round but one."""
    from collections import Counter

    from moekit.bench import round_orders

    rows = round_orders(n, 5)
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert len(rows) % (n if n % 2 == 0 else 2 * n) == 0  # whole designs
    after = Counter((row[i], row[i + 1]) for row in rows for i in range(n - 1))
    assert set(after) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(after.values())) <= 1
    assert round_orders(n, 1) == rows[:1]


def test_a_backend_whose_timing_fails_does_not_lose_the_others():
    """Timed together, one failing function: the others are timed one at a time and the failing
    one's record says why."""
    from moekit.sweep import Record, _time_together

    def ok():
        return None

    def bad():
        raise RuntimeError("kernel launch failed")

    recs = {b: Record(backend=b, T=4, flops=1.0, bytes=1.0) for b in ("ok", "bad")}
    timed = {"ok": (recs["ok"], ok, False), "bad": (recs["bad"], bad, False)}
    ms = _time_together(timed, "cpu", {"warmup": 1, "samples": 2, "rounds": 1})
    assert set(ms) == {"ok"} and ms["ok"] >= 0
    assert recs["bad"].error == "timing: RuntimeError: kernel launch failed"
    assert recs["ok"].error is None


def test_metadata_names_the_commit_and_a_scripts_own_command():
    meta = report.metadata(["moekit", "bench", "--model", "qwen3-30b-a3b"])
    assert meta["command"] == "moekit bench --model qwen3-30b-a3b"
    assert meta["commit"] == report.git_commit()[0] and meta["commit"]
    probe = report.metadata(command="python scripts/gpu_probe_masked.py")
    assert probe["command"] == "python scripts/gpu_probe_masked.py"


def test_layer_over_sets_runs_every_set_inside_the_context_without_autograd():
    from contextlib import contextmanager

    from moekit.config import RunnerConfig

    module = MoE(tiny(), ParallelConfig(), runner=RunnerConfig("torch"))
    sets = [(torch.randn(T, 16), make_routing(T, 6, 2)) for T in (3, 5)]
    seen, entered = [], []
    real = module.forward_topk

    def forward_topk(x, topk):
        seen.append((x.shape[0], torch.is_grad_enabled(), len(entered)))
        return real(x, topk)

    @contextmanager
    def around():
        entered.append(1)
        yield

    module.forward_topk = forward_topk
    fn = layer_over_sets(module, sets, around)
    assert not seen  # nothing runs until called
    fn()
    fn()
    assert seen == [(3, False, 1), (5, False, 1), (3, False, 2), (5, False, 2)]


def test_input_sets_rotate_past_l2_and_over_several_routings_at_small_t(monkeypatch):
    """Timing a device: at least MIN_ROUTINGS distinct routings up to MULTI_ROUTING_MAX_T
    tokens, else as many as L2 asks; never more than MAX_INPUT_SETS; one set on the CPU."""
    assert 1 < bench.MIN_ROUTINGS <= bench.MAX_INPUT_SETS
    monkeypatch.setattr(bench, "MIN_ROUTINGS", 3)
    monkeypatch.setattr(bench, "MAX_INPUT_SETS", 6)
    module = MoE(tiny(), ParallelConfig())
    s = spec()

    def sets(T, l2):
        got, cost, ids = sweep._input_sets(s, module, T, torch.Generator().manual_seed(0), l2)
        assert len(ids) == len(got) and cost.bytes > 0
        return got

    one_set = sweep._input_sets(s, module, 1, torch.Generator().manual_seed(0), 0)[1].bytes
    assert len(sets(1, 0)) == len(sets(bench.MULTI_ROUTING_MAX_T, 0)) == 1  # CPU
    assert bench.l2_cache_bytes("cpu") == bench.l2_cache_bytes(torch.device("cpu")) == 0
    big, l2 = 1e12, 50 << 20  # one set's bytes far above L2
    assert bench.routings_for(4096, big, l2) == 1
    assert bench.routings_for(4096, big, l2, skewed=True) == bench.MIN_SKEWED_ROUTINGS > 1
    assert bench.routings_for(0, big, l2, skewed=True) == 1
    assert bench.routings_for(4096, big, 0, skewed=True) == 1  # CPU
    small = sets(4, 1)  # L2 of 1 byte: the bytes alone would ask for one set
    assert len(small) == 3
    assert len({tuple(t.ids.flatten().tolist()) for _, t in small}) > 1  # distinct routings
    assert len(sets(bench.MULTI_ROUTING_MAX_T + 1, 1)) == 1
    assert len(sets(1, int(one_set) // 2)) == 3  # 2 sets asked, raised to 3
    assert len(sets(1, int(10 * one_set))) == 6  # 40 sets asked, capped
    empty = sweep._input_sets(s, module, 0, torch.Generator().manual_seed(0), 1)[0]
    assert len(empty) == 1  # T = 0: nothing to vary
