"""Rebalancing a model's MoE layers while it serves (the serving engines' `--enable-eplb` with
`--eplb-rebalance-num-iterations`).

    balancer = ExpertBalancer(model)         # every moekit MoE layer in it, recording its load
    for batch in batches:
        out = model(batch)                   # eager, or CUDA graphs captured once
        balancer.step()                      # every `every` steps, on every rank: balance

At each check the load each layer recorded since the last one is summed over the ranks (one
all-reduce for all layers), a balanced placement is computed per layer (`balanced_placement`),
and a layer's experts move only when that makes its busiest EP rank at least `min_gain` lighter.
Every rank sees the same summed load, so every rank takes the same decisions. Experts move in
place (`rebalance_`): CUDA graphs captured before run with the new placement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from moekit import metrics
from moekit.eplb.algorithm import balanced_placement, balancedness
from moekit.eplb.rebalance import rebalance_
from moekit.eplb.recorder import save_load
from moekit.log import logger
from moekit.placement import ExpertPlacement

_WORLD = object()  # the default group: the whole world when torch.distributed is initialized


@dataclass(frozen=True)
class LayerBalance:
    """One layer at a check: the balancedness (mean / max rank load) of the recorded load under
    the placement it had and under the balanced one, and whether its experts moved."""

    layer: int
    before: float
    after: float
    moved: bool


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The moekit MoE layers in `model` (itself included), in module order: the modules that
    record their expert load (eplb sits below layer.py, so it does not import the class)."""
    return [m for m in model.modules() if _is_moe(m)]


def _is_moe(module: nn.Module) -> bool:
    return callable(getattr(module, "record_expert_load", None))


class ExpertBalancer:
    """Periodic EPLB over `layers` (a model, or moekit MoE layers in layer order).

    every: steps between checks (default: the first layer's
    `ParallelConfig.eplb_rebalance_num_iterations`). min_gain: move a layer's experts only when
    its busiest rank's load falls by that fraction of itself or more. group: the ranks whose
    loads are summed; by default the whole world when torch.distributed is initialized (ranks
    that hold the same tokens add the same counts, which scales the load, not its balance), else
    none. With ranks, every rank must call `step`, `rebalance`, `save_load` and `apply` together,
    and pass group=None only when every rank records the same tokens (the ranks must reach the
    same placements).
    """

    def __init__(
        self,
        layers: nn.Module | Sequence[nn.Module],
        *,
        every: int | None = None,
        min_gain: float = 0.05,
        group: dist.ProcessGroup | None | object = _WORLD,
    ) -> None:
        self.layers = moe_layers(layers) if isinstance(layers, nn.Module) else list(layers)
        if not self.layers:
            raise ValueError("ExpertBalancer found no moekit MoE layer to balance")
        others = [type(m).__name__ for m in self.layers if not _is_moe(m)]
        if others:
            raise ValueError(f"ExpertBalancer balances moekit MoE layers, got {others[:4]}")
        self.every = self.layers[0].parallel.eplb_rebalance_num_iterations if every is None else every
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every (--eplb-rebalance-num-iterations) must be >= 1, got {every!r}")
        if not isinstance(min_gain, (int, float)) or not 0 <= min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
        self.min_gain = min_gain
        if len({layer.config.total_experts for layer in self.layers}) != 1:
            raise ValueError("the layers have different numbers of experts; balance them apart")
        if group is _WORLD:
            group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self.group = group
        self.steps = 0
        for layer in self.layers:
            layer.record_expert_load()

    def step(self) -> bool:
        """Count one forward step; every `every` steps, `rebalance`. True when experts moved
        (in place: see `rebalance_` for the one case that needs graphs captured again)."""
        self.steps += 1
        if self.steps % self.every:
            return False
        return any(layer.moved for layer in self.rebalance())

    def loads(self) -> torch.Tensor:
        """[L, E] int64 on the CPU: the pairs routed to each logical expert of each layer since
        the last check, summed over the group."""
        stopped = [i for i, layer in enumerate(self.layers) if layer.expert_load is None]
        if stopped:
            raise ValueError(f"MoE layers {stopped} stopped recording their load "
                             "(record_expert_load(False)); the balancer needs it")  # fmt: skip
        counts = [layer.expert_load.counts for layer in self.layers]
        stacked = torch.stack([c.to(counts[0].device) for c in counts])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(stacked, group=self.group)
        return stacked.cpu()

    def rebalance(self) -> list[LayerBalance]:
        """Balance every layer for the load recorded since the last check, move the experts of
        those where it pays, and start recording afresh."""
        reports = []
        for i, (layer, load) in enumerate(zip(self.layers, self.loads())):
            placement = layer.placement
            before = after = balancedness(load, placement)
            moved = False
            if load.sum() > 0:
                new = balanced_placement(load, placement.num_slots, placement.ep_size)
                after = balancedness(load, new)
                if after * (1 - self.min_gain) > before:
                    rebalance_(layer, new)
                    moved = True
            layer.expert_load.reset()
            metrics.record_balance(i, after if moved else before, moved)
            reports.append(LayerBalance(i, before, after, moved))
        movers = [r for r in reports if r.moved]
        logger.log(
            logging.INFO,
            f"EPLB check after {self.steps} steps: moved the experts of {len(movers)} of "
            f"{len(reports)} layers; worst balancedness "
            f"{min(r.before for r in reports):.3f} -> "
            f"{min(r.after if r.moved else r.before for r in reports):.3f}",
        )
        return reports

    def apply(self, placements: Sequence[ExpertPlacement]) -> None:
        """Move every layer's experts to its placement in `placements` (e.g. from
        `moekit.placement.load_placements` of a `moekit eplb --out` file)."""
        if len(placements) != len(self.layers):
            raise ValueError(f"{len(placements)} placements for {len(self.layers)} MoE layers")
        for layer, placement in zip(self.layers, placements):
            rebalance_(layer, placement)

    def save_load(self, path: str | Path) -> torch.Tensor:
        """Write `loads()` as JSON [L, E] (what `moekit eplb --load` reads); returns it."""
        load = self.loads()
        save_load(path, load)
        return load
