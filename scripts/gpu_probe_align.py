"""Probe: the one-program token alignment by counting (`AlignTuning.few`, `_align_few_kernel`)
against the sorting one (`_align_small_kernel`), alone and through the layer.

    PYTHONPATH=src python3 scripts/gpu_probe_align.py      # writes $OUT/align_probe.json

Alone: `align_block_size` under CUDA-graph replay (`moekit.bench.time_ms_interleaved`), both
kernels in turns, for (pairs, experts, block_m) of the decode calls of the presets; the outputs
are compared (sorted ids, block experts, row count). Layer: `MoE.forward_topk` with the
`triton` runner as `moekit bench` times it, the two alignments in turns.
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
from moekit.runners import _align
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, _l2_bytes, build_layer, layer_over_sets

ALONE = [(P, E, bm) for E in (8, 32, 128) for P in (8, 32, 128, 256) for bm in (1, 16, 64)]
LAYER_JOBS = (("qwen3-30b-a3b", 1, 1, "unquantized"), ("qwen3-30b-a3b", 1, 1, "fp8_w8a8"),
              ("gpt-oss-120b", 1, 1, "unquantized"), ("mixtral-8x7b", 2, 1, "unquantized"),
              ("qwen3-30b-a3b", 1, 1, "mxfp4"))  # fmt: skip
LAYER_T = (4, 16, 64)
TUNINGS = {"sort": replace(_align.ALIGN_TUNING, few=False), "few": _align.ALIGN_TUNING}


def alone() -> dict:
    res = {}
    gen = torch.Generator().manual_seed(0)
    for P, E, bm in ALONE:
        ids = torch.randint(0, E, (P,), generator=gen, dtype=torch.int32).cuda().view(P, 1)
        outs = {n: _align.align_block_size(ids, E, bm, t) for n, t in TUNINGS.items()}
        a, b = outs["sort"], outs["few"]
        n = int(a.num_rows.item())
        same = (n == int(b.num_rows.item()) and torch.equal(a.sorted_ids[:n], b.sorted_ids[:n])
                and torch.equal(a.block_expert, b.block_expert))  # fmt: skip
        fns = {k: (lambda t=t: _align.align_block_size(ids, E, bm, t)) for k, t in TUNINGS.items()}
        ms = time_ms_interleaved(fns, "cuda", rounds=4, samples=40)
        key = f"P={P} E={E} bm={bm}"
        res[key] = {"us": {k: round(v * 1e3, 2) for k, v in ms.items()}, "same": same}
        print(key, res[key], flush=True)
    return res


def layer() -> dict:
    res = {}
    for model, tp, ep, quant in LAYER_JOBS:
        spec = sweep_spec(model, tp_size=tp, ep_size=ep, quantization=quant,
                          batch_sizes=LAYER_T, backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        gen = torch.Generator().manual_seed(0)
        for T in LAYER_T:
            sets, _, _ = _input_sets(spec, module, T, gen, _l2_bytes("cuda"))
            fns = {n: layer_over_sets(module, sets,
                                      lambda t=t: mock.patch.object(_align, "ALIGN_TUNING", t))
                   for n, t in TUNINGS.items()}  # fmt: skip
            ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            key = f"{model} tp{tp} ep{ep} {quant} T={T}"
            res[key] = {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()}
            print(key, res[key], flush=True)
        del module
        torch.cuda.empty_cache()
    return res


def main() -> None:
    out = {"meta": metadata(command=" ".join(["python", *sys.argv])), "alone_us": alone()}
    path = os.path.join(os.environ.get("OUT", "."), "align_probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    out["layer_us"] = layer()
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
