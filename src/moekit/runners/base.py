"""The runner protocol: what a runner backend declares and the one call it implements."""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

import torch

from moekit.config import INT_DTYPES
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform
from moekit.stages import (
    DispatchOutput,
    MaskedDispatchOutput,
    MaskedRunnerOutput,
    RunnerOutput,
    StandardRunnerOutput,
)


class RunnerError(ValueError):
    """A runner was asked for something it does not support; the message says what it does."""


@dataclass(frozen=True)
class RunnerCaps:
    """What a runner supports. devices: 'cpu' / 'cuda'; cuda_graph: safe to capture."""

    formats: frozenset[str]
    weight_formats: frozenset[str]
    activations: frozenset[str]
    devices: frozenset[str]
    dtypes: frozenset[str] = frozenset({"bfloat16", "float16", "float32"})
    bias: bool = True
    cuda_graph: bool = False


def input_problem(dispatch_out: DispatchOutput, weights: ExpertWeights) -> str | None:
    """None if the dispatched inputs fit the weights, else what does not: x [T, H] with top-k
    ids (integers) and weights (float32) both [T, K], or x [E, C, H] with counts [E]
    (integers); E and H the weights'; unquantized weights in x's dtype. Shapes and dtypes only
    (no device sync)."""
    x = dispatch_out.x
    H = weights.hidden_size
    if isinstance(dispatch_out, MaskedDispatchOutput):
        E, counts = weights.num_experts, dispatch_out.counts
        if x.dim() != 3 or x.shape[0] != E or x.shape[2] != H:
            return f"masked x must be [E, C, H] with E = {E}, H = {H}, got {list(x.shape)}"
        if not isinstance(counts, torch.Tensor) or counts.shape != (E,) or (
            counts.dtype not in INT_DTYPES
        ):
            got = f"{_name(counts)} {list(counts.shape)}" if isinstance(
                counts, torch.Tensor) else type(counts).__name__  # fmt: skip
            return f"masked counts must be an integer tensor [E] = [{E}], got {got}"
    else:
        if x.dim() != 2 or x.shape[1] != H:
            return f"x must be [T, H] with H = {H} (the experts' hidden size), got {list(x.shape)}"
        ids, w = dispatch_out.topk.ids, dispatch_out.topk.weights
        if ids.dim() != 2 or ids.shape[0] != x.shape[0] or w.shape != ids.shape:
            return (
                f"topk_ids and topk_weights must both be [T, K] with T = {x.shape[0]} (x's "
                f"rows), got {list(ids.shape)} and {list(w.shape)}"
            )
        if ids.dtype not in INT_DTYPES:
            return f"topk_ids must be an integer tensor (expert ids, -1 = none), got {_name(ids)}"
        if w.dtype != torch.float32:
            return f"topk_weights must be float32 (the router's), got {_name(w)}"
    if weights.format == "unquantized" and weights.w13.dtype != x.dtype:
        return (
            f"x is {_name(x)} but the expert weights are {_name(weights.w13)}: pass x in the "
            "weights' dtype"
        )
    return None


def _name(t: torch.Tensor) -> str:
    """t's dtype as the options spell it ('bfloat16')."""
    return str(t.dtype).removeprefix("torch.")


class Runner(ABC):
    """A runner backend: runs the expert FFNs on dispatched tokens."""

    name: ClassVar[str]
    caps: ClassVar[RunnerCaps]

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        """Whether this runner can run on `platform`, and if not, why."""
        return Availability(True)

    @classmethod
    def unsupported(
        cls, fmt: str, weight_format: str, activation: str, dtype: str, device: str, bias: bool
    ) -> str | None:
        """None if supported, else a sentence naming what is not supported and what is."""
        caps = cls.caps
        checks = (
            ("dispatch format", fmt, caps.formats),
            ("weight format", weight_format, caps.weight_formats),
            ("activation", activation, caps.activations),
            ("dtype", dtype, caps.dtypes),
            ("device", device, caps.devices),
        )
        for what, value, allowed in checks:
            if value not in allowed:
                return (
                    f"runner {cls.name!r} does not support {what} {value!r}; "
                    f"it supports: {', '.join(sorted(allowed))}"
                )
        if bias and not caps.bias:
            return f"runner {cls.name!r} does not support expert biases"
        return None

    def check(self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec):
        """Raise RunnerError if these inputs are outside this runner's capabilities (that they
        are well formed, `input_problem`, `moekit.layer.run_experts` checked first)."""
        x = dispatch_out.x
        problem = self.unsupported(
            dispatch_out.format,
            weights.format,
            act.name,
            _name(x),
            x.device.type,
            weights.has_bias,
        )
        if problem:
            raise RunnerError(problem)

    def empty_masked(self, x_ECH: torch.Tensor, weights: ExpertWeights) -> torch.Tensor | None:
        """For run_masked: RunnerError unless x [E, C, H] has the weights' E; the (empty)
        [E, C, H] output when E * C == 0, else None."""
        E, C, H = x_ECH.shape
        if E != weights.num_experts:
            raise RunnerError(f"runner {self.name!r}: masked x has {E} experts, weights "
                              f"{weights.num_experts}")
        if E * C == 0:
            return torch.empty(E, C, H, dtype=x_ECH.dtype, device=x_ECH.device)
        return None

    def refresh(self, weights: ExpertWeights, act: ActivationSpec) -> None:  # noqa: B027 (a hook)
        """`weights`' tensors were written in place (an EPLB move): rewrite any copy derived from
        them that this runner keeps (a permuted or padded layout) in place too, so CUDA graphs
        captured with it read the new values. Runners that read the weights themselves keep
        none."""

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        """Standard format -> StandardRunnerOutput [T, H] (weighted, summed over K);
        masked format -> MaskedRunnerOutput [E, C, H] (unweighted).

        By default: check, then `run_standard(x, topk, weights, act, local_share)` or
        `run_masked(x, counts, weights, act, expected_rows)`, which a runner defines for the
        formats it declares; a runner with more to do around them overrides `run` itself.
        local_share (the dispatcher's expected share of local pairs) and expected_rows (its
        expected rows per expert, rounded up, or None) may size launches; results do not
        depend on them."""
        self.check(dispatch_out, weights, act)
        if isinstance(dispatch_out, MaskedDispatchOutput):
            out = self.run_masked(dispatch_out.x, dispatch_out.counts, weights, act,
                                  dispatch_out.expected_rows)  # fmt: skip
            return MaskedRunnerOutput(out)
        return StandardRunnerOutput(self.run_standard(
            dispatch_out.x, dispatch_out.topk, weights, act, dispatch_out.local_share))  # fmt: skip
