"""fp8 with static per-tensor activation scales (one calibrated scale per expert) on the
`triton` runner, against the same weights with dynamic per-tensor scales, the `cutlass` runner
and bf16, timed in turns.

    PYTHONPATH=src python3 scripts/gpu_fp8_static.py [--batches 1,16,256,4096]
        [--models qwen3-30b-a3b,...] [--out NAME]    # writes $OUT/NAME.json (fp8_static.json)

For each preset at the issue's parallel shape and each batch size: one bf16 layer (the sweep's
random weights) and its fp8_w8a8 copies with per-tensor weight scales, activations
'dynamic_tensor' or 'static_tensor' (scales calibrated as amax / 448 of each GEMM's input over
64 random tokens, per expert), over the same input sets (`moekit.sweep`'s routing, rotated past
L2), timed together by `moekit.bench.time_ms_interleaved` (CUDA-graph replay, alternating
rounds). Each fp8 layer's output on the first set is also compared with the `torch` runner's
(relative norm). Prints the times and static / dynamic per point; `auto`'s pick for static
scales is recorded.
"""

from __future__ import annotations

import copy
import sys

import torch

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.quant import calibrate_static_scales
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_out import option, write_probe  # noqa: E402

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip  model: (tp, ep)
VARIANTS = {  # name: (activation scheme, runner)
    "fp8 dynamic triton": ("dynamic_tensor", "triton"),
    "fp8 static triton": ("static_tensor", "triton"),
    "fp8 static cutlass": ("static_tensor", "cutlass"),
    "fp8 static auto": ("static_tensor", "auto"),
}


def calibrated(layer) -> dict:
    """Per-expert static scales: amax / 448 of each GEMM's input over 64 random tokens."""
    w = layer.expert_weights
    x = torch.randn(64, w.hidden_size, device=w.w13.device, dtype=w.w13.dtype)
    a13, a2 = calibrate_static_scales(w, layer.act, x)
    return dict(a13_scale=a13, a2_scale=a2)


@torch.no_grad()
def main() -> None:
    batches = [int(t) for t in option("--batches", "1,16,256,4096").split(",")]
    models = option("--models", "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3").split(",")
    points = []
    for model in models:
        tp, ep = PRESETS[model]
        spec = sweep_spec(model, tp_size=tp, ep_size=ep, quantization="unquantized",
                          batch_sizes=tuple(batches), device="cuda",
                          backends=("triton",))  # fmt: skip
        bf16 = build_layer(spec)
        bf16.runners = RunnerCache(RunnerConfig("triton"))
        scales = calibrated(bf16)
        layers = {"bf16 triton": bf16}
        for name, (scheme, runner) in VARIANTS.items():
            q = copy.deepcopy(bf16)
            q.quantize_weights_("fp8_w8a8", weight_scale="tensor", activation_scheme=scheme,
                                **(scales if scheme == "static_tensor" else {}))  # fmt: skip
            q.runners = RunnerCache(RunnerConfig(runner))
            layers[name] = q
        refs = {}  # the torch runner on each fp8 layer's weights (the static ones are equal)
        for scheme in ("dynamic", "static"):
            refs[scheme] = copy.deepcopy(layers[f"fp8 {scheme} triton"])
            refs[scheme].runners = RunnerCache(RunnerConfig("torch"))
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, _, _ = _input_sets(spec, bf16, T, gen, l2_cache_bytes("cuda"))
            fns = {name: layer_over_sets(m, sets) for name, m in layers.items()}
            for fn in fns.values():
                fn()  # first calls: compile, select
            x, topk = sets[0]
            ref = {k: r.forward_topk(x, topk).float() for k, r in refs.items()}
            err = {}
            for name in ("fp8 dynamic triton", "fp8 static triton", "fp8 static cutlass"):
                out = layers[name].forward_topk(x, topk).float()
                r = ref[name.split()[1]]
                err[name] = float((out - r).norm() / r.norm().clamp_min(1e-30))
            ms = time_ms_interleaved(fns, "cuda")
            decisions = layers["fp8 static auto"].runners._decisions.values()
            auto = sorted({d.backend for d in decisions})
            rec = {"model": model, "tp": tp, "ep": ep, "T": T, "input_sets": len(sets), "ms": ms,
                   "rel_err_vs_torch": err, "static_auto_runs_on": auto,
                   "static_over_dynamic": ms["fp8 static triton"] / ms["fp8 dynamic triton"],
                   "cutlass_over_triton_static":
                       ms["fp8 static cutlass"] / ms["fp8 static triton"],
                   "bf16_over_static": ms["bf16 triton"] / ms["fp8 static triton"]}  # fmt: skip
            points.append(rec)
            print(f"{model:14s} T={T:6d}  " + "  ".join(f"{k} {v:.4f}" for k, v in ms.items())
                  + f"  static/dyn {rec['static_over_dynamic']:.3f}  cutlass/triton "
                  f"{rec['cutlass_over_triton_static']:.3f}  auto {auto}  err "
                  + " ".join(f"{v:.4f}" for v in err.values()), flush=True)  # fmt: skip
            del fns, sets
        del layers, bf16, refs
        torch.cuda.empty_cache()
    write_probe(option("--out", "fp8_static") + ".json", {
        "script": "scripts/gpu_fp8_static.py",
        "title": "fp8 per-tensor weights with static activation scales: triton against "
                 "dynamic scales, cutlass and bf16, timed in turns",
        "points": points, "argv": sys.argv[1:]})  # fmt: skip


if __name__ == "__main__":
    main()
