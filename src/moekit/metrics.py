"""Counters of the runner backends actually used: calls per chosen backend.

Always readable in process (`runner_calls()`); also exported as the Prometheus counter
`moekit_runner_calls_total{backend=...}` when prometheus-client is installed. The MoE layer counts
one call per expert computation it dispatches from Python (`RunnerCache.runner`); replays of a
captured CUDA graph run no Python and are not counted (the capture is).
"""

from __future__ import annotations

import threading
from collections import Counter

PROMETHEUS_NAME = "moekit_runner_calls"  # prometheus_client appends _total

_lock = threading.Lock()
_calls: Counter[str] = Counter()


def _make_prometheus_counter():
    try:
        import prometheus_client
    except Exception:  # noqa: BLE001 - optional: any import failure means "not exported"
        return None
    try:
        return prometheus_client.Counter(
            PROMETHEUS_NAME, "MoE runner calls per chosen backend", ["backend"]
        )
    except ValueError:  # already registered (module reloaded): reuse the registered one
        collector = prometheus_client.REGISTRY._names_to_collectors.get(PROMETHEUS_NAME)
        return collector


_prometheus = _make_prometheus_counter()


def prometheus_enabled() -> bool:
    """Whether the counter is exported to Prometheus (prometheus-client importable)."""
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


def reset() -> None:
    """Zero the in-process counts (the Prometheus counter is monotonic and is not reset)."""
    with _lock:
        _calls.clear()
