"""Probe: does the Gluon engine's gate_up lose time on interleaved gate / up weights (two TMA
boxes over every other row, row stride 2H) against gate and up halves (contiguous boxes)?

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_probe_gluon_interleaved.py
        # $OUT/gluon_interleaved.json

gpt-oss-120b (interleaved) and qwen3-30b-a3b (not) at T = 4096 and 16384, bf16, uniform
routing: gate_up on the same weights read both ways (the other way computes a different
function; only its speed matters here) and down, timed in turns as CUDA-graph replays.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import write_probe

from moekit.bench import time_ms_interleaved
from moekit.runners.triton.ops import kernel_inputs
from moekit.runners.triton_kernel import gluon_ops
from moekit.runners.triton_kernel.routing import route
from moekit.tune import random_weights, seeded_batch, shape_for


def _point(shape, w, T: int, dev) -> dict:
    act = shape.act
    other = replace(act, interleaved=not act.interleaved)
    K, E = shape.top_k, shape.num_experts
    cfg = gluon_ops.config_for(w)
    x, topk = seeded_batch(shape, T, dev)
    x_TH, ids, weights = kernel_inputs(x, topk)
    r = route(ids, E, 128)
    h = gluon_ops.gate_up(x_TH, r, w, act, cfg, K)
    y = torch.empty(T * K, shape.hidden, dtype=x.dtype, device=dev)
    fns = {
        f"gate_up inter={act.interleaved}": lambda: gluon_ops.gate_up(x_TH, r, w, act, cfg, K, h),
        f"gate_up inter={other.interleaved}": lambda: gluon_ops.gate_up(x_TH, r, w, other, cfg,
                                                                         K, h),  # fmt: skip
        "down": lambda: gluon_ops.down(h, r, w, cfg, weights.view(-1), K, y),
    }
    return time_ms_interleaved(fns, dev, rounds=5)


def main() -> None:
    dev = torch.device("cuda")
    recs = []
    for model in ("gpt-oss-120b", "qwen3-30b-a3b"):
        shape = shape_for(model, 1, 1)
        w = random_weights(shape, dev)
        for T in (4096, 16384):
            ms = _point(shape, w, T, dev)
            print(model, T, {k: round(v, 4) for k, v in ms.items()}, flush=True)
            recs.append({"model": model, "T": T, "ms": ms})
        w = None
        torch.cuda.empty_cache()
    write_probe("gluon_interleaved.json", {"results": recs})


if __name__ == "__main__":
    main()
