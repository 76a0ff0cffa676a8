"""`moekit eplb`: a balanced expert placement for a measured (or simulated) expert load, with the
ranks' loads before and after; optionally written as JSON (`moekit.placement.load_placements`
reads it back, for `MoE(placement=...)` or `ExpertBalancer.apply`)."""

from __future__ import annotations

import argparse

import torch

from moekit.config import ConfigError, ParallelConfig
from moekit.eplb import (
    ExpertLoadRecorder,
    balanced_placement,
    balancedness,
    rank_loads,
    read_load,
)
from moekit.placement import ExpertPlacement, save_placements
from moekit.presets import PRESETS, model_config
from moekit.sweep import ROUTINGS, make_routing


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eplb",
        help="a balanced expert placement for a measured or simulated expert load",
        description="Compute the expert placement (physical slot -> logical expert) that "
        "balances the tokens over --ep-size ranks with --ep-num-redundant-experts extra slots "
        "for the hot experts, and print each rank's load before (experts in order) and after. "
        "The load is read from --load (a list per layer or one list of tokens per expert: JSON, "
        "or a torch tensor [E] / [L, E] saved with torch.save, e.g. an ExpertLoadRecorder's "
        "counts) or simulated from --model's routing.",
    )
    p.add_argument("--load", help="measured load: .json or torch.save file, [E] or [L, E]")
    p.add_argument("--model", default="qwen3-30b-a3b",
                   help=f"without --load: simulate this preset's routing ({', '.join(PRESETS)} "
                   "or a Hugging Face config.json)")  # fmt: skip
    p.add_argument("--routing", default="zipf", help=f"simulated routing: {', '.join(ROUTINGS)}")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of the simulation")
    p.add_argument("--tokens", type=int, default=8192, help="simulated tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated routing")
    p.add_argument("--ep-size", type=int, required=True, help="expert-parallel ranks")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0,
                   help="extra physical slots for copies of hot experts")  # fmt: skip
    p.add_argument("--out", help="write the placement(s) as JSON here")
    p.set_defaults(func=run)
    return p


def simulated_load(model: str, routing: str, zipf_s: float, tokens: int, seed: int):
    """[1, E] tokens per expert of `tokens` tokens routed by the synthetic routing."""
    cfg = model_config(model)
    topk = make_routing(tokens, cfg.num_experts, cfg.top_k, routing=routing, zipf_s=zipf_s,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
    rec = ExpertLoadRecorder(cfg.num_experts)
    rec.record(topk.ids)
    return rec.counts.to(torch.float64)[None]


def run(args) -> int:
    if args.ep_size < 1:  # before ParallelConfig, whose first check names --tp-size
        raise ConfigError(f"--ep-size must be a positive integer, got {args.ep_size}")
    ParallelConfig(tp_size=args.ep_size, ep_size=args.ep_size,
                   ep_num_redundant_experts=args.ep_num_redundant_experts)  # checks both options
    if args.load:
        try:
            load = read_load(args.load)
        except ValueError as err:
            raise ConfigError(f"--load: {err}") from None
        source = args.load
    else:
        load = simulated_load(args.model, args.routing, args.zipf_s, args.tokens, args.seed)
        source = f"{args.model}, {args.routing} routing, {args.tokens} tokens, seed {args.seed}"
    E = load.shape[1]
    slots = E + args.ep_num_redundant_experts
    if slots % args.ep_size:
        raise ConfigError(
            f"--ep-size ({args.ep_size}) must divide the {E} experts + "
            f"{args.ep_num_redundant_experts} redundant = {slots} slots"
        )
    print(f"load: {source}; {E} experts, {load.shape[0]} layer(s); {slots} slots over "
          f"{args.ep_size} ranks ({slots // args.ep_size} each)")  # fmt: skip
    contiguous = ExpertPlacement.contiguous(E, args.ep_size, slots)
    out = []
    for layer, layer_load in enumerate(load):
        placement = balanced_placement(layer_load, slots, args.ep_size)
        before = rank_loads(layer_load, contiguous)
        after = rank_loads(layer_load, placement)
        print(f"layer {layer}: balancedness (mean / max rank load) "
              f"{balancedness(layer_load, contiguous):.3f} -> "
              f"{balancedness(layer_load, placement):.3f}; busiest rank "
              f"{float(before.max()):.0f} -> {float(after.max()):.0f}")  # fmt: skip
        out.append(placement)
    if args.out:
        save_placements(args.out, out)
        print(f"wrote {args.out}")
    return 0
