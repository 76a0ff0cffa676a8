"""The one place that picks a runner backend, and says why.

Inputs are plain data (a `Workload`, the `RunnerConfig`, a `Platform`), so every rule is a pure
function that tests can drive with an injected platform.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moekit.config import RUNNER_BACKENDS, ConfigError, RunnerConfig
from moekit.hardware import Platform
from moekit.log import log_once
from moekit.runners import registry

# Backends `auto` may pick, best first, per device type. (Issue: a measured selection table.)
AUTO_PREFERENCE = {
    "cuda": ("triton", "torch"),
    "cpu": ("torch",),
}
ADAPTIVE_SMALL, ADAPTIVE_LARGE = "triton", "triton_kernel"


@dataclass(frozen=True)
class Workload:
    """What one runner call must do: T tokens, dispatch format, weight format, activation,
    dtype and device of the activations, and whether the experts have biases."""

    num_tokens: int
    format: str = "standard"
    weight_format: str = "unquantized"
    activation: str = "silu"
    dtype: str = "bfloat16"
    device: str = "cuda"
    has_bias: bool = False


@dataclass(frozen=True)
class Decision:
    backend: str
    reason: str


def why_not(backend: str, work: Workload, platform: Platform) -> str | None:
    """None if `backend` can run `work` on `platform`, else the reason it cannot."""
    avail = registry.availability(backend, platform)
    if not avail:
        return avail.reason
    cls = registry.runner_class(backend)
    return cls.unsupported(
        work.format, work.weight_format, work.activation, work.dtype, work.device, work.has_bias
    )


def select_runner(work: Workload, config: RunnerConfig, platform: Platform) -> Decision:
    """Pick the runner for `work`; raise ConfigError when the requested one cannot run it."""
    requested = config.moe_runner_backend
    if config.enable_adaptive_moe:
        small = work.num_tokens < config.adaptive_moe_batch_threshold
        backend = ADAPTIVE_SMALL if small else ADAPTIVE_LARGE
        reason = (
            f"--enable-adaptive-moe: T {'<' if small else '>='} "
            f"--adaptive-moe-batch-threshold {config.adaptive_moe_batch_threshold}"
        )
        return _checked(Decision(backend, reason), work, platform)
    if requested != "auto":
        return _checked(Decision(requested, "--moe-runner-backend " + requested), work, platform)
    skipped = []
    for backend in AUTO_PREFERENCE.get(work.device, ("torch",)):
        problem = why_not(backend, work, platform)
        if problem is None:
            reason = f"auto: first usable of {AUTO_PREFERENCE.get(work.device)} on {work.device}"
            if skipped:
                reason += " (skipped " + "; ".join(skipped) + ")"
            return _logged(Decision(backend, reason), work)
        skipped.append(f"{backend}: {problem}")
    raise ConfigError("--moe-runner-backend auto: no runner can run this; " + "; ".join(skipped))


def _checked(decision: Decision, work: Workload, platform: Platform) -> Decision:
    problem = why_not(decision.backend, work, platform)
    if problem is not None:
        raise ConfigError(f"--moe-runner-backend {decision.backend} cannot run here: {problem}")
    return _logged(decision, work)


def _logged(decision: Decision, work: Workload) -> Decision:
    log_once(logging.INFO, f"runner {decision.backend} ({work.format}): {decision.reason}")
    return decision


def explain(work: Workload, config: RunnerConfig, platform: Platform) -> list[tuple[str, str]]:
    """Every backend with 'chosen', 'usable' or the reason it cannot run `work`."""
    try:
        chosen = select_runner(work, config, platform).backend
    except ConfigError as err:
        chosen, rows = None, [("(none)", str(err))]
    else:
        rows = []
    for backend in RUNNER_BACKENDS:
        if backend == "auto":
            continue
        problem = why_not(backend, work, platform)
        status = "chosen" if backend == chosen else ("usable" if problem is None else problem)
        rows.append((backend, status))
    return rows
