"""Does a decode call's time depend on where its weights were allocated?

The `triton` runner's T = 1 time is bimodal between processes (qwen3 33 / 39 us, gpt-oss 78 / 90
us for the same configs; benchmarks/triton_notes.md, "Why the misses"). This probe builds the
same preset layer several times in one process (each copy its own weight allocation; the last
copies after switching the caching allocator to expandable segments, which maps memory in 2 MiB
pieces), then times every copy on the same input sets as `moekit bench` does, in turns
(CUDA-graph replay). If the copies differ as the processes did, the placement of the weights in
memory is the cause; if they agree, it is something of the process or the GPU's state.

    PYTHONPATH=src python3 scripts/gpu_probe_weight_placement.py [--job 'qwen3-30b-a3b 1 1']
        [--batch 1] [--copies 4] [--expandable 2] [--backend triton]

Writes $OUT/weight_placement_<model>_T<batch>.json: us per call for each copy (the layer, and
`read:` a plain sum over the experts the input sets touch), and the w13 / w2 addresses' offsets
within 2 MiB, 32 MiB and 1 GiB.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, _runners, build_layer, layer_over_sets

MIB = 1 << 20


def _offsets(t: torch.Tensor) -> dict[str, int]:
    p = t.data_ptr()
    return {"mod_2MiB": p % (2 * MIB), "mod_32MiB_in_MiB": (p % (32 * MIB)) // MIB,
            "mod_1GiB_in_MiB": (p % (1024 * MIB)) // MIB}  # fmt: skip


def _read(m, touched: list[list[int]]):
    """A plain read (sum) of the experts each input set touches: the same bytes as the layer."""

    def fn():
        for experts in touched:
            for e in experts:
                m.w13[e].sum()
                m.w2[e].sum()

    return fn


def main() -> None:
    model, tp, ep = option("--job", "qwen3-30b-a3b 1 1").split()
    T = int(option("--batch", "1"))
    copies, expandable = int(option("--copies", "4")), int(option("--expandable", "2"))
    backend = option("--backend", "triton")
    spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), batch_sizes=(T,),
                      backends=(backend,))  # fmt: skip
    layers = {}
    for i in range(copies):
        layers[f"default{i}"] = build_layer(spec)
    if expandable and spec.device == "cuda":
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        for i in range(expandable):
            layers[f"expandable{i}"] = build_layer(spec)
    gen = torch.Generator().manual_seed(spec.seed)
    l2 = l2_cache_bytes(spec.device)
    sets, _, ids = _input_sets(spec, layers["default0"], T, gen, l2)
    touched = [sorted({int(e) for e in i.flatten().tolist() if e >= 0}) for i in ids]
    fns = {}
    for name, m in layers.items():
        cache = RunnerCache(RunnerConfig(backend))
        fns[name] = layer_over_sets(m, sets, lambda m=m, c=cache: _runners(m, c))
        fns[name]()  # compile / choose before the timing
        fns[f"read:{name}"] = _read(m, touched)
    ms = time_ms_interleaved(fns, spec.device, rounds=8, samples=32)
    res = {"job": f"{model} tp{tp} ep{ep}", "T": T, "backend": backend, "input_sets": len(sets),
           "us": {}, "placement": {}}  # fmt: skip
    for name, t in ms.items():
        us = t * 1e3 / len(sets)
        res["us"][name] = round(us, 2)
        if name.startswith("read:"):
            print(f"{name:20s} {us:9.2f} us")
            continue
        m = layers[name]
        res["placement"][name] = {"w13": _offsets(m.w13), "w2": _offsets(m.w2)}
        print(f"{name:20s} {us:9.2f} us  w13 {res['placement'][name]['w13']}  "
              f"w2 {res['placement'][name]['w2']}")
    for kind in ("layer", "read"):
        vals = [v for k, v in res["us"].items() if k.startswith("read:") == (kind == "read")]
        res[f"{kind}_max_over_min"] = round(max(vals) / min(vals), 4)
        print(f"{kind}: max / min over the copies: {res[f'{kind}_max_over_min']}")
    write_probe(f"weight_placement_{model}_T{T}.json", res)


if __name__ == "__main__":
    main()
