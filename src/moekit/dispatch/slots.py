"""Which physical expert slot each routed (token, expert) pair goes to, and on which EP rank.

A logical expert may have several physical copies (redundant experts, EPLB). With `spread`,
token t uses copy t % n_copies (copies in slot order): a balance that needs no communication;
without, every token uses the first copy. Either way every rank that holds the same tokens picks
the same slot, so each pair is computed exactly once.

The map's tensors have a shape fixed by the slot count alone (room for the most copies any
placement of those slots can give one expert), so `update_` rewrites them in place for a new
placement (EPLB) and CUDA graphs captured with the map read the new one.
"""

from __future__ import annotations

import torch

from moekit.dispatch.rows import use_triton
from moekit.placement import ExpertPlacement


class SlotMap:
    """Logical expert id -> physical slot for a placement over `ep_size` ranks.

    physical(ids_TK) -> slot_TK int64 (-1 where the id is -1); rank = slot // slots_per_rank,
    local slot = slot % slots_per_rank."""

    def __init__(
        self, placement: ExpertPlacement, num_logical: int | None = None, spread: bool = True
    ) -> None:
        p2l = placement.physical_to_logical.detach().to("cpu", torch.int64)
        L = int(num_logical if num_logical is not None else p2l.max().item() + 1)
        placement.check(L)
        self.num_logical = L
        self.num_slots = placement.num_slots
        self.ep_size = placement.ep_size
        self.slots_per_rank = placement.slots_per_rank
        self.redundant = self.num_slots > L  # some expert has two copies, in any placement
        self.spread = spread
        table, copies = self._tables(p2l)
        self._table = table  # [L + 1, num_slots - L + 1]; row L (for id -1) is -1
        self._copies = copies  # [L + 1]
        self._shares = self._rank_shares(table, copies)

    def _tables(self, p2l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """p2l [num_slots] (CPU) -> (table [L + 1, width] of each expert's slots, -1 past its
        copies; copies [L + 1], 1 for the masked row)."""
        L = self.num_logical
        copies = torch.bincount(p2l, minlength=L)
        table = torch.full((L + 1, self.num_slots - L + 1), -1, dtype=torch.int64)
        filled = [0] * L
        for slot, e in enumerate(p2l.tolist()):
            table[e, filled[e]] = slot
            filled[e] += 1
        return table, torch.cat([copies, torch.ones(1, dtype=torch.int64)])

    def update_(self, placement: ExpertPlacement, num_logical: int | None = None) -> None:
        """Take a new placement of the same slots over the same ranks (and, given, the same
        `num_logical` experts), writing the map's tensors in place (outside CUDA-graph
        capture)."""
        if num_logical not in (None, self.num_logical):
            raise ValueError(f"a new placement must keep the {self.num_logical} logical "
                             f"experts, got {num_logical}")
        if (placement.num_slots, placement.ep_size) != (self.num_slots, self.ep_size):
            raise ValueError(
                f"a new placement must keep the slots and ranks: it has {placement.num_slots} "
                f"slots over {placement.ep_size} ranks, the map {self.num_slots} over "
                f"{self.ep_size}"
            )
        placement.check(self.num_logical)
        table, copies = self._tables(placement.physical_to_logical.detach().to("cpu", torch.int64))
        self._table.copy_(table)
        self._copies.copy_(copies)
        self._shares = self._rank_shares(table, copies)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._table.device != device:
            self._table, self._copies = self._table.to(device), self._copies.to(device)
        return self._table, self._copies

    def physical(self, ids_TK: torch.Tensor) -> torch.Tensor:
        """ids_TK [T, K] int (logical, -1 = masked) -> slots [T, K] int64 (-1 = masked).
        No host synchronisation."""
        table, copies = self._on(ids_TK.device)
        ids = ids_TK.long()
        row = torch.where(ids < 0, self.num_logical, ids)
        if not (self.redundant and self.spread):
            return table[:, 0][row]
        t = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
        return table[row, t % copies[row]]

    def local_share(self, ep_rank: int) -> float:
        """The expected share of uniformly routed pairs whose slot is on `ep_rank`: each
        logical expert counts 1 / L, split evenly over its copies with `spread`, else all on
        its first copy. Computed once, on the host."""
        return self._shares[ep_rank]

    def _rank_shares(self, table: torch.Tensor, copies: torch.Tensor) -> list[float]:
        table, copies = table[: self.num_logical], copies[: self.num_logical]
        shares = []
        for r in range(self.ep_size):
            start = r * self.slots_per_rank
            here = ((table >= start) & (table < start + self.slots_per_rank)).double()
            if self.spread and self.redundant:
                per_expert = here.sum(dim=1) / copies.double()
            else:
                per_expert = here[:, 0]
            shares.append(float(per_expert.sum()) / max(self.num_logical, 1))
        return shares

    def local_ids_torch(self, ids_TK: torch.Tensor, ep_rank: int) -> torch.Tensor:
        """[T, K] int32: the local slot on `ep_rank` for each pair, -1 where it goes elsewhere."""
        slot = self.physical(ids_TK)
        start = ep_rank * self.slots_per_rank
        here = (slot >= start) & (slot < start + self.slots_per_rank)
        return torch.where(here, slot - start, -1).to(torch.int32)

    def local_ids(self, ids_TK: torch.Tensor, ep_rank: int, impl: str = "auto") -> torch.Tensor:
        """`local_ids_torch` in one Triton kernel on CUDA (the twin is about ten small
        launches: most of a decode step's dispatch on an EP rank that sees every token)."""
        if not use_triton(ids_TK, impl) or ids_TK.numel() == 0:
            return self.local_ids_torch(ids_TK, ep_rank)
        from moekit.dispatch._kernels import launch_local_ids

        table, copies = self._on(ids_TK.device)
        out = torch.empty(ids_TK.shape, dtype=torch.int32, device=ids_TK.device)
        E = self.slots_per_rank
        launch_local_ids(ids_TK.contiguous(), table, copies, self.redundant and self.spread,
                         out, ep_rank * E, E)
        return out
