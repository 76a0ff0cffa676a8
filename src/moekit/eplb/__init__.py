"""Expert-parallel load balancing: record the load, compute a balanced placement, move the
experts.

    recorder = layer.record_expert_load()          # counts on the device, every forward
    ...serve a while...
    load = recorder.total(group)                   # summed over the ranks with other tokens
    placement = balanced_placement(load, layer.placement.num_slots, layer.placement.ep_size)
    rebalance_(layer, placement)                   # on every rank of the EP group

or, every --eplb-rebalance-num-iterations steps of a serving loop, `ExpertBalancer(model).step()`.
"""

from moekit.eplb.algorithm import balanced_placement, balancedness, pack, rank_loads, replicate
from moekit.eplb.balancer import ExpertBalancer, LayerBalance, moe_layers
from moekit.eplb.rebalance import rebalance_, transfer_plan
from moekit.eplb.recorder import ExpertLoadRecorder, read_load, save_load

__all__ = [
    "ExpertBalancer",
    "ExpertLoadRecorder",
    "LayerBalance",
    "balanced_placement",
    "balancedness",
    "moe_layers",
    "pack",
    "rank_loads",
    "read_load",
    "rebalance_",
    "replicate",
    "save_load",
    "transfer_plan",
]
