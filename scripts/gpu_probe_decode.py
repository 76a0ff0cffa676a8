"""Probe: where the time of a decode-size `triton` call goes (T = 1, 4, 16), through the layer
as `moekit bench` times it (MoE.forward_topk over rotated input sets, CUDA-graph replay).

    PYTHONPATH=src python3 scripts/gpu_probe_decode.py [--jobs 'qwen3-30b-a3b 1 1 mxfp4;...']
        [--batches 1,4,16] [--out NAME]                # writes $OUT/NAME.json (decode_probe)

Per (job, T): the kernels of one eager pass over the input sets (torch.profiler: name, count,
mean us), and CUDA-graph times (ms per set) of variants timed in turns
(`moekit.bench.time_ms_interleaved`):
  layer            forward_topk as shipped
  runner           the runner alone on the dispatched inputs (no dispatch / combine)
  torch_local_ids  EP jobs: the dispatcher's local ids from the ten-launch torch twin
  fused_act_quant  fp8 jobs at T = 1: the GEMMs quantize their own input rows
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache, run_experts
from moekit.report import metadata
from moekit.runners.triton import ops
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

JOBS = (
    ("qwen3-30b-a3b", 1, 1, "unquantized"),
    ("qwen3-30b-a3b", 1, 1, "fp8_w8a8"),
    ("deepseek-v3", 8, 8, "unquantized"),
    ("deepseek-v3", 8, 8, "fp8_w8a8"),
    ("gpt-oss-120b", 1, 1, "unquantized"),
)
DTYPE = "bfloat16"


def _kernels(fn) -> list[tuple[str, int, float]]:
    """[(kernel name, count, mean us)] of one eager fn() call, by total time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace).get("traceEvents", [])
    acc: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            acc.setdefault(e["name"][:80], []).append(float(e.get("dur", 0.0)))
    rows = [(n, len(v), sum(v) / len(v)) for n, v in acc.items()]
    return sorted(rows, key=lambda r: -r[1] * r[2])


def _point(module, spec, T, gen):
    sets, cost, _ = _input_sets(spec, module, T, gen, l2_cache_bytes(spec.device))
    n = len(sets)
    dispatched = [module.dispatcher.dispatch(x, t) for x, t in sets]

    layer = layer_over_sets(module, sets)

    def runner():
        for d in dispatched:
            run_experts(d, module.expert_weights, module.act, module.runners)

    fns = {"layer": layer, "runner": runner}
    slots = getattr(module.dispatcher, "_slots", None)
    if slots is not None and not getattr(module.dispatcher, "_identity", True):
        def torch_ids():
            for x, t in sets:
                local = slots.local_ids_torch(t.ids, module.dispatcher.ep_rank)
                d = replace(dispatched[0], x=x, topk=type(t)(t.weights, local))
                run_experts(d, module.expert_weights, module.act, module.runners)
        fns["torch_local_ids"] = torch_ids
    fp8 = spec.moe.weight_format == "fp8_w8a8"
    if fp8 and T == 1:
        fused = replace(ops.PIPELINE, fuse_act_quant=True)

        def fused_quant():
            ops.PIPELINE, saved = fused, ops.PIPELINE
            try:
                layer()
            finally:
                ops.PIPELINE = saved
        fns["fused_act_quant"] = fused_quant
    ms = time_ms_interleaved(fns, spec.device, rounds=5, samples=30)
    return {
        "sets": n,
        "pairs_per_set": cost.flops / (6 * spec.moe.hidden_size * module.expert_weights.intermediate_size),
        "ms_per_set": {k: v / n for k, v in ms.items()},
        "kernels_per_set": [(name, cnt / n, round(us, 2)) for name, cnt, us in _kernels(layer)],
    }


def main() -> None:
    out = {"meta": metadata(command=" ".join(["python", *sys.argv])), "points": {}}
    jobs = JOBS
    if "--jobs" in sys.argv:
        jobs = [(m, int(tp), int(ep), q) for m, tp, ep, q in
                (j.split() for j in option("--jobs", "").split(";"))]  # fmt: skip
    batches = tuple(int(b) for b in option("--batches", "1,4,16").split(","))
    for model, tp, ep, quant in jobs:
        spec = sweep_spec(model, tp_size=tp, ep_size=ep, dtype=DTYPE, quantization=quant,
                          batch_sizes=batches, routing="uniform", time_budget_s=None,
                          backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            key = f"{model} tp{tp} ep{ep} {quant} T={T}"
            try:
                with torch.no_grad():
                    out["points"][key] = r = _point(module, spec, T, gen)
                print(key, {k: round(v * 1e3, 2) for k, v in r["ms_per_set"].items()}, "us",
                      flush=True)
                for name, cnt, us in r["kernels_per_set"][:8]:
                    print(f"    {cnt:5.2f} x {us:7.2f} us  {name}", flush=True)
            except Exception as err:  # noqa: BLE001 - report and go on
                out["points"][key] = {"error": f"{type(err).__name__}: {err}"}
                print(key, "error", err, flush=True)
        del module
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    name = option("--out", "decode_probe") + ".json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
