"""Expert load as the layer sees it: tokens routed to each logical expert, counted on the device.

The layer's routing adds each call's counts into the recorder's fixed buffer (inside the fused
routing kernel where it runs, else with `router.count_experts`, one index-add); no host
synchronisation, so it runs inside CUDA graphs and under torch.compile. `counts` reads them.
On an expert-parallel layer each rank counts its own tokens: sum the counts over the ranks that
hold different tokens (`total`) before balancing. `save_load` / `read_load` keep a load [L, E]
(one row per layer) in a file, for `moekit eplb --load`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from moekit.router import count_experts


class ExpertLoadRecorder:
    """counts [E] int64 on `device`: routed (token, expert) pairs per logical expert since the
    last `reset`; ids of -1 (masked) are not counted."""

    def __init__(self, num_experts: int, device: torch.device | str | None = None) -> None:
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts = num_experts
        self._counts = _static(torch.zeros(num_experts, dtype=torch.int64, device=device))

    def counts_on(self, device: torch.device) -> torch.Tensor:
        """The live counts [E] on `device`, for the routing to add to; they follow the layer
        to its device (a layer moved with .to() after its recorder was made)."""
        if self._counts.device != device:
            self._counts = _static(self._counts.to(device))
        return self._counts

    def record(self, ids_TK: torch.Tensor) -> None:
        """Count ids [T, K] (logical expert ids, -1 = masked)."""
        count_experts(ids_TK, self.counts_on(ids_TK.device))

    @property
    def counts(self) -> torch.Tensor:
        """[E] int64 (the live buffer)."""
        return self._counts

    def total(self, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The counts summed over `group`'s ranks (a copy; this rank's own when None)."""
        out = self.counts.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
        return out

    def reset(self) -> None:
        self._counts.zero_()


def _static(counts: torch.Tensor) -> torch.Tensor:
    """counts, marked as a tensor whose address stays put: torch.compile's CUDA graphs
    (mode="reduce-overhead") then update it in place, where they would skip a graph that
    mutates any other input."""
    torch._dynamo.mark_static_address(counts)
    return counts


def save_load(path: str | Path, load_LE: torch.Tensor) -> None:
    """Write load [L, E] (or [E]) as JSON, what `read_load` and `moekit eplb --load` read."""
    Path(path).write_text(json.dumps(load_LE.tolist()))


def read_load(path: str | Path) -> torch.Tensor:
    """[L, E] float64 from a JSON list (of lists) or a torch.save'd tensor [E] / [L, E];
    ValueError naming what is wrong."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"no such file {str(path)!r}")
    what = "a JSON list (of lists) of numbers, or a torch.save'd tensor [E] / [L, E]"
    try:
        if file.suffix.lower() == ".json":
            load = torch.tensor(json.loads(file.read_text()), dtype=torch.float64)
        else:
            load = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (json, torch.load, torch.tensor: each its own)
        why = f"{type(err).__name__}: {err}"[:200]
        raise ValueError(f"{str(path)!r} is not {what} ({why})") from None
    if not isinstance(load, torch.Tensor):
        raise ValueError(f"{str(path)!r} holds a {type(load).__name__}, not {what}")
    load = load.to(torch.float64)
    if load.dim() == 1:
        load = load[None]
    if load.dim() != 2 or load.shape[1] == 0:
        raise ValueError(f"expected [E] or [L, E] values, got shape {tuple(load.shape)}")
    if not (torch.isfinite(load) & (load >= 0)).all():
        raise ValueError(f"{str(path)!r}: loads must be finite counts >= 0")
    return load
