"""Dispatcher `none`: tokens stay where they are (replicated over the TP group).

Each rank maps logical ids to its local expert slots (-1 where the expert lives elsewhere),
runs its share, and combine all-reduces the partial outputs over the group (if any).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.dispatch.base import Dispatcher
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.stages import StandardDispatchOutput, StandardRunnerOutput


class NoneDispatcher(Dispatcher):
    """placement + ep_rank: which experts are local; group: the ranks whose partial outputs
    are summed (None: a single rank, no communication)."""

    name = "none"

    def __init__(
        self,
        placement: ExpertPlacement,
        ep_rank: int = 0,
        num_logical_experts: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        num_logical = num_logical_experts or placement.num_slots
        self._table = placement.logical_to_local(ep_rank, num_logical)
        self._identity = placement.ep_size == 1 and torch.equal(
            placement.physical_to_logical, torch.arange(num_logical)
        )
        self.group = group

    def _table_on(self, device: torch.device) -> torch.Tensor:
        if self._table.device != device:
            self._table = self._table.to(device)
        return self._table

    def dispatch(self, x_TH: torch.Tensor, topk: TopKOutput) -> StandardDispatchOutput:
        if self._identity:
            return StandardDispatchOutput(x_TH, topk)
        local_ids = self._table_on(topk.ids.device)[topk.ids.long()]
        return StandardDispatchOutput(x_TH, TopKOutput(topk.weights, local_ids))

    def combine(self, runner_out: StandardRunnerOutput, dispatched) -> torch.Tensor:
        out = runner_out.out
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(out, group=self.group)
        return out
