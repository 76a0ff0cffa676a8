"""The routing of the presets: `select_experts` (PyTorch ops) against `select_experts_fused` (one
Triton kernel), timed in turns under CUDA-graph replay, with the picks compared.

For each preset's routing (softmax top-k, or DeepSeek-V3 / Kimi-K2's sigmoid with a correction
bias and grouped top-k) and each batch size, both functions route the same bf16 logits; the probe
reports us per call of each, their ratio, and the tokens whose experts differ (near-ties only).

    PYTHONPATH=src python3 scripts/gpu_probe_router.py [--batches 1,4,16,64,256,1024,4096,16384]
        [--models qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,kimi-k2,gpt-oss-120b]

Writes $OUT/router.json. Runs on the CPU too (interpreter; a smoke test, no timing worth reading).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import time_ms_interleaved
from moekit.presets import PRESETS
from moekit.router import select_experts, select_experts_fused


def _kwargs(cfg, bias) -> dict:
    return dict(scoring_func=cfg.scoring_func, renormalize=cfg.renormalize,
                num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group,
                correction_bias_E=bias, routed_scaling_factor=cfg.routed_scaling_factor,
                num_fused_shared_experts=cfg.num_shared_experts)  # fmt: skip


def main() -> None:
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    default = "1,4,16,64,256,1024,4096,16384" if on_gpu else "1,5"
    batches = [int(b) for b in option("--batches", default).split(",")]
    models = option("--models", "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,kimi-k2,gpt-oss-120b")
    rows = []
    for name in models.split(","):
        cfg = PRESETS[name]
        E, K = cfg.num_experts, cfg.top_k
        bias = torch.randn(E, device=dev) * 0.01 if cfg.use_correction_bias else None
        kw = _kwargs(cfg, bias)
        for T in batches:
            logits = torch.randn(T, E, device=dev, dtype=torch.bfloat16)
            ref = select_experts(logits, K, **kw)
            out = select_experts_fused(logits, K, **kw)
            differ = int((ref.ids.sort(-1).values != out.ids.sort(-1).values).any(-1).sum())
            ms = time_ms_interleaved(
                {"torch": lambda lg=logits, k=K, kw=kw: select_experts(lg, k, **kw),
                 "fused": lambda lg=logits, k=K, kw=kw: select_experts_fused(lg, k, **kw)},
                dev, cuda_graph=on_gpu, rounds=8, samples=32,
            )  # fmt: skip
            row = {"model": name, "T": T, "torch_us": round(ms["torch"] * 1e3, 2),
                   "fused_us": round(ms["fused"] * 1e3, 2),
                   "torch_over_fused": round(ms["torch"] / ms["fused"], 3),
                   "tokens_differing": differ}  # fmt: skip
            rows.append(row)
            print(f"{name:16s} T={T:6d}  torch {row['torch_us']:8.2f} us  fused "
                  f"{row['fused_us']:8.2f} us  x{row['torch_over_fused']:.2f}  differ {differ}")
    write_probe("router.json", {"rows": rows})


if __name__ == "__main__":
    main()
