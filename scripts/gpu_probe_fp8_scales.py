"""fp8 weight scale granularity at decode batches: the `triton` runner's call (`ops.fused_moe`,
CUDA-graph replay, routings rotated so the weights do not sit in L2) with bf16 weights, fp8
block-wise weights (128 x 128 blocks, per-token-group activations: a scale product every K
step) and fp8 per-channel weights (per-token activations: the scales once, in the epilogue),
timed in turns on the same inputs.

    PYTHONPATH=src python3 scripts/gpu_probe_fp8_scales.py [--jobs 'preset tp ep;...']
        [--batches 1,4,16,64] [--out NAME]

The channel layer runs with its own configs (the lookup's fallback), with the block-wise
layer's (`channel@block`) and with those at K steps of 256 (`channel@block-k256`: two scale
groups' worth a step, which block scales do not allow); bf16 also with the block-wise layer's
configs (`bf16@block`: the same tiles). Writes $OUT/NAME.json (default fp8_scales.json): per point the
microseconds of each and bf16 over each fp8 variant.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import time_ms_interleaved
from moekit.quant import Fp8W8A8, quantize_experts
from moekit.runners.triton import ops
from moekit.tune import _Point, random_weights, shape_for


def main() -> None:
    jobs = [j.split() for j in option("--jobs", "qwen3-30b-a3b 1 1;deepseek-v3 8 8").split(";")]
    batches = [int(b) for b in option("--batches", "1,4,16,64").split(",")]
    name = option("--out", "fp8_scales") + ".json"
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for model, tp, ep in jobs:
        shape = shape_for(model, int(tp), int(ep))
        torch.manual_seed(0)
        bf16 = random_weights(shape, "cuda")
        layers = {"bf16": bf16, "block": quantize_experts(bf16, Fp8W8A8("block")),
                  "channel": quantize_experts(bf16, Fp8W8A8("channel"))}  # fmt: skip
        for T in batches:
            p = _Point(shape, bf16, T, "cuda", seed=T)
            n = T * shape.local_share
            cfgs = {k: ops.configs_for(n, shape.top_k, w, p.x.dtype, p.x.device)
                    for k, w in layers.items()}  # fmt: skip
            runs = {k: (w, cfgs[k]) for k, w in layers.items()}
            runs["channel@block"] = (layers["channel"], cfgs["block"])
            k256 = tuple(replace(c, block_k=256) for c in cfgs["block"])
            runs["channel@block-k256"] = (layers["channel"], k256)
            runs["bf16@block"] = (bf16, cfgs["block"])

            def make(w, c):
                def call():
                    for t in p.topks:
                        ops.fused_moe(p.x, t, w, shape.act, configs=c,
                                      local_share=shape.local_share)  # fmt: skip

                return call

            ms = time_ms_interleaved({k: make(*v) for k, v in runs.items()}, "cuda", rounds=6,
                                     samples=36)  # fmt: skip
            us = {k: round(v * 1e3 / p.R, 2) for k, v in ms.items()}
            ratio = {k: round(us["bf16"] / v, 3) for k, v in us.items() if k != "bf16"}
            point = f"{model} tp{tp} ep{ep} T={T}"
            res["points"][point] = {"us": us, "bf16_over": ratio,
                                    "configs": {k: [c.code() for c in v[1]] for k, v in runs.items()}}  # fmt: skip
            print(point, us, ratio, flush=True)
            write_probe(name, res)


if __name__ == "__main__":
    main()
