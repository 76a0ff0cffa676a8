"""GPU correctness + timing of the `triton_kernel` runner beside the `triton` runner.

Run from the repository root on the device machine:
    PYTHONPATH=src python3 scripts/gpu_triton_kernel.py [--models a,b] [--batch-sizes 1024,4096]
                                                        [--budget-s 140] [--no-variants]
For each preset shape (bf16, uniform random routing) and batch size T: both runners' outputs
against a float32 reference of the used experts (relative norm error), then both timed with
`moekit.bench.time_ms` (CUDA-graph replay, median) and the roofline floor measured in the same
run (`measure_ceilings`, `moe_cost`); prints time, time / floor and the speed-up. With time left
(`--budget-s` bounds the whole run; points past it are skipped and reported), a few alternative
triton_kernel configs are timed at T >= 4096 to calibrate the heuristic table. Everything goes
to $OUT/triton_kernel_bench.json (or ./ without $OUT). Exit status 1 if any output is wrong or
a point failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

SHAPES = {  # model -> (tp, ep) as in the issue: per-rank shapes
    "qwen3-30b-a3b": (1, 1),
    "mixtral-8x7b": (2, 1),
    "deepseek-v3": (8, 8),
    "gpt-oss-120b": (1, 1),
}
TOL = 3e-2  # bf16 relative-norm tolerance (tests/helpers.TOLERANCE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference_fp32(x, topk, w, act):
    """Float32 (no TF32) reference on the used experts only."""
    from moekit.experts import ExpertWeights
    from moekit.router import TopKOutput
    from moekit.runners.torch import run_standard

    used = torch.unique(topk.ids[topk.ids >= 0]).long()
    remap = torch.full((w.num_experts,), -1, dtype=torch.int32, device=x.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=x.device)
    ids = torch.where(topk.ids >= 0, remap[topk.ids.long().clamp(min=0)], -1)

    def pick(t):
        return None if t is None else t[used].float()

    w32 = ExpertWeights(pick(w.w13), pick(w.w2), pick(w.b13), pick(w.b2))
    return run_standard(x.float(), TopKOutput(topk.weights, ids), w32, act)


def variants(base):
    """A few alternatives to the heuristic config (large-batch knobs)."""
    from moekit.runners.triton_kernel.configs import Tile

    g, d = base.gate_up, base.down
    return {
        "group_m=16": replace(base, group_m=16),
        "gate_up_bn=64": replace(base, gate_up=replace(g, block_n=64, num_stages=4)),
        "down_bn=256": replace(base, down=replace(d, block_n=256, num_stages=3)),
        "gate_up_bk=128,s=2": replace(base, gate_up=replace(g, block_k=128, num_stages=2)),
        "bm=64,2/sm": replace(base, block_m=64, programs_per_sm=2,
                              gate_up=Tile(64, 64, 4, 4), down=Tile(128, 64, 4, 4)),
        "no_tma": replace(base, tma=False),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--batch-sizes", default="1024,4096,16384")
    p.add_argument("--budget-s", type=float, default=140.0)
    p.add_argument("--no-variants", action="store_true")
    p.add_argument("--tiny", action="store_true",
                   help="shapes / 32 and E <= 8: a CPU smoke test of this script (TRITON_INTERPRET=1)")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    t_start = time.time()
    deadline = t_start + args.budget_s

    from moekit import bench
    try:  # the comparison; a broken `triton` runner must not stop our own measurements
        from moekit.runners.triton import ops as triton_ops
    except Exception as err:
        traceback.print_exc()
        triton_ops = None
        triton_import_error = f"triton runner import failed: {type(err).__name__}: {err}"
    from moekit.runners.triton_kernel import ops as tk_ops
    from moekit.runners.triton_kernel.configs import config_for
    from moekit.tune import random_weights, shape_for, uniform_topk

    torch.backends.cuda.matmul.allow_tf32 = False
    if args.device != "cuda" and not args.tiny:
        p.error("--device other than cuda needs --tiny (the Triton interpreter is slow)")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # bf16 is wrong interpreted

    def get_shape(model):
        tp, ep = SHAPES[model]
        shape = shape_for(model, tp, ep, str(dtype).removeprefix("torch."))
        if args.tiny:
            E = min(shape.num_experts, 8)
            shape = replace(shape, num_experts=E, top_k=min(shape.top_k, E),
                            hidden=shape.hidden // 32, intermediate=shape.intermediate // 32)
        return shape

    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "triton_kernel_bench.json"
    import triton

    from moekit.report import git_commit

    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit()[0],
        "points": [],
        "variants": [],
        "skipped": [],
        "errors": [],
    }
    if triton_ops is None:
        result["errors"].append(triton_import_error)
    ceil = bench.measure_ceilings(dev, dtype)
    result["ceilings"] = asdict(ceil)
    print(f"{result['device']}: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s")  # fmt: skip

    def save():
        result["wall_s"] = round(time.time() - t_start, 1)
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    ok = True
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    hdr = (f"{'model':<15}{'T':>6} {'triton ms':>10} {'t/floor':>8} {'tk ms':>9} {'t/floor':>8} "
           f"{'speedup':>8} {'err tr':>8} {'err tk':>8}")  # fmt: skip
    print(hdr)
    large_points = []  # (model, T, shape, w, x, topk, floor_ms) kept light: rebuilt below
    for model in models:
        shape = get_shape(model)
        w = random_weights(shape, dev)
        for T in sizes:
            if time.time() > deadline:
                result["skipped"].append(f"{model} T={T}: past the time budget")
                print(f"{model:<15}{T:>6} skipped (time budget)")
                continue
            try:
                gen = torch.Generator(device=dev).manual_seed(T)
                topk = uniform_topk(T, shape.num_experts, shape.top_k, dev, gen)
                x = torch.randn(T, shape.hidden, device=dev, dtype=dtype, generator=gen)
                cost = bench.moe_cost(topk.ids, shape.num_experts, shape.hidden, shape.intermediate)
                floor_ms = cost.floor_s(ceil) * 1e3
                ref = reference_fp32(x, topk, w, shape.act)
                y_tk = tk_ops.fused_moe(x, topk, w, shape.act)
                err_tk, err_tr, ms_tr = rel_err(y_tk, ref), float("nan"), float("nan")
                if triton_ops is not None:
                    err_tr = rel_err(triton_ops.fused_moe(x, topk, w, shape.act), ref)
                    ms_tr = bench.time_ms(lambda: triton_ops.fused_moe(x, topk, w, shape.act), dev)
                del ref, y_tk
                ms_tk = bench.time_ms(lambda: tk_ops.fused_moe(x, topk, w, shape.act), dev)
                cfg = config_for(T, shape.top_k, shape.num_experts, shape.hidden,
                                 shape.intermediate, shape.act.interleaved)  # fmt: skip
                good = err_tk < TOL  # the triton runner's error is reported, not ours to fail
                ok &= good
                pt = dict(model=model, T=T, E=shape.num_experts, K=shape.top_k, H=shape.hidden,
                          I=shape.intermediate, act=shape.act.name, floor_ms=floor_ms,
                          triton_ms=ms_tr, triton_kernel_ms=ms_tk, triton_over_floor=ms_tr / floor_ms,
                          triton_kernel_over_floor=ms_tk / floor_ms, speedup=ms_tr / ms_tk,
                          err_triton=err_tr, err_triton_kernel=err_tk, correct=good,
                          config=asdict(cfg))  # fmt: skip
                result["points"].append(pt)
                print(f"{model:<15}{T:>6} {ms_tr:>10.3f} {ms_tr / floor_ms:>8.2f} {ms_tk:>9.3f} "
                      f"{ms_tk / floor_ms:>8.2f} {ms_tr / ms_tk:>7.2f}x {err_tr:>8.1e} "
                      f"{err_tk:>8.1e}{'' if good else '  WRONG'}", flush=True)  # fmt: skip
                if T >= 4096 or args.tiny:
                    large_points.append((model, T, cfg, ms_tk, floor_ms))
            except Exception as err:  # one failure must not lose the other points
                ok = False
                traceback.print_exc()
                result["errors"].append(f"{model} T={T}: {type(err).__name__}: {err}")
            save()
        del w
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # Large-batch variants, in the time left (one weight set per model at a time).
    if not args.no_variants:
        by_model: dict[str, list] = {}
        for pt in large_points:
            by_model.setdefault(pt[0], []).append(pt)
        for model, pts in by_model.items():
            if time.time() > deadline - 10:
                result["skipped"].append(f"variants of {model}: past the time budget")
                continue
            shape = get_shape(model)
            w = random_weights(shape, dev)
            for _, T, cfg, base_ms, floor_ms in pts:
                gen = torch.Generator(device=dev).manual_seed(T)
                topk = uniform_topk(T, shape.num_experts, shape.top_k, dev, gen)
                x = torch.randn(T, shape.hidden, device=dev, dtype=dtype, generator=gen)
                for name, v in variants(cfg).items():
                    if time.time() > deadline - 5:
                        result["skipped"].append(f"variant {name} {model} T={T}: time budget")
                        continue
                    try:
                        y = tk_ops.fused_moe(x, topk, w, shape.act, config=v)
                        y0 = tk_ops.fused_moe(x, topk, w, shape.act, config=cfg)
                        agree = rel_err(y, y0)
                        ms = bench.time_ms(
                            lambda v=v: tk_ops.fused_moe(x, topk, w, shape.act, config=v), dev,
                            samples=10,
                        )
                        result["variants"].append(dict(
                            model=model, T=T, variant=name, ms=ms, base_ms=base_ms,
                            over_floor=ms / floor_ms, rel_diff_vs_base=agree, config=asdict(v)))  # fmt: skip
                        print(f"  variant {model:<15}{T:>6} {name:<20} {ms:>8.3f} ms "
                              f"(base {base_ms:.3f}) diff {agree:.1e}", flush=True)  # fmt: skip
                        if not agree < TOL:
                            ok = False
                    except Exception as err:
                        traceback.print_exc()
                        result["errors"].append(f"variant {name} {model} T={T}: {err}")
                save()
            del w
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    pts = result["points"]
    big = [p for p in pts if p["T"] >= 4096]
    wins = sorted({p["model"] for p in big if all(
        q["speedup"] > 1.0 for q in big if q["model"] == p["model"])})  # fmt: skip
    result["faster_at_T_ge_4096_on"] = wins
    print(f"triton_kernel faster than triton at every T >= 4096 on {len(wins)} shape(s): {wins}")
    if result["skipped"]:
        print("skipped:", *result["skipped"], sep="\n  ")
    if result["errors"]:
        print("errors:", *result["errors"], sep="\n  ")
    save()
    print(f"wrote {out_path} in {time.time() - t_start:.0f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
