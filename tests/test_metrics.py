"""Runner call counters (`moekit.metrics`): in process always, Prometheus when installed."""

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


class _FakeCounter:
    """Stands in for prometheus_client.Counter: records label values and increments."""

    instances: list = []

    def __init__(self, name, doc, labelnames):
        self.name, self.doc, self.labelnames = name, doc, list(labelnames)
        self.values: dict = {}
        _FakeCounter.instances.append(self)

    def labels(self, **kw):
        counter, key = self, tuple(sorted(kw.items()))

        class _Child:
            def inc(self, amount=1):
                counter.values[key] = counter.values.get(key, 0) + amount

        return _Child()


def test_prometheus_counter_when_installed(monkeypatch):
    fake = types.ModuleType("prometheus_client")
    fake.Counter = _FakeCounter
    monkeypatch.setitem(sys.modules, "prometheus_client", fake)
    try:
        importlib.reload(metrics)
        assert metrics.prometheus_enabled()
        metrics.record_runner_call("deep_gemm")
        metrics.record_runner_call("deep_gemm")
        counter = _FakeCounter.instances[-1]
        assert counter.name == metrics.PROMETHEUS_NAME and counter.labelnames == ["backend"]
        assert counter.values == {(("backend", "deep_gemm"),): 2}
        assert metrics.runner_calls() == {"deep_gemm": 2}
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
