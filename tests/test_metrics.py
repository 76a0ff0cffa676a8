"""`moekit.metrics`: runner calls and EPLB balance, in process always, Prometheus when installed."""

import importlib
import importlib.util
import sys
import types

import pytest
import torch

from moekit import MoE, MoEConfig, RunnerConfig, metrics
from moekit.router import TopKOutput


@pytest.fixture(autouse=True)
def _fresh_counts():
    metrics.reset()
    yield
    metrics.reset()


def test_counts_in_process():
    assert metrics.runner_calls() == {}
    for name in ("triton", "triton", "cutlass"):
        metrics.record_runner_call(name)
    assert metrics.runner_calls() == {"triton": 2, "cutlass": 1}
    metrics.reset()
    assert metrics.runner_calls() == {}


def test_balance_in_process():
    metrics.record_balance(0, 0.4, moved=True)
    metrics.record_balance(1, 1.0, moved=False)
    assert metrics.expert_balancedness() == {0: 0.4, 1: 1.0}
    assert metrics.eplb_rebalances() == 1
    metrics.reset()
    assert metrics.expert_balancedness() == {} and metrics.eplb_rebalances() == 0


def test_counts_are_a_copy():
    metrics.record_runner_call("torch")
    snapshot = metrics.runner_calls()
    snapshot["torch"] = 100
    assert metrics.runner_calls() == {"torch": 1}


def test_the_layer_counts_each_call_by_chosen_backend():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    layers = {b: MoE(cfg, runner=RunnerConfig(b), device="cpu") for b in ("torch", "cutlass")}
    x = torch.randn(3, 16)
    topk = TopKOutput(torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, -1]], dtype=torch.int32))
    for _ in range(2):
        layers["torch"].forward_topk(x, topk)
    layers["cutlass"].forward_topk(x, topk)
    assert metrics.runner_calls() == {"torch": 2, "cutlass": 1}


class _FakeMetric:
    """Stands in for prometheus_client.Counter / Gauge: records values per label set."""

    instances: dict = {}

    def __init__(self, name, doc, labelnames=()):
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.values: dict = {}
        _FakeMetric.instances[name] = self

    def _add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount

    def inc(self, amount=1):
        self._add((), amount)

    def labels(self, **kw):
        metric, key = self, tuple(sorted(kw.items()))

        class _Child:
            def inc(self, amount=1):
                metric._add(key, amount)

            def set(self, value):
                metric.values[key] = value

        return _Child()


def test_prometheus_metrics_when_installed(monkeypatch):
    fake = types.ModuleType("prometheus_client")
    fake.Counter = fake.Gauge = _FakeMetric
    monkeypatch.setitem(sys.modules, "prometheus_client", fake)
    try:
        importlib.reload(metrics)
        assert metrics.prometheus_enabled()
        metrics.record_runner_call("deep_gemm")
        metrics.record_runner_call("deep_gemm")
        counter = _FakeMetric.instances[metrics.PROMETHEUS_NAME]
        assert counter.labelnames == ["backend"]
        assert counter.values == {(("backend", "deep_gemm"),): 2}
        assert metrics.runner_calls() == {"deep_gemm": 2}
        metrics.record_balance(3, 0.5, moved=True)
        metrics.record_balance(3, 0.9, moved=False)
        metrics.record_balance(4, 0.8, moved=True)
        gauge = _FakeMetric.instances[metrics.BALANCEDNESS_NAME]
        assert gauge.values == {(("layer", "3"),): 0.9, (("layer", "4"),): 0.8}
        assert _FakeMetric.instances[metrics.REBALANCES_NAME].values == {(): 2}
        assert metrics.expert_balancedness() == {3: 0.9, 4: 0.8}
        assert metrics.eplb_rebalances() == 2
    finally:
        monkeypatch.delitem(sys.modules, "prometheus_client")
        importlib.reload(metrics)


def test_no_prometheus_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    try:
        importlib.reload(metrics)
        assert not metrics.prometheus_enabled()
        metrics.record_runner_call("torch")
        assert metrics.runner_calls() == {"torch": 1}
    finally:
        monkeypatch.delitem(sys.modules, "prometheus_client")
        importlib.reload(metrics)


@pytest.mark.skipif(importlib.util.find_spec("prometheus_client") is None,
                    reason="prometheus-client not installed")
def test_real_prometheus_counter():
    import prometheus_client

    importlib.reload(metrics)
    metrics.record_runner_call("cutlass")
    value = prometheus_client.REGISTRY.get_sample_value(
        metrics.PROMETHEUS_NAME + "_total", {"backend": "cutlass"}
    )
    assert value is not None and value >= 1
    metrics.record_balance(7, 0.75, moved=False)
    value = prometheus_client.REGISTRY.get_sample_value(metrics.BALANCEDNESS_NAME, {"layer": "7"})
    assert value == 0.75
