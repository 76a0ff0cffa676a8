"""Move a layer's experts to a new placement (EPLB), and give its dispatcher that placement.

Every physical slot s of the new placement must end up holding logical expert p2l[s]. A rank
takes each of its new slots from one of its own old slots holding that expert where it has one
(a local copy), else from the first old slot holding it on another EP rank (a point-to-point
transfer over the EP group). Copies of an expert hold the same weights, so any one will do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moekit.experts import QUANT_TENSORS
from moekit.log import logger
from moekit.placement import ExpertPlacement

_PER_EXPERT = ("w13", "w2", "b13", "b2", *QUANT_TENSORS)


def _expert_tensors(layer) -> dict[str, torch.Tensor]:
    """The layer's tensors with one row per local slot (weights, biases, scales)."""
    n = layer.placement.slots_per_rank
    out = {}
    for name in _PER_EXPERT:
        t = getattr(layer, name, None)
        if t is None:
            continue
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {n} local slots first")
        out[name] = t
    return out


def transfer_plan(old: ExpertPlacement, new: ExpertPlacement) -> list[list[tuple[int, int]]]:
    """For each EP rank r and new local slot j: (source rank, source local slot) of the old
    placement holding logical expert new[r * n + j], r's own old slots first."""
    n, R = old.slots_per_rank, old.ep_size
    old_p2l = old.physical_to_logical.tolist()
    first = {}
    for s, e in enumerate(old_p2l):
        first.setdefault(e, s)
    missing = sorted(set(new.physical_to_logical.tolist()) - set(first))
    if missing:
        raise ValueError(f"the old placement holds no copy of logical experts {missing[:16]}")
    plan = []
    for r in range(R):
        mine = {}
        for j in range(n):
            mine.setdefault(old_p2l[r * n + j], j)
        row = []
        for e in new.physical_to_logical[r * n:(r + 1) * n].tolist():
            row.append((r, mine[e]) if e in mine else divmod(first[e], n))
        plan.append(row)
    return plan


@torch.no_grad()
def rebalance_(layer, placement: ExpertPlacement) -> bool:
    """Give `layer` (a moekit MoE) the new `placement`, in place: its expert tensors are
    rearranged in their storage, its runners rewrite the copies they keep of them (packed,
    padded), and its dispatcher rewrites its slot map's tensors. So CUDA graphs captured
    earlier of the layer's forward run with the new placement; True. False (and a warning) where
    the dispatcher's forward changed path instead (one rank whose ids turn mapped or unmapped:
    a permutation of its experts from or to slot i = expert i): capture those graphs again.
    With ep_size > 1 every rank of the layer's EP group must call it with the same placement
    (point-to-point transfers over that group). Not during CUDA-graph capture."""
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"rebalance_ takes an ExpertPlacement, got {type(placement).__name__}")
    placement.check(layer.config.total_experts)  # before anything moves
    old = layer.placement
    if (placement.ep_size, placement.num_slots) != (old.ep_size, old.num_slots):
        raise ValueError(
            f"the new placement has {placement.num_slots} slots over {placement.ep_size} ranks; "
            f"the layer has {old.num_slots} over {old.ep_size}"
        )
    if old.ep_size > 1 and getattr(layer, "state", None) is None:
        raise ValueError(
            "moving experts between EP ranks needs the layer built on a parallel state "
            "(MoE(..., state=moekit.parallel.init_parallel(...)))"
        )
    tensors = _expert_tensors(layer)
    plan = transfer_plan(old, placement)
    me = layer.ep_rank
    fresh = {name: torch.empty_like(t) for name, t in tensors.items()}
    ops = []
    ranks = layer.state.ep_ranks if old.ep_size > 1 else (0,)
    for r, row in enumerate(plan):
        for j, (src, src_j) in enumerate(row):
            if r != me and src != me:
                continue
            for name, t in tensors.items():  # the same order on sender and receiver
                if r == me and src == me:
                    fresh[name][j].copy_(t[src_j])
                elif r == me:
                    ops.append(dist.P2POp(dist.irecv, fresh[name][j], ranks[src]))
                else:
                    ops.append(dist.P2POp(dist.isend, t[src_j].contiguous(), ranks[r]))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for name, t in tensors.items():
        t.copy_(fresh[name])
    layer.runners.refresh(layer.expert_weights, layer.act)
    layer.placement = placement
    in_place = layer.dispatcher.update_placement(placement, layer.config.total_experts)
    if not in_place:
        logger.warning(f"EPLB: the {layer.dispatcher.name!r} dispatcher maps its ids differently "
                       "for the new placement; CUDA graphs of this layer must be captured again")
    return in_place
