"""Host time of one eager MoE call, and where it goes.

A call issued without CUDA graphs costs host time (Python, Triton's launch path, aten launches)
besides its GPU time; at small batches the host time is the larger. For each layer shape and
batch size this times, host-bound (N calls queued back to back, one synchronize at the end,
so the per-call wall time is the host's), the pieces of the `triton` runner's path:

  torch_op        one small aten op (the machine's launch cost, for scale)
  empty_triton    a Triton kernel with one argument
  launches        the call's own Triton launches, replayed with their recorded arguments
  ops             moekit.runners.triton.ops.fused_moe
  functional      moekit.fused_moe(..., moe_runner_backend="triton")
  layer           moekit.MoE.forward (router included)

and the GPU time of the same call (CUDA-graph replay), then a cProfile of `functional` (the
functions with the most own time).

    PYTHONPATH=src python3 scripts/gpu_probe_host.py [--shapes qwen3-30b-a3b,gpt-oss-120b]
        [--batches 1,64] [--calls 300]

Writes $OUT/host_probe.json.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

import moekit
from moekit.bench import time_ms
from moekit.config import RunnerConfig
from moekit.experts import ActivationSpec
from moekit.presets import model_config
from moekit.runners.triton import ops


@triton.jit
def _empty(x_ptr):
    pass


def host_us(fn, calls: int) -> float:
    """Per-call wall time of `calls` back-to-back calls (one synchronize at the end)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return round(best, 1)


def recorded_launches(fn):
    """[(kernel, grid, args, meta)] of the Triton launches `ops._launch` makes in one fn()."""
    seen, real = [], ops._launch

    def spy(kernel, grid, args, meta, warmup):
        seen.append((kernel, grid, args, meta))
        return real(kernel, grid, args, meta, warmup)

    ops._launch = spy
    try:
        fn()
    finally:
        ops._launch = real
    return seen


def profile_text(fn, calls: int, lines: int = 28) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def point(preset: str, T: int, calls: int) -> dict:
    cfg = model_config(preset)
    module = moekit.MoE(cfg, runner=RunnerConfig("triton"), device="cuda")
    w = module.expert_weights
    act = ActivationSpec.from_config(cfg)
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(T, cfg.num_experts, device="cuda", generator=gen)
    topk = module.route(logits)
    act_kw = dict(activation=act.name, interleaved=act.interleaved, swiglu_alpha=act.alpha,
                  swiglu_limit=act.limit)  # fmt: skip
    a, b = torch.ones(8, device="cuda"), torch.ones(8, device="cuda")

    fns = {
        "torch_op": lambda: torch.add(a, b),
        "empty_triton": lambda: _empty[(1,)](a),
        "ops": lambda: ops.fused_moe(x, topk, w, act),
        "functional": lambda: moekit.fused_moe(
            x, w.w13, w.w2, topk.weights, topk.ids, b13=w.b13, b2=w.b2,
            moe_runner_backend="triton", **act_kw),
        "layer": lambda: module(x, logits),
    }  # fmt: skip
    launches = recorded_launches(fns["ops"])
    fns["launches"] = lambda: [k[g](*args, **meta) for k, g, args, meta in launches]
    res = {"preset": preset, "T": T, "triton_launches": len(launches),
           "host_us": {n: host_us(f, calls) for n, f in fns.items()},
           "gpu_us": round(time_ms(fns["ops"], "cuda", cuda_graph=True) * 1e3, 1),
           "profile_functional": profile_text(fns["functional"], calls)}  # fmt: skip
    print({k: v for k, v in res.items() if k != "profile_functional"})
    print(res["profile_functional"])
    return res


def main() -> None:
    presets = option("--shapes", "qwen3-30b-a3b,gpt-oss-120b").split(",")
    batches = [int(b) for b in option("--batches", "1,64").split(",")]
    calls = int(option("--calls", "300"))
    points = [point(p, T, calls) for p in presets for T in batches]
    write_probe("host_probe.json", {"calls": calls, "points": points})


if __name__ == "__main__":
    main()
