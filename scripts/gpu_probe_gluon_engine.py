"""Probe: where the triton_kernel runner's Gluon engine spends a large-batch call, and which
GluonConfig moves it, beside the `triton` runner (same routing, same inputs, timed in turns).

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_probe_gluon_engine.py  # $OUT/gluon_engine.json

Pieces (CUDA-graph replay each): route (BM 128), gather of x into sorted rows, gate_up, down
(reduce 'sum'), sum over K; then whole calls for each config in CONFIGS.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import write_probe

from moekit.bench import time_ms
from moekit.runners.triton import ops as triton_ops
from moekit.runners.triton.ops import kernel_inputs, sum_topk
from moekit.runners.triton_kernel import gluon_ops
from moekit.runners.triton_kernel.routing import route
from moekit.tune import random_weights, shape_for, uniform_topk

POINTS = [("qwen3-30b-a3b", 1, 1, 4096), ("qwen3-30b-a3b", 1, 1, 16384),
          ("gpt-oss-120b", 1, 1, 16384), ("gpt-oss-120b", 1, 1, 4096),
          ("mixtral-8x7b", 2, 1, 4096)]  # fmt: skip
D = gluon_ops.DEFAULT
CONFIGS = {
    "default": D,
    "atomic": replace(D, reduce="atomic"),
    "g4": replace(D, group_m=4),
    "g16": replace(D, group_m=16),
    "gu_bn64_s6": replace(D, gate_up_block_n=64, gate_up_stages=6),
    "dn_bn128_s6": replace(D, down_block_n=128, down_stages=6),
    "gu_k128_s2": replace(D, gate_up_block_k=128, gate_up_stages=2),
    "dn_k128_s2": replace(D, down_block_k=128, down_stages=2),
}


def main() -> None:
    dev = torch.device("cuda")
    recs = []
    for model, tp, ep, T in POINTS:
        shape = shape_for(model, tp, ep)
        w = random_weights(shape, dev)
        act = shape.act
        gen = torch.Generator(device=dev).manual_seed(T)
        topk = uniform_topk(T, shape.num_experts, shape.top_k, dev, gen)
        x = torch.randn(T, shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        x_TH, ids, weights = kernel_inputs(x, topk)
        K, E = shape.top_k, shape.num_experts
        r = route(ids, E, 128)
        xs = torch.index_select(x_TH, 0, r.sorted_pairs // K)
        h = gluon_ops.gate_up(xs, r, w, act, D)
        y = torch.empty(T * K, shape.hidden, dtype=x.dtype, device=dev)
        gluon_ops.down(h, r, w, D, weights.view(-1), K, y)
        pieces = {
            "route": time_ms(lambda: route(ids, E, 128), dev),
            "gather": time_ms(
                lambda: torch.index_select(x_TH, 0, r.sorted_pairs // K, out=xs), dev
            ),
            "gate_up": time_ms(lambda: gluon_ops.gate_up(xs, r, w, act, D, h), dev),
            "down": time_ms(lambda: gluon_ops.down(h, r, w, D, weights.view(-1), K, y), dev),
            "sum": time_ms(lambda: sum_topk(y, ids, E, torch.empty_like(x_TH)), dev),
        }
        ref = triton_ops.fused_moe(x, topk, w, act).float()
        calls = {}
        for _ in range(3):  # rounds in turns
            for name, fn in [("triton runner", lambda: triton_ops.fused_moe(x, topk, w, act))] + [
                (n, (lambda c=c: gluon_ops.fused_moe(x_TH, ids, weights, w, act, c)))
                for n, c in CONFIGS.items()
            ]:
                try:
                    calls.setdefault(name, []).append(time_ms(fn, dev))
                except Exception as exc:  # noqa: BLE001 - a failing config is a result
                    calls[name] = [f"{type(exc).__name__}: {exc}"[:300]]
        errs = {}
        for n, c in CONFIGS.items():
            try:
                out = gluon_ops.fused_moe(x_TH, ids, weights, w, act, c).float()
                errs[n] = ((out - ref).norm() / ref.norm()).item()
            except Exception as exc:  # noqa: BLE001
                errs[n] = str(exc)[:200]
        best = {n: min(v) if all(isinstance(t, float) for t in v) else v for n, v in calls.items()}
        rec = {"model": model, "T": T, "pieces_ms": pieces, "calls_ms": best,
               "rel_err_vs_triton": errs, "configs": {n: asdict(c) for n, c in CONFIGS.items()}}
        base = best["triton runner"]
        print(model, T, {k: round(v, 3) for k, v in pieces.items()})
        for n, v in best.items():
            line = v if isinstance(v, list) else f"{v:.3f} ms  triton/this {base / v:.3f}"
            print("   ", n.ljust(14), line, "err", errs.get(n, ""))
        recs.append(rec)
        w = None  # free the weights before the next shape's
        torch.cuda.empty_cache()
    write_probe("gluon_engine.json", {"results": recs})


if __name__ == "__main__":
    main()
