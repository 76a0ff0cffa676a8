"""Where a decode call's time goes: the kernels of `moekit bench`'s timed call on a GPU timeline.

    PYTHONPATH=src python3 scripts/gpu_probe_decode_timeline.py [--jobs 'J1;J2'] [--batches 1,4]
        [--out NAME]

A job is `preset tp ep format backend` (e.g. 'deepseek-v3 8 8 mxfp4 w4a16'). Per job and batch
size T, the layer of rank 0 on the bench's input sets (MoE.forward_topk over every set, as
`moekit bench` times it) is captured in a CUDA graph and replayed under torch.profiler. From
the GPU kernel events of the replays: per set, the time from the first kernel's start to the
last kernel's end, the kernels' own time, the idle time between them (no kernel running), and
per kernel name its count and mean duration. In turns with it (`time_ms_interleaved`): the
layer, and the runner alone on the dispatched inputs (the dispatcher's local-id kernel and any
glue left out), so that the cost of the EP path is measured, not inferred.
Writes $OUT/NAME.json (default decode_timeline.json).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import capture_graph, l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache, run_experts
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

JOBS = ("qwen3-30b-a3b 1 1 unquantized triton;qwen3-30b-a3b 1 1 mxfp4 w4a16;"
        "deepseek-v3 8 8 unquantized triton;deepseek-v3 8 8 mxfp4 w4a16;"
        "gpt-oss-120b 1 1 unquantized triton;mixtral-8x7b 2 1 mxfp4 w4a16")  # fmt: skip
REPLAYS = 20


def runner_only(module, sets):
    """The runner on the dispatched inputs of every set (dispatch done once, here)."""
    with torch.no_grad():
        dispatched = [module.dispatcher.dispatch(x, topk) for x, topk in sets]

    @torch.no_grad()
    def fn():
        for d in dispatched:
            run_experts(d, module.expert_weights, module.act, module.runners)

    return fn


def timeline(fn, sets: int) -> dict:
    """Kernel events of REPLAYS graph replays of fn -> per-set span / busy / idle (us) and per
    kernel name (count per set, mean us)."""
    graph = capture_graph(fn, "cuda")
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(REPLAYS):
            graph.replay()
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events)
    per_name: dict[str, list[float]] = defaultdict(list)
    for s, t, n in spans:
        per_name[n[:80]].append(t - s)
    # every replay launches the same kernels, one replay after the other
    per_replay = len(spans) // REPLAYS
    replays = [spans[i * per_replay:(i + 1) * per_replay]
               for i in range(REPLAYS if per_replay else 0)]  # fmt: skip
    span = busy = 0.0
    for rep in replays:
        span += max(e[1] for e in rep) - rep[0][0]
        end = rep[0][0]
        for s, t, _ in rep:  # union of the kernel intervals
            busy += max(0.0, t - max(s, end))
            end = max(end, t)
    n_rep = max(1, len(replays))
    first = replays[0] if replays else []
    t0 = first[0][0] if first else 0.0
    sequence = [(n[:40], round(s - t0, 2), round(t - s, 2)) for s, t, n in first]
    per_set = n_rep * sets
    return {
        "replays": len(replays),
        "span_us_per_set": round(span / per_set, 2),
        "busy_us_per_set": round(busy / per_set, 2),
        "idle_us_per_set": round((span - busy) / per_set, 2),
        "first_replay": sequence,
        "kernels": {n: {"per_set": round(len(v) / per_set, 2), "mean_us": round(sum(v) / len(v), 2)}
                    for n, v in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))},
    }


def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", "1,4").split(",")]
    name = option("--out", "decode_timeline") + ".json"
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for model, tp, ep, fmt, backend in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=fmt,
                          batch_sizes=tuple(batches), backends=(backend,))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig(backend))
        gen = torch.Generator().manual_seed(spec.seed)
        for T in batches:
            sets, cost, ids = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))
            local = [sorted({int(e) for e in i.reshape(-1).tolist() if 0 <= e < spec.e_local})
                     for i in ids]
            layer = layer_over_sets(module, sets)
            runner = runner_only(module, sets)
            ms = time_ms_interleaved({"layer": layer, "runner": runner}, "cuda", rounds=6,
                                     samples=36)  # fmt: skip
            point = f"{model} tp{tp} ep{ep} {fmt} {backend} T={T}"
            res["points"][point] = {
                "sets": len(sets),
                "mean_bytes": cost.bytes,
                "local_experts_per_set": [len(e) for e in local],
                "us_per_set": {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()},
                "layer": timeline(layer, len(sets)),
                "runner": timeline(runner, len(sets)),
            }
            print(point, res["points"][point], flush=True)
    write_probe(name, res)


if __name__ == "__main__":
    main()
