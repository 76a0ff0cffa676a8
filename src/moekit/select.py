"""The one place that picks a runner backend, and says why.

Inputs are plain data (a `Workload`, the `RunnerConfig`, a `Platform`, optionally the selection
tables), so every rule is a pure function that tests drive with injected platforms and tables.

How a backend is chosen (`select_runner`):
  1. `--enable-adaptive-moe`: `triton` below `--adaptive-moe-batch-threshold` tokens,
     `triton_kernel` at or above (the engines' familiar rule), checked like a requested backend.
  2. `--moe-runner-backend NAME`: that backend, or a ConfigError saying why it cannot run here
     (library missing, needs SM100, format not supported, ...).
  3. `auto`: the backends that can run the workload here (hardware, libraries, weight format,
     dispatch format, dtype, shape) are ranked by the measured selection table of this device and
     shape (`moekit.select_table`; nearest measured batch size, if within a factor
     POINT_REACH); for a shape without a table (or past its table's span), by the nearest
     measured shape's point (same format, weight spec and dtype; this device or its
     compute capability); without any, by the default preference order, which switches at
     the adaptive threshold like rule 1 (and puts deep_gemm first in the masked format, and for
     fp8 block-scaled weights at or above the threshold).

Each new decision is logged once. Decisions are cached per `Workload` by the layer
(`moekit.layer.RunnerCache`); the workload includes the batch size, so under CUDA graphs each
captured batch size gets its own decision, made when it is first run (at capture).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from moekit.config import RUNNER_BACKENDS, ConfigError, MoEConfig, ParallelConfig, RunnerConfig
from moekit.hardware import Platform
from moekit.log import log_once
from moekit.runners import registry

if TYPE_CHECKING:
    from moekit.quant.spec import QuantSpec
    from moekit.select_table import SelectionTable

# Default preference of `auto` when no selection table matches, best first: below the adaptive
# threshold (small batches) and at or above it (large batches). CPU: the reference only.
AUTO_PREFERENCE = {
    "cuda": (
        "triton",
        "w4a16",
        "triton_kernel",
        "cutlass",
        "deep_gemm",
        "flashinfer_cutlass",
        "torch",
    ),
    "cpu": ("torch",),
}
# Measured on an H100 (commit da3797f, BENCHMARKS.md): at T=4096 `triton` beat `triton_kernel`
# (qwen3-30b-a3b 0.84 vs 0.95 ms, gpt-oss-120b 2.98 vs 4.16 ms), so it leads here too until a
# selection table measured on the GPU says otherwise.
AUTO_PREFERENCE_LARGE = {
    "cuda": (
        "triton",
        "triton_kernel",
        "deep_gemm",
        "cutlass",
        "flashinfer_cutlass",
        "w4a16",
        "torch",
    ),
    "cpu": ("torch",),
}
ADAPTIVE_SMALL, ADAPTIVE_LARGE = "triton", "triton_kernel"
# Where deep_gemm leads without a table (when it can run the workload):
# - fp8 weights with 128x128 block scales, standard format, at or above the adaptive threshold:
#   DeepGEMM's kernels overlap the per-block scaling with the next MMA, which the Triton runners
#   cannot (benchmarks/triton_notes.md); measured on qwen3-30b-a3b and deepseek-v3 EP8
#   (BENCHMARKS.md): 1.4-2.2x faster than fp8 `triton` at T >= 4096 on the H100 and H200,
#   level at T = 1024, slower below;
# - the masked format (low-latency dispatch), bf16 or fp8 block-wise: deepseek-v3 EP8's local
#   shape at 1-64 rows per expert (scripts/gpu_probe_masked.py, results/
#   20261122T0610Z_H100_masked_probe.json, ..._T0630Z_H200_masked_probe.json): fp8 4-25%
#   (H100) and 18-34% (H200) faster than `triton`; bf16 within 1.5% to 8% faster (H100) and
#   10-21% faster (H200). Since `triton` takes its tuned tables in the masked format (session
#   71, H100, results/ab/s71/20261207T1306Z_H100_masked_configs_runner_choice.json), deep_gemm
#   with expected_m the mean takes, of `triton`'s time: fp8 0.89-0.99x at 1-64 rows per expert
#   and 0.58x at 256; bf16 0.98-1.01x at C = 64 / 128, 0.87x at 256 rows, but 1.02-1.03x at
#   C = 1024 with 4 / 16 rows.
DEEP_GEMM_FIRST = "deep_gemm"
# Where w4a16 leads without a table: 4-bit weights (int4_w4a16, mxfp4, nvfp4) at T <= 16
# tokens, where it was faster than the 4-bit `triton` at 32 of 33 points of the four presets on
# the H100 (1.22-2.30x; qwen3-30b-a3b int4 at T = 16 0.94x; benchmarks/w4a16_notes.md, session
# 26). Its own limit (128 pairs) still applies.
W4A16_FIRST = "w4a16"
W4A16_FIRST_FORMATS = ("int4_w4a16", "mxfp4", "nvfp4")
W4A16_FIRST_MAX_TOKENS = 16


@dataclass(frozen=True)
class Workload:
    """What one runner call must do.

    num_tokens T (masked format: E_local * capacity rows), dispatch format, weight format (and its
    QuantSpec when quantized), activation, dtype and device of the activations, whether the
    experts have biases; the per-rank shape when known (E_local, H, I_local, K columns of the
    routing; the parallel config enters through them: E_local = E / ep, I_local = I / moe_tp).
    The shape fields are optional: without them the selection table cannot be consulted and the
    shape rules of the runners are not checked. local_share: the expected share of a row's K
    pairs that are this rank's (`StandardDispatchOutput.local_share`; 1 / ep on an EP rank that
    sees every token), which places a shape without a table of its own among the measured ones.
    """

    num_tokens: int
    format: str = "standard"
    weight_format: str = "unquantized"
    activation: str = "silu"
    dtype: str = "bfloat16"
    device: str = "cuda"
    has_bias: bool = False
    num_experts: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    top_k: int | None = None
    weight_spec: "QuantSpec | None" = None
    local_share: float = 1.0

    @property
    def has_shape(self) -> bool:
        return None not in (self.num_experts, self.hidden_size, self.intermediate_size, self.top_k)


def workload_for(
    moe: MoEConfig,
    num_tokens: int,
    *,
    parallel: ParallelConfig = ParallelConfig(),
    device: str = "cuda",
    format: str = "standard",
    weight_spec: "QuantSpec | None" = None,
) -> Workload:
    """The workload of one rank of a layer of `moe` under `parallel` on `num_tokens` tokens."""
    return Workload(
        num_tokens=num_tokens,
        format=format,
        weight_format=moe.weight_format,
        activation=moe.activation,
        dtype=moe.dtype,
        device=device,
        has_bias=moe.has_bias,
        num_experts=(moe.total_experts + parallel.ep_num_redundant_experts) // parallel.ep_size,
        hidden_size=moe.hidden_size,
        intermediate_size=moe.intermediate_size // parallel.moe_tp_size,
        top_k=moe.total_top_k,
        weight_spec=weight_spec,
        local_share=1.0 / parallel.ep_size,
    )


@dataclass(frozen=True)
class Decision:
    backend: str
    reason: str


def why_not(backend: str, work: Workload, platform: Platform) -> str | None:
    """None if `backend` can run `work` on `platform`, else the reason it cannot.

    Checks the runner's availability here (hardware, libraries), its declared capabilities
    (formats, weight formats, activations, dtypes, devices, biases) and, for runners that define
    `workload_problem(work, platform)`, workload rules (shape alignment, quantization
    parameters, parallelism, and what of them needs more of the platform)."""
    avail = registry.availability(backend, platform)
    if not avail:
        return avail.reason
    cls = registry.runner_class(backend)
    problem = cls.unsupported(
        work.format, work.weight_format, work.activation, work.dtype, work.device, work.has_bias
    )
    if problem is None and hasattr(cls, "workload_problem"):
        problem = cls.workload_problem(work, platform)
    return problem


def _preference(work: Workload, config: RunnerConfig) -> tuple[tuple[str, ...], str]:
    large = work.num_tokens >= config.adaptive_moe_batch_threshold
    table = AUTO_PREFERENCE_LARGE if large else AUTO_PREFERENCE
    order = table.get(work.device, ("torch",))
    why = (
        f"T {'>=' if large else '<'} {config.adaptive_moe_batch_threshold} "
        f"(--adaptive-moe-batch-threshold)"
    )
    if DEEP_GEMM_FIRST in order:
        if work.format == "masked":
            lead = "masked format"
        elif large and _fp8_block(work):
            lead = "fp8 weights with block scales"
        else:
            lead = None
        if lead:
            order = (DEEP_GEMM_FIRST, *(b for b in order if b != DEEP_GEMM_FIRST))
            why += f", {lead}: {DEEP_GEMM_FIRST} first"
    if (W4A16_FIRST in order and work.weight_format in W4A16_FIRST_FORMATS
            and work.format == "standard" and work.num_tokens <= W4A16_FIRST_MAX_TOKENS):
        order = (W4A16_FIRST, *(b for b in order if b != W4A16_FIRST))
        why += f", 4-bit weights at T <= {W4A16_FIRST_MAX_TOKENS}: {W4A16_FIRST} first"
    return order, why


def _fp8_block(work: Workload) -> bool:
    spec = work.weight_spec
    return (
        work.weight_format == "fp8_w8a8"
        and spec is not None
        and getattr(spec, "weight_scale", None) == "block"
    )


def select_runner(
    work: Workload,
    config: RunnerConfig,
    platform: Platform,
    *,
    tables: "Sequence[SelectionTable] | None" = None,
) -> Decision:
    """Pick the runner for `work`; raise ConfigError when the requested one cannot run it.
    `tables`: the selection tables to consult (default: shipped + user dir, see select_table)."""
    requested = config.moe_runner_backend
    if config.enable_adaptive_moe:
        small = work.num_tokens < config.adaptive_moe_batch_threshold
        backend = ADAPTIVE_SMALL if small else ADAPTIVE_LARGE
        reason = (
            f"--enable-adaptive-moe: T={work.num_tokens} {'<' if small else '>='} "
            f"--adaptive-moe-batch-threshold {config.adaptive_moe_batch_threshold}"
        )
        return _checked(Decision(backend, reason), work, platform)
    if requested != "auto":
        return _checked(Decision(requested, "--moe-runner-backend " + requested), work, platform)
    return _logged(_auto(work, config, platform, tables), work)


def _auto(work, config, platform, tables) -> Decision:
    from moekit import select_table

    problems = {
        b: why_not(b, work, platform) for b in RUNNER_BACKENDS if b != "auto"
    }
    usable = [b for b, p in problems.items() if p is None]
    if not usable:
        raise ConfigError(
            "--moe-runner-backend auto: no runner can run this; "
            + "; ".join(f"{b}: {p}" for b, p in problems.items())
        )
    if tables is None:
        tables = select_table.default_tables()
    match = select_table.lookup(tables, work, platform, usable)
    if match.table is not None:
        point = match.point
        ranked = point.ranked(usable)
        if ranked:
            backend = ranked[0]
            ms = point.ms[backend]
            skew = point.skew_note(backend, usable)
            what = "ranked first of the usable" if skew else "the fastest usable"
            if match.transferred:
                reason = (f"auto: {match.note}; from {match.table.source}: there {backend} is "
                          f"{what} ({ms:.4g} ms")
            else:
                reason = (
                    f"auto: selection table {match.table.source} ({match.note}): at the "
                    f"nearest measured T={point.num_tokens}, {backend} is {what} ({ms:.4g} ms"
                )
            if skew:
                reason += f"; {skew}"
            faster = [b for b in point.ms if b not in usable and point.ms[b] < ms]
            if faster:
                best = min(faster, key=lambda b: (point.ms[b], b))
                reason += f"; {best} {point.ms[best]:.4g} ms is not usable: {problems[best]}"
            return Decision(backend, reason + ")")
        where = (match.note if match.transferred else
                 f"selection table {match.table.source} at T={point.num_tokens}")  # fmt: skip
        unmeasured = f"{where}: none of the measured {', '.join(point.ranking)} is usable here"
    else:
        unmeasured = match.note
    order, why = _preference(work, config)
    for backend in order:
        if backend in usable:
            skipped = [f"{b}: {problems[b]}" for b in order[: order.index(backend)]]
            reason = (
                f"auto: {unmeasured}; default preference for {work.device}, "
                f"{why}: {' > '.join(order)}"
            )
            if skipped:
                reason += " (skipped " + "; ".join(skipped) + ")"
            return Decision(backend, reason)
    raise ConfigError(
        f"--moe-runner-backend auto: usable here are only {', '.join(usable)}, none of which is "
        f"in the preference order for {work.device} ({', '.join(order)})"
    )


def _checked(decision: Decision, work: Workload, platform: Platform) -> Decision:
    problem = why_not(decision.backend, work, platform)
    if problem is not None:
        raise ConfigError(f"--moe-runner-backend {decision.backend} cannot run here: {problem}")
    return _logged(decision, work)


def _logged(decision: Decision, work: Workload) -> Decision:
    log_once(
        logging.INFO,
        f"runner {decision.backend} for T={work.num_tokens} ({work.format}, {work.weight_format}, "
        f"{work.dtype}, {work.device}): {decision.reason}",
    )
    return decision


def explain(
    work: Workload,
    config: RunnerConfig,
    platform: Platform,
    *,
    tables: "Sequence[SelectionTable] | None" = None,
) -> list[tuple[str, str]]:
    """Every backend with 'chosen', 'usable' or the reason it cannot run `work`; a first row
    ('(none)', error) when nothing can be chosen."""
    try:
        chosen = select_runner(work, config, platform, tables=tables).backend
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
