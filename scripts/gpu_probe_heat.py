"""Does a layer's time depend on the load that ran before it, and does the roofline's matmul
ceiling move with it? (The ceilings of `moekit bench` are measured once, at the start of a run,
with the GPU cool; a sweep then runs minutes of large GEMMs.)

    PYTHONPATH=src python3 scripts/gpu_probe_heat.py [--model M --tp N --T T --heat-s S]
        # writes $OUT/heat.json

Steps: (cold) the ceilings (`measure_ceilings`), the layer (the triton runner, CUDA-graph
replay) and the 8192^3 bf16 matmul of the ceiling, each on its own; then HEAT_S seconds of the
layer back to back; then (hot) the same three again; then the layer and the matmul timed in
turns (`time_ms_interleaved`). The SM clock and power are read from nvidia-smi at each step.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from moekit.bench import best_ms, measure_ceilings, time_ms, time_ms_interleaved
from moekit.runners.triton import ops
from moekit.tune import random_weights, shape_for, uniform_topk

sys.path.insert(0, str(Path(__file__).parent))
from probe_out import write_probe


def _opt(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def smi() -> str:
    q = "clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    return r.stdout.strip()


def main() -> None:
    model, tp = _opt("--model", "mixtral-8x7b"), int(_opt("--tp", "2"))
    T, heat_s = int(_opt("--T", "4096")), float(_opt("--heat-s", "60"))
    dev = torch.device("cuda")
    shape = shape_for(model, tp, 1)
    torch.manual_seed(0)
    w = random_weights(shape, dev)
    x = torch.randn(T, shape.hidden, device=dev, dtype=torch.bfloat16)
    topk = uniform_topk(T, shape.num_experts, shape.top_k, dev)

    def layer():
        return ops.fused_moe(x, topk, w, shape.act)

    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def gemm():
        return a @ b

    out = {"model": model, "tp": tp, "T": T,
           "heat_s": heat_s, "steps": []}  # fmt: skip

    def record(step: str, **vals):
        vals = {k: round(v, 4) if isinstance(v, float) else v for k, v in vals.items()}
        out["steps"].append({"step": step, "smi": smi(), **vals})
        print(step, vals, smi(), flush=True)

    c = measure_ceilings(dev)
    record("cold", ceiling_tflops=c.matmul_flops_per_s / 1e12, layer_ms=time_ms(layer, dev),
           gemm_best_ms=best_ms(gemm, dev), gemm_median_ms=time_ms(gemm, dev, cuda_graph=False))  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < heat_s:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        calls += 20
    record("after_heat", calls=calls)
    c = measure_ceilings(dev)
    record("hot", ceiling_tflops=c.matmul_flops_per_s / 1e12, layer_ms=time_ms(layer, dev),
           gemm_best_ms=best_ms(gemm, dev), gemm_median_ms=time_ms(gemm, dev, cuda_graph=False))  # fmt: skip
    ms = time_ms_interleaved({"layer": layer, "gemm": gemm}, dev,
                             cuda_graph={"layer": True, "gemm": False}, rounds=5)  # fmt: skip
    record("interleaved", layer_ms=ms["layer"], gemm_ms=ms["gemm"])
    write_probe("heat.json", out)


if __name__ == "__main__":
    main()
