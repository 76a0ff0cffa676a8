"""The dispatcher protocol: dispatch(x, topk) -> DispatchOutput; combine(runner_out, that) -> out.

A dispatcher moves tokens to the ranks that hold their experts and back. Its metadata for the
return trip travels in `DispatchOutput.handle`, so one dispatcher object serves any number of
calls in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from moekit.config import ParallelConfig
from moekit.hardware import Availability, Platform
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.stages import DispatchOutput, RunnerOutput


class Dispatcher(ABC):
    """An all-to-all backend (`--moe-a2a-backend`)."""

    name: ClassVar[str]

    @classmethod
    def availability(cls, platform: Platform, parallel: ParallelConfig) -> Availability:
        """Whether this backend can run here, and if not, why."""
        return Availability(True)

    @abstractmethod
    def dispatch(self, x_TH: torch.Tensor, topk: TopKOutput) -> DispatchOutput:
        """x_TH [T, H], topk with logical expert ids -> tokens for this rank's experts."""

    @abstractmethod
    def combine(self, runner_out: RunnerOutput, dispatched: DispatchOutput) -> torch.Tensor:
        """Runner results -> out [T, H] for this rank's original tokens."""

    def update_placement(self, placement: ExpertPlacement, num_logical: int | None = None) -> bool:
        """Take a new placement (EPLB: `moekit.eplb.rebalance_`), with the same ep_size and
        slots per rank. True when done in place (CUDA graphs captured with this dispatcher read
        the new placement), False when its forward changed path (capture them again)."""
        raise NotImplementedError(f"the {self.name!r} dispatcher cannot change its placement")
