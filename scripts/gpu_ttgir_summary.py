"""What the compiler made of the triton runner's GEMMs: run one call, then summarise the TTGIR
of every compiled kernel (wgmma waits and their `pendings`, async / TMA copies).

    PYTHONPATH=src python3 scripts/gpu_ttgir_summary.py LABEL [model:format:T ...]
        # writes $OUT/ttgir_LABEL.json

Default points: qwen3-30b-a3b and deepseek-v3 (EP8) in fp8 block-wise at T = 4096, and the
fp8 block-scaled grouped GEMM of scripts/gpu_probe_fp8_ws.py (variant 1, qwen3 gate_up) for
comparison. Why: with one scale per K group, Triton 3.6 waits for each wgmma before the next
(`pendings = 0`, benchmarks/triton_notes.md); this shows whether a Triton version still does,
kernel by kernel, under the configs the runner really uses.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import torch

from moekit.quant import quantize_experts
from moekit.runners.triton import _kernels, ops
from moekit.tune import random_weights, shape_for, uniform_topk

sys.path.insert(0, str(Path(__file__).parent))
import gpu_probe_fp8_ws as probe
from gpu_triton_quant import FORMATS
from probe_out import write_probe

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip
DEFAULT = ["qwen3-30b-a3b:fp8-block:4096", "deepseek-v3:fp8-block:4096"]
PATTERNS = {
    "wgmma": r"ttng\.warp_group_dot ",
    "async_copy": r"ttg\.async_copy_global_to_local",
    "tma_copy": r"ttng\.async_tma_copy_global_to_local",
}


def _compiled(fn) -> list:
    """Compiled variants of a JITFunction, whatever the Triton version keeps them in."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        out += list(kernels.values())
    return out


def _summary(name: str, kernel) -> dict:
    ttgir = kernel.asm.get("ttgir", "")
    rec = {k: len(re.findall(p, ttgir)) for k, p in PATTERNS.items()}
    rec["wait_pendings"] = dict(
        Counter(re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir))
    )
    rec["kernel"] = name
    rec["num_warps"] = kernel.metadata.num_warps
    rec["shared"] = kernel.metadata.shared
    return rec


def main() -> None:
    label = sys.argv[1]
    points = sys.argv[2:] or DEFAULT
    dev = torch.device("cuda")
    for item in points:
        model, fmt, T = item.split(":")
        shape = shape_for(model, *PRESETS[model])
        torch.manual_seed(0)
        w = random_weights(shape, dev)
        if fmt != "bf16":
            w = quantize_experts(w, FORMATS[fmt])
        gen = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(int(T), shape.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        topk = uniform_topk(int(T), shape.num_experts, shape.top_k, dev, gen)
        ops.fused_moe(x, topk, w, shape.act)
        del w
    torch.cuda.synchronize()
    probe_rec = probe._one("qwen3_gate_up", 1)
    recs = []
    for name in ("_gate_up_kernel", "_down_kernel"):
        recs += [_summary(name, k) for k in _compiled(getattr(_kernels, name))]
    recs += [_summary("probe _grouped_kernel", k) for k in _compiled(probe._grouped_kernel)]
    out = {"label": label, "points": points, "kernels": recs, "probe_timing": probe_rec}
    for r in recs:
        print(label, r, flush=True)
    write_probe(f"ttgir_{label}.json", out)


if __name__ == "__main__":
    main()
