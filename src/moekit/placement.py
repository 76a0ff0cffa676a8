"""Expert placement: which logical expert each physical slot holds, and which slots a rank owns.

Physical slots P = logical experts + redundant copies; rank r owns slots
[r * P / ep, (r + 1) * P / ep). The default placement is the identity (slot i = expert i).
EPLB replaces `physical_to_logical` with a balanced map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """physical_to_logical [P] int64: the logical expert in each physical slot."""

    physical_to_logical: torch.Tensor
    ep_size: int = 1

    def __post_init__(self) -> None:
        if self.num_slots % self.ep_size:
            raise ValueError(
                f"physical expert slots ({self.num_slots}) must be divisible by ep_size "
                f"({self.ep_size})"
            )

    @classmethod
    def contiguous(
        cls, num_experts: int, ep_size: int = 1, num_slots: int | None = None
    ) -> "ExpertPlacement":
        """Slot i holds expert i mod num_experts (num_slots defaults to num_experts; redundant
        slots past it repeat the experts from 0): a layer's placement before any balancing."""
        slots = num_experts if num_slots is None else num_slots
        return cls(torch.arange(slots) % num_experts, ep_size)

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep_size

    def local_slots(self, ep_rank: int) -> range:
        """Physical slots owned by `ep_rank`."""
        n = self.slots_per_rank
        return range(ep_rank * n, (ep_rank + 1) * n)

    def local_experts(self, ep_rank: int) -> torch.Tensor:
        """Logical expert id of each local slot of `ep_rank` [slots_per_rank]."""
        s = self.local_slots(ep_rank)
        return self.physical_to_logical[s.start : s.stop]

    def logical_to_local(self, ep_rank: int, num_logical: int) -> torch.Tensor:
        """[num_logical + 1] int32 map from logical id to local slot, -1 where not on this rank.

        Index it with the routing ids directly: id -1 wraps to the last entry, which is -1.
        Where a logical expert has several local copies, the first one is used.
        """
        table = torch.full((num_logical + 1,), -1, dtype=torch.int32)
        local = self.local_experts(ep_rank)
        for slot in reversed(range(local.numel())):
            table[int(local[slot])] = slot
        return table
