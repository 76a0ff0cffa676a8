"""Balanced expert placement: a pure function of the measured expert load (CPU, plain tensors).

Two steps, each greedy:
  1. replicate: every logical expert gets one physical slot; each redundant slot goes to the
     expert whose load per copy is the largest at that moment;
  2. pack: the copies (each carrying load / copies, as the dispatchers spread an expert's tokens
     evenly over its copies), heaviest first, go to the EP rank with the least load that still
     has a free slot, preferring ranks that do not hold that expert yet.
The result is an `ExpertPlacement` (slot -> logical expert) that the layer and the dispatchers
take as it is (`moekit.eplb.rebalance_`).
"""

from __future__ import annotations

import heapq

import torch

from moekit.placement import ExpertPlacement


def _check(load_E: torch.Tensor, num_slots: int, ep_size: int) -> torch.Tensor:
    if load_E.dim() != 1 or load_E.numel() == 0:
        raise ValueError(f"load must be a 1-D tensor with one value per expert, got shape "
                         f"{tuple(load_E.shape)}")  # fmt: skip
    load = load_E.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and >= 0 for every expert")
    E = load.numel()
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if num_slots < E or num_slots % ep_size:
        raise ValueError(
            f"num_slots ({num_slots}) must be >= the experts ({E}) and divisible by ep_size "
            f"({ep_size}): experts + --ep-num-redundant-experts"
        )
    return load


def replicate(load_E: torch.Tensor, num_slots: int) -> torch.Tensor:
    """copies [E] int64 summing to num_slots, every expert at least 1: each extra slot to the
    expert with the largest load / copies (ties: the lower expert id)."""
    load = _check(load_E, num_slots, 1)
    copies = [1] * load.numel()
    heap = [(-w, e) for e, w in enumerate(load.tolist())]
    heapq.heapify(heap)
    for _ in range(num_slots - load.numel()):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-load[e].item() / copies[e], e))
    return torch.tensor(copies, dtype=torch.int64)


def pack(load_E: torch.Tensor, copies_E: torch.Tensor, ep_size: int) -> torch.Tensor:
    """physical_to_logical [sum(copies)] int64: the copies (load / copies each) placed heaviest
    first on the least loaded rank with a free slot, a rank without that expert first; a rank's
    slots in the order they were filled."""
    num_slots = int(copies_E.sum())
    load = _check(load_E, num_slots, ep_size)
    if copies_E.shape != load.shape or (copies_E < 1).any():
        raise ValueError("copies must give every expert at least one slot")
    per_rank = num_slots // ep_size
    items = sorted(
        ((load[e].item() / int(c), e) for e, c in enumerate(copies_E.tolist()) for _ in range(c)),
        key=lambda item: (-item[0], item[1]),
    )
    rank_load = [0.0] * ep_size
    slots: list[list[int]] = [[] for _ in range(ep_size)]
    for w, e in items:
        free = [r for r in range(ep_size) if len(slots[r]) < per_rank]
        fresh = [r for r in free if e not in slots[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        slots[r].append(e)
        rank_load[r] += w
    return torch.tensor([e for rank in slots for e in rank], dtype=torch.int64)


def balanced_placement(load_E: torch.Tensor, num_slots: int, ep_size: int) -> ExpertPlacement:
    """The placement of `num_slots` physical slots over `ep_size` ranks for the measured load
    [E] (tokens per logical expert, any scale): `replicate`, then `pack` (each validates)."""
    return ExpertPlacement(pack(load_E, replicate(load_E, num_slots), ep_size), ep_size)


def rank_loads(load_E: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """[ep_size] float64: the load each rank gets under `placement`, an expert's load split
    evenly over its copies."""
    load = load_E.detach().to("cpu", torch.float64)
    p2l = placement.physical_to_logical.to("cpu", torch.int64)
    if load.dim() != 1 or int(p2l.max()) >= load.numel():
        raise ValueError(f"load [{', '.join(map(str, load.shape))}] must be [E], one value per "
                         f"logical expert; the placement maps slots to experts up to "
                         f"{int(p2l.max())}")  # fmt: skip
    copies = torch.bincount(p2l, minlength=load.numel()).to(torch.float64)
    if (copies[: load.numel()] == 0).any():
        raise ValueError("the placement holds no slot for some expert")
    per_slot = load[p2l] / copies[p2l]
    return per_slot.view(placement.ep_size, -1).sum(1)


def balancedness(load_E: torch.Tensor, placement: ExpertPlacement) -> float:
    """Mean over max of the ranks' loads (1.0: perfectly balanced; the layer waits for its most
    loaded rank, so 1 / balancedness is the slow-down against a perfect balance)."""
    ranks = rank_loads(load_E, placement)
    top = float(ranks.max())
    return float(ranks.mean()) / top if top > 0 else 1.0
