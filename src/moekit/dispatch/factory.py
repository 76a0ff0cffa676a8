"""`make_dispatcher`: the dispatcher a layer uses, from its ParallelConfig and ParallelState."""

from __future__ import annotations

from moekit import hardware
from moekit.config import ConfigError, ParallelConfig
from moekit.dispatch.base import Dispatcher
from moekit.dispatch.registry import dispatcher_class
from moekit.parallel import ParallelState
from moekit.placement import ExpertPlacement


def make_dispatcher(
    parallel: ParallelConfig,
    placement: ExpertPlacement,
    num_logical_experts: int,
    *,
    state: ParallelState | None = None,
    ep_rank: int = 0,
    fp8_dispatch: bool = False,
) -> Dispatcher:
    """The `--moe-a2a-backend` dispatcher for this rank.

    'none': tokens stay replicated; combine all-reduces over state.tp_group (no state: no
    all-reduce, the caller sums the partial outputs). 'alltoall': all-to-all over state.ep_group
    in --deepep-mode, with --max-dispatch-tokens-per-rank. Other backends raise ConfigError with
    why they cannot run here.
    """
    name = parallel.moe_a2a_backend
    if name == "none":
        from moekit.dispatch.none import NoneDispatcher

        group = state.tp_group if state is not None else None
        return NoneDispatcher(placement, ep_rank, num_logical_experts, group=group)
    try:
        cls = dispatcher_class(name)
    except KeyError as err:
        raise ConfigError(str(err).strip("'\"")) from None
    avail = cls.availability(hardware.detect(), parallel)
    if not avail:
        raise ConfigError(f"--moe-a2a-backend {name}: {avail.reason}")
    if state is None:
        raise ConfigError(
            f"--moe-a2a-backend {name} needs the parallel state: pass "
            "state=moekit.parallel.init_parallel(parallel_config)"
        )
    if state.ep_rank != ep_rank:
        raise ConfigError(f"ep_rank {ep_rank} differs from the parallel state's {state.ep_rank}")
    return cls(
        placement,
        group=state.ep_group,
        num_logical_experts=num_logical_experts,
        mode=parallel.deepep_mode,
        max_dispatch_tokens_per_rank=parallel.max_dispatch_tokens_per_rank,
        fp8_dispatch=fp8_dispatch,
    )
