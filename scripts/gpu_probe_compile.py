"""The MoE layer called eagerly against the same layer under torch.compile, per call.

Eager calls at small batches are host-bound: each costs the Python of the layer and the
runners' kernel launches, more than the GPU time. Under torch.compile the experts are one
custom op (`moekit.compiled`); mode="reduce-overhead" records the compiled layer in CUDA graphs.
For each preset layer (`auto` runner, bf16) and batch size, timed in turns, back to back (the
time per call a loop of calls sees, host gaps included; each sample at least 20 ms of calls,
so the first call's launch latency is spread over many):

  eager            layer(x, logits)
  compiled         torch.compile(layer, fullgraph=True)            (Inductor, no CUDA graphs)
  reduce_overhead  torch.compile(layer, mode="reduce-overhead", fullgraph=True)
  graph            the eager call captured in a CUDA graph by hand (its GPU time)

and the largest difference of the compiled outputs from eager.

    PYTHONPATH=src python3 scripts/gpu_probe_compile.py [--presets qwen3-30b-a3b:1,gpt-oss-120b:1]
        [--batches 1,4,64,512] [--rounds 5]

Writes $OUT/compile_probe.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit import MoE, ParallelConfig, RunnerConfig
from moekit.bench import time_ms_interleaved
from moekit.presets import model_config

VARIANTS = ("eager", "compiled", "reduce_overhead", "graph")


def probe(preset: str, tp: int, batches: list[int], rounds: int) -> list[dict]:
    torch._dynamo.reset()
    cfg = model_config(preset)
    m = MoE(cfg, ParallelConfig(tp_size=tp), RunnerConfig("auto"), device="cuda").eval()
    compiled = torch.compile(m, fullgraph=True)
    reduce = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    points = []
    for T in batches:
        gen = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(T, cfg.num_experts, device="cuda", generator=gen)
        outs, compile_s = {}, {}

        def call(name, fn, x=x, logits=logits, outs=outs):
            def run():
                with torch.no_grad():
                    outs[name] = fn(x, logits).clone()  # (a graph's output is reused)
            return run

        fns = {"eager": call("eager", m), "compiled": call("compiled", compiled),
               "reduce_overhead": call("reduce_overhead", reduce),
               "graph": call("graph", m)}  # fmt: skip
        for name in ("compiled", "reduce_overhead"):  # compile (and record) outside the timing
            t0 = time.perf_counter()
            for _ in range(3):
                fns[name]()
            torch.cuda.synchronize()
            compile_s[name] = round(time.perf_counter() - t0, 1)
        ms = time_ms_interleaved(fns, "cuda", rounds=rounds, min_sample_ms=20.0,
                                 cuda_graph={v: v == "graph" for v in VARIANTS})  # fmt: skip
        fns["eager"]()
        for name in ("compiled", "reduce_overhead"):
            fns[name]()
        ref = outs["eager"].float()
        scale = ref.abs().max().clamp_min(1e-30)
        diff = {n: float((outs[n].float() - ref).abs().max() / scale)
                for n in ("compiled", "reduce_overhead")}  # fmt: skip
        us = {v: round(t * 1e3, 1) for v, t in ms.items()}
        point = {"preset": preset, "tp": tp, "T": T, "us": us,
                 "eager_over_reduce_overhead": round(us["eager"] / us["reduce_overhead"], 3),
                 "reduce_overhead_over_graph": round(us["reduce_overhead"] / us["graph"], 3),
                 "max_rel_diff_vs_eager": diff, "first_calls_s": compile_s}  # fmt: skip
        print(point, flush=True)
        points.append(point)
    del m, compiled, reduce
    torch.cuda.empty_cache()
    return points


def main() -> None:
    jobs = [p.split(":") for p in option("--presets", "qwen3-30b-a3b:1,gpt-oss-120b:1").split(",")]
    batches = [int(b) for b in option("--batches", "1,4,64,512").split(",")]
    rounds = int(option("--rounds", "5"))
    points = [pt for name, tp in jobs for pt in probe(name, int(tp), batches, rounds)]
    write_probe("compile_probe.json", {"rounds": rounds, "points": points})


if __name__ == "__main__":
    main()
