"""The runner stage as torch custom ops, for torch.compile.

Under `torch.compile` the layer's route / dispatch / combine are traced as ordinary tensor code,
and running the experts becomes one opaque op (`moekit::experts` for the standard format,
`moekit::experts_masked` for the masked one): the graph has no break at the experts
(`fullgraph=True` works), and `mode="reduce-overhead"` captures the whole compiled region,
experts included, in CUDA graphs, which removes the eager host time of the runners' launches.
The op runs `moekit.layer.run_experts` itself, so `auto` decides per batch size as in eager
mode (once per shape; under CUDA graphs, when the graph for that size is recorded).

What is not a tensor (the layer's RunnerConfig, the weight format and its spec, the
activation's name and layout) travels as an int naming an interned context of their values;
the activation's floats (alpha, limit) travel as float arguments (under
`torch.compile(dynamic=True)` dynamo traces floats as symbols, which a context cannot hold and
an op's float argument specialises), the tensors of `ExpertWeights` as a list, and a masked
dispatch's `expected_rows` as an int (a symbol where the batch size is one). Decisions of
compiled calls are cached per RunnerConfig (not in the layer's own `runners`), so every layer
alike shares one compiled graph. Calls replayed from CUDA graphs run no Python, so
`moekit.metrics` counts only the recorded ones.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import TYPE_CHECKING, Optional

import torch

from moekit.config import RunnerConfig
from moekit.experts import QUANT_TENSORS, ActivationSpec, ExpertWeights
from moekit.quant.spec import make_spec
from moekit.router import TopKOutput
from moekit.stages import (
    DispatchOutput,
    MaskedDispatchOutput,
    MaskedRunnerOutput,
    RunnerOutput,
    StandardDispatchOutput,
    StandardRunnerOutput,
)

if TYPE_CHECKING:
    from moekit.layer import RunnerCache

WEIGHT_TENSORS = ("w13", "w2", "b13", "b2", *QUANT_TENSORS)  # the op's tensor list, in order

# (RunnerConfig, weight format, spec, activation) by the int the ops carry, and a RunnerCache
# per RunnerConfig: the key holds values only, so layers alike share one compiled graph.
_CONTEXTS: list[tuple] = []
_CONTEXT_IDS: dict[tuple, int] = {}
_RUNNERS: dict[RunnerConfig, "RunnerCache"] = {}
_RESOLVED: list[tuple] = []  # (RunnerCache, format, QuantSpec | None, (name, interleaved))


@torch.compiler.assume_constant_result
def _context(runner: tuple, fmt: str, spec: tuple, act: tuple) -> int:
    """The interned context of (RunnerConfig fields, format, spec fields, the activation's name
    and interleaved flag); under dynamo evaluated while tracing, so the int is a constant of the
    graph and registered before the graph first runs."""
    key = (runner, fmt, spec, act)
    ctx = _CONTEXT_IDS.get(key)
    if ctx is None:
        ctx = _CONTEXT_IDS[key] = len(_CONTEXTS)
        _CONTEXTS.append(key)
    return ctx


def _resolve(tensors: list[Optional[torch.Tensor]], ctx: int, alpha: float, limit: float):
    """(RunnerCache, ExpertWeights, ActivationSpec) of a call of context `ctx`."""
    runners, fmt, spec, act = _RESOLVED[ctx] if ctx < len(_RESOLVED) else _resolve_context(ctx)
    weights = ExpertWeights(**dict(zip(WEIGHT_TENSORS, tensors)), format=fmt, spec=spec)
    return runners, weights, _activation(*act, alpha, limit)


@functools.lru_cache(maxsize=64)
def _activation(name: str, interleaved: bool, alpha: float, limit: float) -> ActivationSpec:
    return ActivationSpec(name, interleaved, alpha, limit)


def _resolve_context(ctx: int) -> tuple:
    """The objects of contexts up to `ctx`, made once (a RunnerCache per RunnerConfig)."""
    from moekit.layer import RunnerCache

    while len(_RESOLVED) <= ctx:
        runner, fmt, spec, act = _CONTEXTS[len(_RESOLVED)]
        config = RunnerConfig(*runner)
        if config not in _RUNNERS:
            _RUNNERS[config] = RunnerCache(config)
        spec = make_spec(fmt, **dict(spec)) if fmt != "unquantized" else None
        _RESOLVED.append((_RUNNERS[config], fmt, spec, act))
    return _RESOLVED[ctx]


@torch.library.custom_op("moekit::experts", mutates_args=())
def experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tensors: list[Optional[torch.Tensor]],
    ctx: int,
    alpha: float,
    limit: float,
    local_share: float,
) -> torch.Tensor:
    """Standard format: x [T, H], topk_weights [T, K] float32, topk_ids [T, K] int32 (local
    ids, -1 = skip) -> [T, H], weighted and summed over K."""
    from moekit.layer import run_experts

    runners, weights, act = _resolve(tensors, ctx, alpha, limit)
    d = StandardDispatchOutput(x, TopKOutput(topk_weights, topk_ids), local_share=local_share)
    return run_experts(d, weights, act, runners).out


@experts.register_fake
def _experts_fake(x, topk_weights, topk_ids, tensors, ctx, alpha, limit, local_share):
    return x.new_empty(x.shape)


@torch.library.custom_op("moekit::experts_masked", mutates_args=())
def experts_masked(
    x: torch.Tensor,
    counts: torch.Tensor,
    tensors: list[Optional[torch.Tensor]],
    ctx: int,
    alpha: float,
    limit: float,
    expected_rows: Optional[int],
) -> torch.Tensor:
    """Masked format: x [E, C, H], counts [E] int32 -> [E, C, H] unweighted (rows at or past
    an expert's count undefined)."""
    from moekit.layer import run_experts

    runners, weights, act = _resolve(tensors, ctx, alpha, limit)
    d = MaskedDispatchOutput(x, counts, expected_rows=expected_rows)
    return run_experts(d, weights, act, runners).out


@experts_masked.register_fake
def _experts_masked_fake(x, counts, tensors, ctx, alpha, limit, expected_rows):
    return x.new_empty(x.shape)


def run_experts_op(
    d: DispatchOutput, weights: ExpertWeights, act: ActivationSpec, runners: "RunnerCache"
) -> RunnerOutput:
    """`moekit.layer.run_experts` through the custom ops (what a traced layer calls)."""
    tensors = [getattr(weights, name) for name in WEIGHT_TENSORS]
    cfg, spec = runners.config, weights.spec
    ctx = _context(
        (cfg.moe_runner_backend, cfg.enable_adaptive_moe, cfg.adaptive_moe_batch_threshold),
        weights.format,
        () if spec is None else tuple((f.name, getattr(spec, f.name)) for f in fields(spec)),
        (act.name, act.interleaved),
    )
    if isinstance(d, MaskedDispatchOutput):
        out = experts_masked(d.x, d.counts, tensors, ctx, act.alpha, act.limit, d.expected_rows)
        return MaskedRunnerOutput(out)
    topk = d.topk
    return StandardRunnerOutput(experts(d.x, topk.weights, topk.ids, tensors, ctx, act.alpha,
                                        act.limit, float(d.local_share)))  # fmt: skip
