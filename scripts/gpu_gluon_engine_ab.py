"""The triton_kernel runner's Gluon engine against the `triton` runner and its own Triton
engine, timed in turns (`moekit.bench.time_ms_interleaved`): the ratios the engine choice
(`gluon_ops.engine_for`) rests on.

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_gluon_engine_ab.py   # $OUT/gluon_engine_ab.json

Per preset shape (bf16, uniform random routing, deepseek-v3 EP8 with every pair local) and
T in BATCHES: the calls (the engine with its own config, `gluon_ops.config_for`, and with the
other way of reading x's rows: gathered by its producer or copied into sorted order first) on
the same inputs, each checked against the `triton` runner's
output, then timed as CUDA-graph replays in ROUNDS rounds of rotated order.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import write_probe

from moekit.bench import time_ms_interleaved
from moekit.runners.triton import ops as triton_ops
from moekit.runners.triton.ops import kernel_inputs
from moekit.runners.triton_kernel import gluon_ops
from moekit.runners.triton_kernel import ops as tk_ops
from moekit.runners.triton_kernel.configs import config_for
from moekit.tune import random_weights, seeded_batch, shape_for

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip
BATCHES = tuple(int(t) for t in os.environ.get("AB_BATCHES", "1024,4096,16384").split(","))
ROUNDS = int(os.environ.get("AB_ROUNDS", "6"))


def main() -> None:
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    recs = []
    for model, (tp, ep) in PRESETS.items():
        shape = shape_for(model, tp, ep)
        w = random_weights(shape, dev)
        act, E, K = shape.act, shape.num_experts, shape.top_k
        for T in BATCHES:
            x, topk = seeded_batch(shape, T, dev)
            x_TH, ids, weights = kernel_inputs(x, topk)
            cfg = config_for(T, K, E, shape.hidden, shape.intermediate, act.interleaved,
                             act.name, "bfloat16", name)  # fmt: skip
            cfg_g = gluon_ops.config_for(w)  # the engine's own choice; alt: the other A source
            alt = replace(cfg_g, gather=not cfg_g.gather)
            fns = {
                "triton": lambda: triton_ops.fused_moe(x, topk, w, act),
                "tk_gluon": lambda: gluon_ops.fused_moe(x_TH, ids, weights, w, act, cfg_g),
                "tk_gluon_alt": lambda: gluon_ops.fused_moe(x_TH, ids, weights, w, act, alt),
                "tk_triton": lambda: tk_ops.fused_moe(x, topk, w, act, config=cfg),
            }
            ref = fns["triton"]().float()
            errs = {n: ((f().float() - ref).norm() / ref.norm()).item() for n, f in fns.items()}
            ms = time_ms_interleaved(fns, dev, rounds=ROUNDS)
            rec = {"model": model, "T": T, "ms": ms, "rel_err_vs_triton": errs,
                   "triton_over_gluon": ms["triton"] / ms["tk_gluon"],
                   "tk_triton_over_gluon": ms["tk_triton"] / ms["tk_gluon"],
                   "gather": cfg_g.gather,
                   "alt_over_gluon": ms["tk_gluon_alt"] / ms["tk_gluon"]}  # fmt: skip
            print(f"{model:<15}{T:>6}  triton {ms['triton']:.3f}  tk_gluon {ms['tk_gluon']:.3f}"
                  f"  tk_triton {ms['tk_triton']:.3f}  triton/gluon {rec['triton_over_gluon']:.3f}"
                  f"  tk_triton/gluon {rec['tk_triton_over_gluon']:.3f}"
                  f"  gather {cfg_g.gather}  alt/gluon {rec['alt_over_gluon']:.3f}",
                  flush=True)  # fmt: skip
            recs.append(rec)
        w = None  # free the weights before the next shape's
        torch.cuda.empty_cache()
    write_probe("gluon_engine_ab.json", {"rounds": ROUNDS, "results": recs})


if __name__ == "__main__":
    main()
