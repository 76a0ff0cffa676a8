"""Expert placement: which logical expert each physical slot holds, and which slots a rank owns.

Physical slots P = logical experts + redundant copies; rank r owns slots
[r * P / ep, (r + 1) * P / ep). The default placement is the identity (slot i = expert i).
EPLB replaces `physical_to_logical` with a balanced map; `save_placements` / `load_placements`
keep one per layer in a JSON file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from moekit.config import INT_DTYPES


@dataclass(frozen=True)
class ExpertPlacement:
    """physical_to_logical [P] int64: the logical expert in each physical slot."""

    physical_to_logical: torch.Tensor
    ep_size: int = 1

    def __post_init__(self) -> None:
        p2l = self.physical_to_logical
        if not isinstance(p2l, torch.Tensor) or p2l.dim() != 1 or p2l.dtype not in INT_DTYPES:
            got = f"{p2l.dtype} [{', '.join(map(str, p2l.shape))}]" if isinstance(
                p2l, torch.Tensor) else type(p2l).__name__  # fmt: skip
            raise ValueError(f"physical_to_logical must be a 1-D integer tensor [slots], got {got}")
        if not isinstance(self.ep_size, int) or isinstance(self.ep_size, bool) or self.ep_size < 1:
            raise ValueError(f"ep_size must be a positive integer, got {self.ep_size!r}")
        if self.num_slots == 0 or self.num_slots % self.ep_size:
            raise ValueError(
                f"physical expert slots ({self.num_slots}) must be a positive multiple of "
                f"ep_size ({self.ep_size})"
            )

    def check(self, num_experts: int) -> None:
        """Raise ValueError unless every slot holds a logical expert in [0, num_experts) and
        every expert has a slot (a host read of the map: not for the hot path)."""
        p2l = self.physical_to_logical.detach().to("cpu", torch.int64)
        outside = sorted({e for e in p2l.tolist() if not 0 <= e < num_experts})
        if outside:
            raise ValueError(
                f"placement maps slots to logical experts outside [0, {num_experts}): "
                f"{outside[:16]}"
            )
        missing = (torch.bincount(p2l, minlength=num_experts) == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(
                f"placement holds no slot for logical experts {missing[:16]}: every expert in "
                f"[0, {num_experts}) needs one"
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
        if not 0 <= ep_rank < self.ep_size:
            raise ValueError(f"ep_rank must be in [0, ep_size = {self.ep_size}), got {ep_rank}")
        n = self.slots_per_rank
        return range(ep_rank * n, (ep_rank + 1) * n)

    def local_experts(self, ep_rank: int) -> torch.Tensor:
        """Logical expert id of each local slot of `ep_rank` [slots_per_rank]."""
        s = self.local_slots(ep_rank)
        return self.physical_to_logical[s.start : s.stop]


def save_placements(path: str | Path, placements: Sequence[ExpertPlacement]) -> None:
    """Write one placement per layer as JSON: {"ep_size": R, "placements": [[slot -> expert]]}
    (what `moekit eplb --out` writes and `load_placements` reads)."""
    if not placements:
        raise ValueError("save_placements needs at least one placement")
    sizes = {p.ep_size for p in placements}
    if len(sizes) != 1:
        raise ValueError(f"the placements have different ep_size values {sorted(sizes)}")
    doc = {"ep_size": sizes.pop(), "placements": [p.physical_to_logical.tolist() for p in placements]}
    Path(path).write_text(json.dumps(doc))


def load_placements(path: str | Path) -> list[ExpertPlacement]:
    """The per-layer placements `save_placements` (or `moekit eplb --out`) wrote to `path`."""
    try:
        doc = json.loads(Path(path).read_text())
        ep_size, rows = doc["ep_size"], doc["placements"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: not a placement file ({{'ep_size': R, 'placements': [[expert per slot], "
            f"...]}} as `moekit eplb --out` writes): {e}"
        ) from None
    if not isinstance(ep_size, int) or ep_size < 1 or not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected an ep_size >= 1 and a non-empty list of placements")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row or not all(isinstance(e, int) and e >= 0 for e in row):
            raise ValueError(f"{path}: placement {i} must be a non-empty list of expert ids >= 0")
        out.append(ExpertPlacement(torch.tensor(row, dtype=torch.int64), ep_size))
    return out
