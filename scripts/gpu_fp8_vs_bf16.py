"""fp8 block-wise against bf16 on the same routing, timed in turns (issue 4's large-batch ratio).

    PYTHONPATH=src python3 scripts/gpu_fp8_vs_bf16.py [--batches 4096,16384] [--fp8 auto,triton]
        [--models qwen3-30b-a3b,...] [--out NAME]    # writes $OUT/NAME.json (fp8_vs_bf16.json)

For each preset at the issue's parallel shape (mixtral-8x7b TP2, deepseek-v3 EP8 with rank 0
seeing every token, as `moekit bench` runs them) and each batch size: the bf16 layer on the
`triton` runner and the fp8_w8a8 (128x128 block, per-token-group activations) layer on each
backend of --fp8 (default `auto`, which takes deep_gemm at these sizes where installed), over
the same input sets (`moekit.sweep`'s routing, rotated past L2), timed together by
`moekit.bench.time_ms_interleaved` (CUDA-graph replay, alternating rounds). Why: `moekit bench`
sweeps bf16 and fp8 in separate jobs, minutes apart, and large-batch times move by 5-15% with
the GPU's heat (benchmarks/triton_notes.md), so the ratio is taken within one interleaved
timing. Prints bf16 / fp8 per point (issue 4's target: >= 1.5 at T >= 4096).
"""

from __future__ import annotations

import sys

import torch

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_out import layout_label, option, target_row, write_probe  # noqa: E402

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip  model: (tp, ep)


def _layer(model: str, tp: int, ep: int, fmt: str, T: int):
    spec = sweep_spec(model, tp_size=tp, ep_size=ep, quantization=fmt, batch_sizes=(T,),
                      device="cuda", backends=("triton",))  # fmt: skip
    return spec, build_layer(spec)


def main() -> None:
    batches = [int(t) for t in option("--batches", "4096,16384").split(",")]
    fp8_backends = option("--fp8", "auto").split(",")
    models = option("--models", ",".join(PRESETS)).split(",")
    points = []
    for model in models:
        tp, ep = PRESETS[model]
        for T in batches:
            spec, bf16 = _layer(model, tp, ep, "unquantized", T)
            gen = torch.Generator().manual_seed(0)
            sets, _, _ = _input_sets(spec, bf16, T, gen, l2_cache_bytes("cuda"))
            bf16.runners = RunnerCache(RunnerConfig("triton"))
            fns = {"bf16 triton": layer_over_sets(bf16, sets)}
            fp8_layers = {}
            for b in fp8_backends:
                _, q = _layer(model, tp, ep, "fp8_w8a8", T)
                q.runners = RunnerCache(RunnerConfig(b))
                fp8_layers[b] = q
                fns[f"fp8 {b}"] = layer_over_sets(q, sets)
            for fn in fns.values():
                fn()  # first calls: compile, select
            ms = time_ms_interleaved(fns, "cuda")
            chosen = {b: sorted({d.backend for d in q.runners._decisions.values()})
                      for b, q in fp8_layers.items()}  # fmt: skip
            rec = {"model": model, "tp": tp, "ep": ep, "T": T, "input_sets": len(sets), "ms": ms,
                   "fp8_runs_on": chosen,
                   "bf16_over_fp8": {b: ms["bf16 triton"] / ms[f"fp8 {b}"] for b in fp8_backends}}  # fmt: skip
            points.append(rec)
            ratios = "  ".join(f"fp8 {b} ({'/'.join(chosen[b])}) {ms[f'fp8 {b}']:.3f} ms -> "
                               f"{rec['bf16_over_fp8'][b]:.2f}x" for b in fp8_backends)  # fmt: skip
            print(f"{model:14s} T={T:6d}  bf16 triton {ms['bf16 triton']:.3f} ms  {ratios}",
                  flush=True)  # fmt: skip
            del bf16, fp8_layers, fns, sets
            torch.cuda.empty_cache()
    write_probe(option("--out", "fp8_vs_bf16") + ".json", {
        "script": "scripts/gpu_fp8_vs_bf16.py",
        "title": "fp8 block-wise against bf16 `triton`, timed in turns (issue 4)",
        "targets": TARGETS, "summary": target_rows(points), "points": points,
        "argv": sys.argv[1:]})  # fmt: skip


TARGETS = {"fp8_small": 1.7, "fp8_large": 1.5}  # bf16 / fp8 at T <= 64, at T >= 4096


def target_rows(points: list[dict]) -> list[dict]:
    """Issue 4's fp8 targets for the measured points (T <= 64 and T >= 4096)."""
    rows = []
    for p in points:
        bound = TARGETS["fp8_small"] if p["T"] <= 64 else TARGETS["fp8_large"]
        if 64 < p["T"] < 4096:
            continue
        label = layout_label(p["model"], p["tp"], p["ep"])
        rows += [target_row(f"{label} T={p['T']} bf16 triton / fp8 {b}", ratio, ">=", bound)
                 for b, ratio in p["bf16_over_fp8"].items()]  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
