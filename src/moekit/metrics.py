"""What moekit reports about itself: calls per chosen runner backend, and each MoE layer's expert
balance under EPLB.

Always readable in process (`runner_calls()`, `expert_balancedness()`); also exported to
Prometheus when prometheus-client is installed:
  moekit_runner_calls_total{backend}    the MoE layer counts one call per expert computation it
                                        dispatches from Python (`RunnerCache.runner`); replays of a
                                        captured CUDA graph run no Python and are not counted
                                        (the capture is)
  moekit_expert_balancedness{layer}     mean over max of the EP ranks' loads, as of the last
                                        `moekit.eplb.ExpertBalancer` check (1.0: balanced)
  moekit_eplb_rebalances_total          layers whose experts an ExpertBalancer moved
"""

from __future__ import annotations

import threading
from collections import Counter

PROMETHEUS_NAME = "moekit_runner_calls"  # prometheus_client appends _total
BALANCEDNESS_NAME = "moekit_expert_balancedness"
REBALANCES_NAME = "moekit_eplb_rebalances"

_lock = threading.Lock()
_calls: Counter[str] = Counter()
_balancedness: dict[int, float] = {}
_rebalances = 0


def _make_prometheus(kind: str, name: str, doc: str, labels: tuple[str, ...] = ()):
    """A prometheus_client `kind` ('Counter' / 'Gauge') metric, or None without the library."""
    try:
        import prometheus_client
    except Exception:  # noqa: BLE001 - optional: any import failure means "not exported"
        return None
    try:
        return getattr(prometheus_client, kind)(name, doc, list(labels))
    except ValueError:  # already registered (module reloaded): reuse the registered one
        return prometheus_client.REGISTRY._names_to_collectors.get(name)


_prometheus = _make_prometheus(
    "Counter", PROMETHEUS_NAME, "MoE runner calls per chosen backend", ("backend",)
)
_prometheus_balance = _make_prometheus(
    "Gauge", BALANCEDNESS_NAME, "mean over max of the EP ranks' expert load per MoE layer",
    ("layer",),
)
_prometheus_rebalances = _make_prometheus(
    "Counter", REBALANCES_NAME, "MoE layers whose experts EPLB moved"
)


def prometheus_enabled() -> bool:
    """Whether the metrics are exported to Prometheus (prometheus-client importable)."""
    return _prometheus is not None


def record_runner_call(backend: str) -> None:
    """Count one call of runner `backend`."""
    with _lock:
        _calls[backend] += 1
    if _prometheus is not None:
        _prometheus.labels(backend=backend).inc()


def runner_calls() -> dict[str, int]:
    """Calls per backend since start (or the last `reset`), in process."""
    with _lock:
        return dict(_calls)


def record_balance(layer: int, balancedness: float, moved: bool) -> None:
    """Layer `layer`'s balancedness as the EPLB balancer found it, and whether it moved experts."""
    global _rebalances
    with _lock:
        _balancedness[layer] = balancedness
        _rebalances += moved
    if _prometheus_balance is not None:
        _prometheus_balance.labels(layer=str(layer)).set(balancedness)
    if moved and _prometheus_rebalances is not None:
        _prometheus_rebalances.inc()


def expert_balancedness() -> dict[int, float]:
    """Layer index -> balancedness at the last EPLB check, in process."""
    with _lock:
        return dict(_balancedness)


def eplb_rebalances() -> int:
    """Layers whose experts an EPLB balancer moved since start (or the last `reset`)."""
    with _lock:
        return _rebalances


def reset() -> None:
    """Zero the in-process values (the Prometheus metrics are left as they are)."""
    global _rebalances
    with _lock:
        _calls.clear()
        _balancedness.clear()
        _rebalances = 0
