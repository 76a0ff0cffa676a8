"""The `triton` runner's configs for the masked format (x [E, C, H] with counts [E]) timed in
turns against each other: the heuristic (`default_config` adapted to the format, at C and at
the mean rows per expert), the runner's choice (`ops.masked_configs`: the shape's tuned table
at C rows per expert since session 71), the tuned table looked up at the mean rows per expert
(an oracle), and with PROBE_TILES=1 candidate tiles for one GEMM at a time (the other GEMM kept
at the heuristic's); deep_gemm's masked GEMMs with `expected_m` the capacity (its default) or
the mean, for comparison. deepseek-v3 EP8's local shape (E=32, H=7168, I=2048), fp8 block-wise
weights (whose heuristic tiles spill registers at C = 64 and 512: benchmarks/triton_notes.md,
session 70) and bf16. CUDA-graph replay; each config's output is checked against the
heuristic's on the valid rows.

Usage (repo root, device machine): OUT=dir python scripts/gpu_probe_masked_configs.py
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, replace

import torch

from moekit.bench import time_ms_interleaved
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import quantize_experts
from moekit.report import metadata
from moekit.runners import registry
from moekit.runners._tables import device_key
from moekit.runners.triton import ops
from moekit.runners.triton.configs import adapt_config, default_config, get_config
from moekit.runners.triton.ops import quant_tag
from moekit.stages import MaskedDispatchOutput

E, K, H, I = 32, 8, 7168, 2048
# (mean rows per expert, capacity C); a low-latency all-to-all's C is ranks x its per-rank
# token cap (8 x 128), far above the mean rows at decode batches
CASES = [(4, 1024), (16, 1024), (1, 64), (16, 64), (64, 128), (256, 512)]
# (block_m, block_n, num_warps) per GEMM; block_m above C is skipped
TILES = {
    "gate_up": [(64, 64, 8), (64, 32, 4), (64, 128, 8)],
    "down": [(64, 128, 4), (128, 64, 8), (64, 256, 8)],
}


def heuristic(rows: float, w: ExpertWeights) -> tuple:
    """The heuristic configs at `rows` rows per expert (the runner's choice before session 71)."""
    quant = quant_tag(w.spec)
    return tuple(adapt_config(default_config(g, rows, n, k), quant, g)
                 for g, n, k in (("gate_up", 2 * I, H), ("down", H, I)))  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    act = ActivationSpec("silu")
    base = ExpertWeights((torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16(),
                         (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16())  # fmt: skip
    out = {"meta": metadata(command=" ".join(["python", *sys.argv]))}
    for fmt in ("fp8_w8a8", "unquantized"):
        w = base if fmt == "unquantized" else quantize_experts(base, "fp8_w8a8")
        for mean, C in CASES:
            counts = torch.poisson(torch.full((E,), float(mean))).clamp(max=C).int().cuda()
            x = torch.randn(E, C, H, device="cuda").bfloat16()
            valid = torch.arange(C, device="cuda")[None, :] < counts[:, None]
            heur = heuristic(C, w)
            ref = ops.fused_moe_masked(x, counts, w, act, heur).float()[valid]
            pairs = {"heuristic": heur, "heuristic at mean": heuristic(mean, w),
                     "runner's choice": ops.masked_configs(C, w, x.dtype, x.device)}  # fmt: skip
            for i, gemm in enumerate(("gate_up", "down")):
                for bm, bn, warps in TILES[gemm] if os.environ.get("PROBE_TILES") == "1" else ():
                    if bm > max(C, 64):
                        continue
                    cfg = replace(heur[i], block_m=bm, block_n=bn, num_warps=warps,
                                  num_stages=4 if bm <= 64 else 3)  # fmt: skip
                    if cfg != heur[i]:
                        pairs[f"{gemm} {bm}x{bn} w{warps}"] = (
                            (cfg, heur[1]) if i == 0 else (heur[0], cfg))
            # the shape's tuned tables (standard format), looked up as if every expert had
            # `rows` rows: the capacity (known on the host) or the mean (an oracle)
            dev, cap = device_key(x.device)
            for what, rows in (("table at C", C), ("table at mean", mean)):
                cfgs = tuple(get_config(g, rows * E / K, K, E, H, I, "bfloat16", dev,
                                        quant_tag(w.spec), cap) for g in ("gate_up", "down"))
                if min(c.block_m for c in cfgs) >= 16:  # block_m 1 is the direct rows' mode
                    pairs[what] = cfgs
            fns, errs = {}, {}
            for what, m in (("deep_gemm at C", None), ("deep_gemm at mean", mean)):
                dg = registry.runner_class("deep_gemm")(expected_m=m)
                d = MaskedDispatchOutput(x, counts)
                try:
                    got = dg.run(d, w, act).out.float()[valid]
                except Exception as e:  # noqa: BLE001 - not installed here: say why
                    errs[what] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                    pairs[what] = ()
                    continue
                pairs[what] = ()
                errs[what] = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                fns[what] = lambda a=(dg, d, w, act): a[0].run(*a[1:])
            for name, cfgs in pairs.items():
                if not cfgs:
                    continue
                try:
                    got = ops.fused_moe_masked(x, counts, w, act, cfgs).float()[valid]
                except Exception as e:  # noqa: BLE001 - a tile that does not build says why
                    errs[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                    continue
                errs[name] = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                fns[name] = lambda a=(x, counts, w, act, cfgs): ops.fused_moe_masked(*a)
            ms = time_ms_interleaved(fns, "cuda")
            key = f"{fmt} mean={mean} C={C} rows={int(counts.sum())}"
            out[key] = {n: {"ms": ms.get(n), "diff": errs[n],
                            "configs": [asdict(c) for c in pairs[n]]} for n in pairs}  # fmt: skip
            print(key, flush=True)
            for n in pairs:
                rel = f"{ms[n] / ms['heuristic']:.3f}" if n in ms else "-"
                print(f"  {n:24s} {ms.get(n, float('nan')):.4f} ms  x{rel}  diff {errs[n]}",
                      flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "."), "masked_configs.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
