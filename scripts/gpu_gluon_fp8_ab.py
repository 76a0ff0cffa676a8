"""fp8 block-wise in the triton_kernel runner's Gluon engine: config variants against each
other and against the bf16 `triton` runner, timed in turns (`moekit.bench.time_ms_interleaved`).

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_gluon_fp8_ab.py   # $OUT/gluon_fp8_ab.json

Per preset shape (uniform random routing, deepseek-v3 EP8 with every pair local) and T in
BATCHES: bf16 `triton` on the unquantized weights, and the engine on the same weights quantized
to fp8 (128 x 128 blocks) with `gluon_ops.FP8` and its VARIANTS (gate and up in one wgmma,
stage counts), each checked against the torch runner's fp8 math first.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import write_probe

from moekit.bench import time_ms_interleaved
from moekit.quant import quantize_experts
from moekit.runners.torch import TorchRunner
from moekit.runners.triton import ops as triton_ops
from moekit.runners.triton.ops import kernel_inputs
from moekit.runners.triton_kernel import gluon_ops
from moekit.stages import StandardDispatchOutput
from moekit.tune import random_weights, shape_for, uniform_topk

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip
BATCHES = tuple(int(t) for t in os.environ.get("AB_BATCHES", "4096,16384").split(","))
ROUNDS = int(os.environ.get("AB_ROUNDS", "5"))
VARIANTS = {
    "fp8": gluon_ops.FP8,
    "fused": replace(gluon_ops.FP8, gate_up_fused=True),
    "fused_s6": replace(gluon_ops.FP8, gate_up_fused=True, gate_up_stages=6, down_stages=6),
    "s6": replace(gluon_ops.FP8, gate_up_stages=6, down_stages=6),
}


def main() -> None:
    dev = torch.device("cuda")
    recs = []
    for model, (tp, ep) in PRESETS.items():
        shape = shape_for(model, tp, ep)
        w = random_weights(shape, dev)
        wq = quantize_experts(w, "fp8_w8a8")
        act, E, K = shape.act, shape.num_experts, shape.top_k
        for T in BATCHES:
            gen = torch.Generator(device=dev).manual_seed(T)
            topk = uniform_topk(T, E, K, dev, gen)
            x = torch.randn(T, shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
            x_TH, ids, weights = kernel_inputs(x, topk)
            fns = {"bf16 triton": lambda: triton_ops.fused_moe(x, topk, w, act)}
            for name, cfg in VARIANTS.items():
                fns[name] = (lambda c=cfg: gluon_ops.fused_moe(x_TH, ids, weights, wq, act, c))
            ref = TorchRunner().run(StandardDispatchOutput(x, topk), wq, act).out.float()
            errs = {n: ((fns[n]().float() - ref).norm() / ref.norm()).item() for n in VARIANTS}
            ms = time_ms_interleaved(fns, dev, rounds=ROUNDS)
            rec = {"model": model, "T": T, "ms": ms, "rel_err_vs_torch_fp8": errs,
                   "bf16_triton_over": {n: ms["bf16 triton"] / ms[n] for n in VARIANTS}}  # fmt: skip
            print(f"{model:<15}{T:>6}  bf16 triton {ms['bf16 triton']:.3f}  " + "  ".join(
                f"{n} {ms[n]:.3f} ({rec['bf16_triton_over'][n]:.2f}x, err {errs[n]:.4f})"
                for n in VARIANTS), flush=True)  # fmt: skip
            recs.append(rec)
        w = wq = None
        torch.cuda.empty_cache()
    write_probe("gluon_fp8_ab.json", {"rounds": ROUNDS, "variants": {
        n: vars(c) for n, c in VARIANTS.items()}, "results": recs})  # fmt: skip


if __name__ == "__main__":
    main()
