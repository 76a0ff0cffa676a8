"""Typed data passed between the stages of a MoE layer: dispatch -> run -> combine.

Two formats:
  standard: tokens as rows; topk ids remapped to local expert slots (-1 = not on this rank).
            The runner applies the top-k weights and sums over K: out [T, H].
  masked:   fixed shapes x [E_local, capacity, H] + counts [E_local] (rows past a count are
            padding). The runner returns unweighted expert outputs [E_local, capacity, H]; combine
            applies the top-k weights. CUDA-graph safe: no shape depends on the routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch

from moekit.router import TopKOutput

STANDARD = "standard"
MASKED = "masked"
FORMATS = (STANDARD, MASKED)


@dataclass
class StandardDispatchOutput:
    """x [T, H]; topk with local ids; handle: the dispatcher's own metadata for combine.

    local_share: the expected share of a row's K pairs that are local under uniform routing
    (1.0: all; an EP rank that sees every token: about 1 / ep). A size hint for kernel
    configs, whose tables are keyed by tokens whose every pair is local (T * local_share);
    results never depend on it."""

    x: torch.Tensor
    topk: TopKOutput
    handle: Any = None
    local_share: float = 1.0
    format: ClassVar[str] = STANDARD


@dataclass
class MaskedDispatchOutput:
    """x [E_local, C, H]; counts [E_local] int32 valid rows per expert; handle for combine.

    expected_rows: the mean of counts under uniform routing, rounded up (the dispatcher knows it
    on the host; the counts are on the device), a size hint for kernels tuned to the rows they
    will see (deep_gemm's `expected_m`); None: not known (C stands in). An int, so that under
    torch.compile a batch size traced as a symbol stays one. Results never depend on it."""

    x: torch.Tensor
    counts: torch.Tensor
    handle: Any = None
    expected_rows: int | None = None
    format: ClassVar[str] = MASKED


@dataclass
class StandardRunnerOutput:
    """out [T, H]: sum over k of weight_k * expert_k(x) for this rank's experts."""

    out: torch.Tensor
    format: ClassVar[str] = STANDARD


@dataclass
class MaskedRunnerOutput:
    """out [E_local, C, H]: expert outputs, unweighted; rows past counts are undefined."""

    out: torch.Tensor
    format: ClassVar[str] = MASKED


DispatchOutput = Union[StandardDispatchOutput, MaskedDispatchOutput]
RunnerOutput = Union[StandardRunnerOutput, MaskedRunnerOutput]
