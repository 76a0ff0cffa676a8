"""Parallel state: the process groups one MoE layer talks over, built from torch.distributed.

The world (launched with `torchrun`, one process per GPU, any number of nodes) is cut into
consecutive TP groups of `tp_size` ranks (world_size / tp_size data-parallel replicas). Inside a
TP group, with moe_tp_size = tp_size / ep_size (SGLang's convention):

    ep_rank     = tp_rank // moe_tp_size     which slice of the experts this rank holds
    moe_tp_rank = tp_rank %  moe_tp_size     which 1/moe_tp slice of I it holds

EP group: the ep_size ranks of a TP group with the same moe_tp_rank (tokens travel between them).
MoE-TP group: the moe_tp_size ranks with the same ep_rank (they hold the same experts).
Example, tp 4, ep 2: TP group [0 1 2 3], EP groups [0 2] and [1 3], MoE-TP groups [0 1], [2 3].

NCCL on GPU, gloo on CPU. A group of one rank is None (no communication).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moekit.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the TP / EP / MoE-TP layout, and the groups (None = single rank).

    *_ranks are the global ranks of each group, in group-rank order. `dense_tp_size` is the TP
    size of the dense (non-MoE) layers: 1 with --moe-dense-tp-size 1 (dense layers replicated,
    no dense all-reduce), else tp_size."""

    config: ParallelConfig
    world_size: int = 1
    rank: int = 0
    tp_ranks: tuple[int, ...] = (0,)
    ep_ranks: tuple[int, ...] = (0,)
    moe_tp_ranks: tuple[int, ...] = (0,)
    tp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    ep_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    moe_tp_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def tp_size(self) -> int:
        return self.config.tp_size

    @property
    def ep_size(self) -> int:
        return self.config.ep_size

    @property
    def moe_tp_size(self) -> int:
        return self.config.moe_tp_size

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def dp_rank(self) -> int:
        """Which TP group (data-parallel replica) this rank belongs to."""
        return self.rank // self.tp_size

    @property
    def dense_tp_size(self) -> int:
        return 1 if self.config.moe_dense_tp_size == 1 else self.tp_size

    @property
    def dense_tp_group(self) -> dist.ProcessGroup | None:
        return None if self.dense_tp_size == 1 else self.tp_group

    def resolve(self, parallel: ParallelConfig) -> ParallelConfig:
        """The config a layer on this state uses: this state's, when `parallel` is the default
        or the same; a different non-default config is a ConfigError."""
        if parallel != ParallelConfig() and parallel != self.config:
            raise ConfigError(
                f"the layer's ParallelConfig {parallel} differs from the parallel state's "
                f"{self.config}; pass one of them"
            )
        return self.config


def single_rank_state(config: ParallelConfig = ParallelConfig(), device=None) -> ParallelState:
    """The state of a lone process: tp_size = ep_size = 1, no groups."""
    if config.tp_size != 1:
        raise ConfigError(
            f"--tp-size {config.tp_size} needs torch.distributed with {config.tp_size}+ "
            "processes (launch with torchrun and call init_parallel)"
        )
    return ParallelState(config, device=torch.device(device or "cpu"))


def group_layout(world_size: int, tp_size: int, ep_size: int) -> dict[str, list[list[int]]]:
    """Global ranks of every TP, EP and MoE-TP group (pure: no torch.distributed needed)."""
    for option, n in (("the world size", world_size), ("--tp-size", tp_size),
                      ("--ep-size", ep_size)):  # fmt: skip
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"{option} must be a positive integer, got {n!r}")
    if world_size % tp_size:
        raise ConfigError(
            f"--tp-size ({tp_size}) must divide the world size ({world_size} processes)"
        )
    if tp_size % ep_size:
        raise ConfigError(f"--ep-size ({ep_size}) must divide --tp-size ({tp_size})")
    moe_tp = tp_size // ep_size
    tp, ep, moe = [], [], []
    for base in range(0, world_size, tp_size):
        tp.append(list(range(base, base + tp_size)))
        for m in range(moe_tp):
            ep.append([base + e * moe_tp + m for e in range(ep_size)])
        for e in range(ep_size):
            moe.append([base + e * moe_tp + m for m in range(moe_tp)])
    return {"tp": tp, "ep": ep, "moe_tp": moe}


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(
    config: ParallelConfig,
    *,
    backend: str | None = None,
    device: torch.device | str | None = None,
    timeout_s: float | None = None,
) -> ParallelState:
    """Build the TP / EP / MoE-TP groups for `config` on the running world.

    Initialises torch.distributed from the environment (torchrun's RANK, WORLD_SIZE,
    MASTER_ADDR...) if it is not already; backend defaults to NCCL with CUDA, gloo without.
    With NCCL the device defaults to cuda:LOCAL_RANK (torchrun), else the current device; it is
    made current. Every rank must call
    this with the same config (new_group is collective). Raises ConfigError when tp_size does not
    divide the world size.
    """
    if not dist.is_available():
        raise ConfigError("torch.distributed is not available in this build of torch")
    backend = backend or (dist.get_backend() if dist.is_initialized() else default_backend())
    if device is None:
        if backend == "nccl":  # torchrun's LOCAL_RANK, else the current device
            local = os.environ.get("LOCAL_RANK")
            index = int(local) if local is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"init_parallel: device {device} asked for; torch sees no CUDA GPU")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, **kwargs)
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = group_layout(world, config.tp_size, config.ep_size)

    mine: dict[str, tuple[tuple[int, ...], dist.ProcessGroup | None]] = {}
    for kind in ("tp", "ep", "moe_tp"):
        for ranks in layout[kind]:  # every rank creates every group, in the same order
            group = _new_group(ranks, world, backend)
            if rank in ranks:
                mine[kind] = (tuple(ranks), group)
    state = ParallelState(
        config,
        world_size=world,
        rank=rank,
        tp_ranks=mine["tp"][0],
        ep_ranks=mine["ep"][0],
        moe_tp_ranks=mine["moe_tp"][0],
        tp_group=mine["tp"][1],
        ep_group=mine["ep"][1],
        moe_tp_group=mine["moe_tp"][1],
        device=device,
        backend=backend,
    )
    global _STATE
    _STATE = state
    return state


def _new_group(ranks: list[int], world: int, backend: str) -> dist.ProcessGroup | None:
    if len(ranks) == 1:
        return None
    if len(ranks) == world:
        return dist.group.WORLD
    return dist.new_group(ranks, backend=backend)


_STATE: ParallelState | None = None


def get_parallel_state() -> ParallelState | None:
    """The state the last `init_parallel` call built in this process (None before)."""
    return _STATE
