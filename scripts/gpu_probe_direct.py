"""Probe: direct rows (no alignment kernel; `PipelineConfig.direct_max_tokens`) against the
alignment at small batches, through the layer as `moekit bench` times it.

    PYTHONPATH=src python3 scripts/gpu_probe_direct.py [--batches 2,4,8,16] [--jobs 'm tp ep q;...']
                                                       # writes $OUT/direct_probe.json

Per job and T: `MoE.forward_topk` with the `triton` runner over rotated input sets (CUDA-graph
replay, `moekit.bench.time_ms_interleaved`), with the alignment ('align': direct rows at T = 1
only, as shipped) and with direct rows ('direct').
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from unittest import mock

import torch

from moekit.bench import time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.report import metadata
from moekit.runners.triton import ops
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, _l2_bytes, build_layer, layer_over_sets

JOBS = ("qwen3-30b-a3b 1 1 unquantized;qwen3-30b-a3b 1 1 fp8_w8a8;qwen3-30b-a3b 1 1 mxfp4;"
        "gpt-oss-120b 1 1 unquantized;mixtral-8x7b 2 1 unquantized;deepseek-v3 8 8 unquantized")


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    batches = [int(b) for b in _option("--batches", "2,4,8,16").split(",")]
    pipes = {"align": replace(ops.PIPELINE, direct_max_tokens=1),
             "direct": replace(ops.PIPELINE, direct_max_tokens=max(batches))}  # fmt: skip
    out = {"meta": metadata(command=" ".join(["python", *sys.argv])), "us": {}}
    for job in _option("--jobs", JOBS).split(";"):
        model, tp, ep, quant = job.split()
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=quant,
                          batch_sizes=tuple(batches), backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, _l2_bytes("cuda"))
            fns = {n: layer_over_sets(module, sets,
                                      lambda p=p: mock.patch.object(ops, "PIPELINE", p))
                   for n, p in pipes.items()}  # fmt: skip
            ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            key = f"{job} T={T}"
            out["us"][key] = r = {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()}
            print(key, r, f"{r['align'] / r['direct']:.3f}", flush=True)
            with open(os.path.join(os.environ.get("OUT", "."), "direct_probe.json"), "w") as f:
                json.dump(out, f, indent=1)
        del module
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
