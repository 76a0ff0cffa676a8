"""Partly filled blocks computed on fewer rows (`PipelineConfig.tail_levels`, `.tail_gemms`), timed
through the layer in turns against whole tiles, with a balanced routing (every expert exactly
T * K / E pairs: no partly filled block) as the bound of what padding costs.

    PYTHONPATH=src python3 scripts/gpu_probe_tail.py [--jobs 'J1;J2'] [--batches 1024,4096,16384]
        [--variants 1,2] [--out NAME]

A job is `preset tp ep format`. A variant is a number of tail levels L for both GEMMs at every
batch size (`L`), for gate_up only (`Lg`), the PipelineConfig as shipped (`shipped`), or that
with short last blocks folded into the block before (`foldR`, `foldRg`, `foldRd`: fold_rows R,
both GEMMs / gate_up / down; `foldRxL`: in L levels). Per point: microseconds of `tail0` (whole tiles), of each variant
(`tail` + its name), of `balanced` (tail0 on the balanced routing; its floor is the same), and
the largest relative difference of each variant's output from tail0's. Writes $OUT/NAME.json
(default tail.json).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.router import TopKOutput
from moekit.runners.triton import ops
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets, rel_err

JOBS = ("qwen3-30b-a3b 1 1 unquantized;mixtral-8x7b 2 1 unquantized;"
        "deepseek-v3 8 8 unquantized;gpt-oss-120b 1 1 unquantized")  # fmt: skip



def _pipeline(variant: str):
    """`L`: L tail levels for both GEMMs at every batch size (no folding); `Lg`: for gate_up only;
    `shipped`: the PipelineConfig as shipped; `foldR` / `foldRg` / `foldRd`: as shipped with
    fold_rows R (one level; `foldRxL`: L levels) for both GEMMs / gate_up only / down only
    ("fold0": none)."""
    if variant == "shipped":
        return ops.PIPELINE
    if variant.startswith("fold"):
        gemms = {"g": ("gate_up",), "d": ("down",)}.get(variant[-1], ("gate_up", "down"))
        rows, _, levels = variant[4:].rstrip("gd").partition("x")
        return replace(ops.PIPELINE, fold_rows=int(rows), fold_levels=int(levels or 1),
                       fold_gemms=gemms)
    gemms = ("gate_up",) if variant.endswith("g") else ("gate_up", "down")
    levels = int(variant.rstrip("g"))
    return replace(ops.PIPELINE, tail_levels=levels, few_blocks_tail_levels=levels,
                   tail_gemms=gemms, fold_rows=0)  # fmt: skip


def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", "1024,4096,16384").split(",")]
    variants = ["0"] + option("--variants", "1,2").split(",")
    name = option("--out", "tail") + ".json"
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for model, tp, ep, fmt in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=fmt,
                          batch_sizes=tuple(batches), backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        K, E_all, H = spec.moe.top_k, spec.moe.num_experts, spec.moe.hidden_size
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))
            ids = (torch.arange(T * K, device="cuda", dtype=torch.int32) % E_all).view(T, K)
            balanced = [(torch.randn(T, H, device="cuda", dtype=torch.bfloat16),
                         TopKOutput(torch.rand(T, K, device="cuda"), ids))]  # fmt: skip
            pipes = {f"tail{v}": _pipeline(v) for v in variants}
            x0, topk0 = sets[0]
            outs = {}
            for n, p in pipes.items():
                with mock.patch.object(ops, "PIPELINE", p), torch.no_grad():
                    outs[n] = module.forward_topk(x0, topk0).float()
            fns = {n: layer_over_sets(module, sets, lambda p=p: mock.patch.object(ops, "PIPELINE", p))
                   for n, p in pipes.items()}  # fmt: skip
            tail0 = pipes["tail0"]
            fns["balanced"] = layer_over_sets(module, balanced,
                                              lambda: mock.patch.object(ops, "PIPELINE", tail0))  # fmt: skip
            ms = time_ms_interleaved(fns, "cuda", rounds=4, samples=16)
            us = {n: round(v * 1e3 / (1 if n == "balanced" else len(sets)), 1) for n, v in ms.items()}
            point = f"{model} tp{tp} ep{ep} {fmt} T={T}"
            res["points"][point] = {
                "us": us,
                "gain_over_tail0": {n: round(us["tail0"] / v, 4) for n, v in us.items()},
                "rel_err_vs_tail0": {n: rel_err(o, outs["tail0"]) for n, o in outs.items()},
            }
            print(point, us, {n: round(us["tail0"] / v, 3) for n, v in us.items()},
                  {n: f"{rel_err(o, outs['tail0']):.1e}" for n, o in outs.items()}, flush=True)  # fmt: skip
            write_probe(name, res)
        del module
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
