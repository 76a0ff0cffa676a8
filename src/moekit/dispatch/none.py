"""Dispatcher `none`: tokens stay where they are (replicated over the TP group).

Each rank maps logical ids to its local expert slots (-1 where the expert lives elsewhere),
runs its share, and combine all-reduces the partial outputs over the group (if any): the TP
group, which sums over the EP ranks' experts and, in the hybrid EP x TP layout, over the moe-TP
ranks' slices of I. A logical expert with copies on several ranks (redundant experts) has its
pairs split over the copies by token: token t goes to copy t mod copies
(`moekit.dispatch.slots.SlotMap`), the same choice on every rank since every rank holds the
same tokens. So the sum counts each pair once, and the copies share a hot expert's work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.dispatch.base import Dispatcher
from moekit.dispatch.slots import SlotMap
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
        self.ep_rank = ep_rank
        self.group = group
        self.slots = SlotMap(placement, num_logical_experts)
        self._identity = self._is_identity(placement)
        self._share = self.slots.local_share(ep_rank)

    def _is_identity(self, placement: ExpertPlacement) -> bool:
        """One rank whose slot i holds expert i: the ids need no mapping."""
        return placement.ep_size == 1 and torch.equal(
            placement.physical_to_logical.cpu(), torch.arange(self.slots.num_logical)
        )

    def update_placement(self, placement: ExpertPlacement, num_logical: int | None = None) -> bool:
        """The slot map is rewritten in place; False where the ids' mapping turns on or off
        (one rank, slot i = expert i), which graphs captured before do not follow."""
        self.slots.update_(placement, num_logical)
        identity = self._is_identity(placement)
        in_place, self._identity = identity == self._identity, identity
        self._share = self.slots.local_share(self.ep_rank)
        return in_place

    def dispatch(self, x_TH: torch.Tensor, topk: TopKOutput) -> StandardDispatchOutput:
        if self._identity:
            return StandardDispatchOutput(x_TH, topk)
        local_ids = self.slots.local_ids(topk.ids, self.ep_rank)
        return StandardDispatchOutput(x_TH, TopKOutput(topk.weights, local_ids),
                                      local_share=self._share)

    def combine(self, runner_out: StandardRunnerOutput, dispatched) -> torch.Tensor:
        out = runner_out.out
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(out, group=self.group)
        return out
