"""Probe: the `triton` runner with the down GEMM as a programmatic dependent launch of gate_up
(`PIPELINE.pdl`) against plain launches, side by side in one run.

    PYTHONPATH=src python3 scripts/gpu_pdl_probe.py [--batches 1,4,16,64,256,1024]
        [--models qwen3-30b-a3b,...] [--quantization fp8_w8a8]   # writes $OUT/pdl_probe.json

Per preset shape (the `triton` issue's four) and batch size: 16 uniform routings rotated
inside the timed CUDA graph, `ops.fused_moe` with the configs the runner looks up, timed with
PDL on and off (alternating, best of two each), over the roofline floor of the same routings.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit.bench import measure_ceilings, moe_cost, time_ms
from moekit.quant import make_spec, quantize_experts
from moekit.runners.triton import ops
from moekit.tune import random_weights, shape_for, uniform_topk

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    batches = [int(b) for b in _option("--batches", "1,4,16,64,256,1024").split(",")]
    models = _option("--models", ",".join(PRESETS)).split(",")
    quant = _option("--quantization", "unquantized")
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev, torch.bfloat16)
    saved = ops.PIPELINE
    points = []
    for model in models:
        tp, ep = PRESETS[model]
        shape = shape_for(model, tp, ep)
        E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
        torch.manual_seed(0)
        w = random_weights(shape, dev)
        if quant != "unquantized":
            w = quantize_experts(w, make_spec(quant))
        for T in batches:
            gen = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
            topks = [uniform_topk(T, E, K, dev, gen) for _ in range(16)]
            floor = sum(moe_cost(t.ids, E, H, I).floor_s(ceil) for t in topks) / 16 * 1e6

            def layer():
                for t in topks:
                    ops.fused_moe(x, t, w, shape.act)

            us = {True: [], False: []}
            try:
                for _ in range(2):
                    for pdl in (False, True):
                        ops.PIPELINE = replace(saved, pdl=pdl)
                        us[pdl].append(time_ms(layer, dev, samples=11) * 1e3 / 16)
            finally:
                ops.PIPELINE = saved
            ops.PIPELINE = replace(saved, pdl=True)
            same = [torch.equal(ops.fused_moe(x, t, w, shape.act),
                                ops.fused_moe(x, t, w, shape.act)) for t in topks[:1]]
            ops.PIPELINE = saved
            p = {"model": model, "T": T, "quantization": quant, "floor_us": floor,
                 "plain_us": min(us[False]), "pdl_us": min(us[True]),
                 "plain_ratio": min(us[False]) / floor, "pdl_ratio": min(us[True]) / floor,
                 "speedup": min(us[False]) / min(us[True]), "repeatable": all(same)}
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items()},
                  flush=True)
            points.append(p)

        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / "pdl_probe.json"
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "points": points},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
