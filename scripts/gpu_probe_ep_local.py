"""Probe: the `triton` runner on one EP rank that sees every token with the other ranks'
experts masked (ids -1), as `moekit bench --tp-size 8 --ep-size 8` times it.

    PYTHONPATH=src python3 scripts/gpu_probe_ep_local.py [--model deepseek-v3] [--ep 8]
        [--batches 1,4,16,64]                    # writes $OUT/ep_local_probe.json

For each batch size T: routings uniform over the E_local * ep global experts (rank 0 keeps
experts 0 .. E_local - 1, the rest become -1), rotated inside the timed CUDA graph; the layer
time with the configs the runner looks up for T, and the configs found by the tuner's own
search (`moekit.tune._search`) on these routings; each over the roofline floor of the same
routings. Question it answers: are the tables (tuned with every pair local) right for a rank
that gets T * K / ep pairs?
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from moekit.bench import measure_ceilings, moe_cost
from moekit.runners.triton import ops
from moekit.runners.triton import configs as tcfg
from moekit.tune import (
    _down_fn,
    _gate_up_fn,
    _Point,
    _search,
    _time_us,
    random_weights,
    schedule_variants,
    shape_for,
    tile_bytes,
    tile_candidates,
    uniform_topk,
)


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    model, ep = _option("--model", "deepseek-v3"), int(_option("--ep", "8"))
    batches = [int(b) for b in _option("--batches", "1,4,16,64").split(",")]
    dev = torch.device("cuda")
    shape = shape_for(model, ep, ep)
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    torch.manual_seed(0)
    w = random_weights(shape, dev)
    ceil = measure_ceilings(dev, torch.bfloat16)
    n1, k1 = tcfg.gemm_shape("gate_up", H, I)
    n2, k2 = tcfg.gemm_shape("down", H, I)
    elem = tile_bytes(None, 2)
    out = []
    for T in batches:
        p = _Point(shape, w, T, dev, seed=T)
        gen = torch.Generator(device=dev).manual_seed(100 + T)
        topks = []
        for _ in range(16):
            t = uniform_topk(T, E * ep, K, dev, gen)
            ids = torch.where(t.ids < E, t.ids, torch.full_like(t.ids, -1))
            topks.append(type(t)(t.weights, ids))
        p.topks, p.R, p._aligns = topks, len(topks), {}
        pairs = sum(int((t.ids >= 0).sum()) for t in topks) / len(topks)
        floor = sum(moe_cost(t.ids, E, H, I).floor_s(ceil) for t in topks) / len(topks) * 1e6

        def layer(cfgs):
            def fn():
                for t in topks:
                    ops.fused_moe(p.x, t, w, shape.act, configs=cfgs)
            return _time_us(fn, dev, p.R, samples=11)

        looked_up = ops.configs_for(T, K, w, torch.bfloat16, dev)
        row = {"T": T, "local_pairs": pairs, "floor_us": floor,
               "looked_up": [str(c) for c in looked_up], "looked_up_us": layer(looked_up)}
        rows = max(1.0, pairs / E)
        best1, t1, tried1 = _search(
            "gate_up", p, lambda c, wu: _gate_up_fn(p, c, wu)[0],
            tile_candidates("gate_up", rows, n1, k1, elem),
            lambda c: schedule_variants("gate_up", c, n1, k1, elem), lambda n: None)
        fn, hs = _gate_up_fn(p, best1)
        fn()
        best2, t2, tried2 = _search(
            "down", p, lambda c, wu: _down_fn(p, best1, hs, c, wu),
            tile_candidates("down", rows, n2, k2, elem),
            lambda c: schedule_variants("down", c, n2, k2, elem), lambda n: None)
        row.update(searched=[str(best1), str(best2)], searched_us=layer((best1, best2)),
                   gate_up_us=t1, down_us=t2, tried={"gate_up": tried1, "down": tried2})
        row["looked_up_ratio"] = row["looked_up_us"] / floor
        row["searched_ratio"] = row["searched_us"] / floor
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
               if k != "tried"}, flush=True)
        out.append(row)
    path = Path(os.environ.get("OUT", ".")) / "ep_local_probe.json"
    path.write_text(json.dumps({"model": model, "ep": ep, "points": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
