"""Quantized formats in the `triton` runner against its bf16 path, on one GPU (H100 target).

    PYTHONPATH=src python3 scripts/gpu_triton_quant.py      # writes $OUT/triton_quant.json

For each format on qwen3-30b-a3b and deepseek-v3 (EP8) at T = 1, 16, 64, 4096: the whole runner
call (`ops.fused_moe`, configs as the runner looks them up) timed with `moekit.bench.time_ms`
(CUDA-graph replay), the bf16 runner on the same routing in the same run, and the floor of the
quantized call = bytes (packed weights + scales of the touched experts, activations in and out)
/ measured copy bandwidth. Routings rotate inside the timed graph so the weights do not sit in
L2. Prints the ratios the issue targets:
  fp8 block-wise at T >= 4096: bf16 / fp8 >= 1.5;  fp8 at T <= 64: >= 1.7;
  int4 / mxfp4 / nvfp4 at T <= 16: bf16 / fmt >= 2.5 and time / own floor <= 1.3.
Also checks each format once against the torch reference runner (rel. error, T = 16).
Formats run in priority order and the script stops starting new ones after BUDGET_S seconds
(MOEKIT_QUANT_BUDGET_S), so it ends within about two minutes; what was measured is written.
Without a GPU (smoke test of the script itself): TRITON_INTERPRET=1 on CPU, one tiny shape,
float16, T = 1 and 16.

    --profile   first: per-stage times (alignment, activation quantization, gate_up, down) of
                fp8 block-wise at T = 4096 and of the 4-bit formats at T = 1 or 16, with the
                configs the runner looks up ($OUT/triton_quant_profile.json)
    --tune FMT:T1,T2;...   first: `moekit.tune.tune` for those formats and batch sizes on the
                shapes into $MOEKIT_CONFIG_DIR/triton (stops starting new ones after
                MOEKIT_TUNE_BUDGET_S seconds; MOEKIT_TUNE_FORCE=1 re-tunes batch sizes the
                tables already have)
    --formats a,b   measure only these formats (names of FORMATS), in this order
    --batches 1,4,16   measure these batch sizes (default 1,16,64,4096)
    --models m1,m2     shapes among qwen3-30b-a3b, deepseek-v3, gpt-oss-120b (default the
                first two; tuning uses the same list)
    --portable  also time each packed 4-bit point with the PTX dequantization off
                (`PIPELINE.asm_dequant = False`, the portable twin) in the same run:
                'portable_us' and 'asm_speedup' = portable / PTX time
    --maxnreg N1,N2   also time each packed 4-bit point with `PIPELINE.packed_maxnreg = N`
                for each N ('maxnregN_us')
    --noswap    also time each packed 4-bit point with the looked-up configs but swap_ab off
                ('noswap_us')
    --nosplit   also time each point whose looked-up down config splits K (split_k > 1)
                with split_k = 1, the bf16 call too ('nosplit_us', 'bf16_nosplit_us')
    --out NAME  result file name under $OUT (default triton_quant.json)
    --once MODEL:FORMAT:T   only run that call a few times (no graphs, no timing) and exit:
                a target for a profiler (ncu)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moekit.bench import measure_ceilings, moe_cost, time_ms
from moekit.report import git_commit
from moekit.quant import Fp8W8A8, Int4W4A16, make_spec, quantize_experts
from moekit.runners.torch import TorchRunner
from moekit.runners.triton import ops
from moekit.stages import StandardDispatchOutput
from moekit.tune import random_weights, shape_for, uniform_topk

BUDGET_S = float(os.environ.get("MOEKIT_QUANT_BUDGET_S", "95"))
BATCHES = (1, 16, 64, 4096)
ALL_SHAPES = {"qwen3-30b-a3b": 1, "deepseek-v3": 8, "gpt-oss-120b": 1}  # model: tp = ep
SHAPES = (("qwen3-30b-a3b", 1, 1), ("deepseek-v3", 8, 8))
PACKED = ("int4-g128", "mxfp4", "nvfp4")
FORMATS = {  # priority order
    "fp8-block": Fp8W8A8("block"),
    "int4-g128": Int4W4A16(128, True),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4": make_spec("nvfp4"),
    "fp8-channel": Fp8W8A8("channel"),
    "int8_w8a8": make_spec("int8_w8a8"),
    "int8_w8a16": make_spec("int8_w8a16"),
    "fp8-tensor": Fp8W8A8("tensor"),
}
ALL_FORMATS = dict(FORMATS)  # --tune names any of these, whatever --formats keeps
TARGETS = {"fp8_large": 1.5, "fp8_small": 1.7, "w4_small": 2.5, "w4_floor": 1.3}
ROTATE_BYTES = 200e6


def weight_bytes(w) -> int:
    """Bytes a call reads per expert: data + scales + zeros + global scales of w13 and w2."""
    names = ("w13", "w2", "w13_scale", "w2_scale", "w13_zero", "w2_zero", "w13_global_scale",
             "w2_global_scale")  # fmt: skip
    total = sum(getattr(w, n).numel() * getattr(w, n).element_size()
                for n in names if getattr(w, n) is not None)  # fmt: skip
    return total / w.num_experts


PRESET_PARALLEL = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
                   "gpt-oss-120b": (1, 1)}  # fmt: skip  model: (tp, ep) of the issue's shapes


def spec_points(spec: str, dev: torch.device):
    """Yield (model, fmt, shape, w, T, x, topks) for SPEC 'model:format:T1,T2;...' (format
    'bf16' or a FORMATS name): one preset's bf16 weights on the GPU at a time, quantized per
    item; per point R uniform routings, R such that a call touches about ROTATE_BYTES of
    weights (so they are not served from L2 when a timing rotates through them)."""
    weights = {}
    for item in spec.split(";"):
        model, fmt, sizes = item.split(":")
        shape = shape_for(model, *PRESET_PARALLEL[model])
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        torch.manual_seed(0)
        if model not in weights:
            weights = {model: random_weights(shape, dev)}
        w = weights[model] if fmt == "bf16" else quantize_experts(weights[model], FORMATS[fmt])
        gen = torch.Generator(device=dev).manual_seed(1)
        for T in (int(t) for t in sizes.split(",")):
            R = max(1, min(16, math.ceil(ROTATE_BYTES / (min(E, T * K) * weight_bytes(w)))))
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
            yield model, fmt, shape, w, T, x, [uniform_topk(T, E, K, dev, gen) for _ in range(R)]


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def profile(out_dir: Path) -> None:
    """Per-stage CUDA-graph times of the runner's pieces with the configs it looks up."""
    from moekit.runners._align import align_block_size
    from moekit.runners.triton.configs import PIPELINE

    dev, dtype = torch.device("cuda"), torch.bfloat16
    cases = [(f, T) for f, T in (("fp8-block", 4096), ("fp8-tensor", 4096), ("int4-g128", 16),
                                 ("mxfp4", 1), ("nvfp4", 16)) if f in FORMATS]
    rows_out = []
    for model, tp, ep in SHAPES:
        shape = shape_for(model, tp, ep)
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        torch.manual_seed(0)
        w_bf16 = random_weights(shape, dev)
        for fmt, T in cases:
            spec = FORMATS[fmt]
            wq = quantize_experts(w_bf16, spec)
            gen = torch.Generator(device=dev).manual_seed(T)
            x = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
            tk = uniform_topk(T, E, K, dev, gen)
            c1, c2 = ops.configs_for(T, K, wq, dtype, dev)
            row = {"model": model, "format": fmt, "T": T, "gate_up": str(c1), "down": str(c2)}
            try:
                if T <= PIPELINE.direct_max_tokens:
                    from dataclasses import replace

                    c1, c2 = replace(c1, block_m=16), replace(c2, block_m=16)
                    rows = ops.Rows.direct(tk.ids.view(-1), E)
                else:
                    bm = max(c1.block_m, c2.block_m)
                    row["align_us"] = time_ms(lambda: align_block_size(tk.ids, E, bm), dev) * 1e3
                    rows = ops.Rows.sorted(align_block_size(tk.ids, E, bm), E)
                h = ops.gate_up(x, rows, wq, shape.act, c1, K)
                out = torch.zeros(T, H, device=dev, dtype=dtype)
                y = torch.empty(T * K, H, device=dev, dtype=dtype)
                dst = out if c2.reduce == "atomic" else y
                row["gate_up_us"] = time_ms(
                    lambda: ops.gate_up(x, rows, wq, shape.act, c1, K, h), dev) * 1e3
                row["down_us"] = time_ms(
                    lambda: ops.down(h, rows, wq, c2, dst, tk.weights, K), dev) * 1e3
                if not spec.weight_only:
                    row["quant_x_us"] = time_ms(lambda: ops.quantize_input(x, spec), dev) * 1e3
                    row["quant_h_us"] = time_ms(lambda: ops.quantize_input(h, spec), dev) * 1e3
                row["layer_us"] = time_ms(lambda: ops.fused_moe(x, tk, wq, shape.act), dev) * 1e3
                if T > PIPELINE.direct_max_tokens:  # the bf16 runner's stages, same routing
                    b1, b2 = ops.configs_for(T, K, w_bf16, dtype, dev)
                    rows_b = ops.Rows.sorted(align_block_size(tk.ids, E, max(b1.block_m,
                                                                             b2.block_m)), E)
                    hb = ops.gate_up(x, rows_b, w_bf16, shape.act, b1, K)
                    dst_b = out if b2.reduce == "atomic" else y
                    row["bf16_gate_up_us"] = time_ms(
                        lambda: ops.gate_up(x, rows_b, w_bf16, shape.act, b1, K, hb), dev) * 1e3
                    row["bf16_down_us"] = time_ms(
                        lambda: ops.down(hb, rows_b, w_bf16, b2, dst_b, tk.weights, K), dev) * 1e3
                    row["bf16_configs"] = [str(b1), str(b2)]
                row["bf16_layer_us"] = time_ms(
                    lambda: ops.fused_moe(x, tk, w_bf16, shape.act), dev) * 1e3  # fmt: skip
            except Exception as err:  # noqa: BLE001 - report and go on
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows_out.append(row)
            print("profile", {k: (round(v, 1) if isinstance(v, float) else v)
                              for k, v in row.items()}, flush=True)  # fmt: skip
            # release before the next format (rebound, not deleted: the lambdas above name it)
            wq = None
        w_bf16 = None
        torch.cuda.empty_cache()
    (out_dir / "triton_quant_profile.json").write_text(json.dumps(rows_out, indent=1) + "\n")


def tune_tables(plan: str) -> None:
    """`moekit.tune.tune` for 'FMT:T1,T2;FMT:...' on both shapes, within MOEKIT_TUNE_BUDGET_S."""
    from moekit.tune import tune

    budget = float(os.environ.get("MOEKIT_TUNE_BUDGET_S", "240"))
    t0 = time.perf_counter()
    for item in plan.split(";"):
        fmt, sizes = item.split(":")
        for model, tp, ep in SHAPES:
            if time.perf_counter() - t0 > budget:
                print(f"tune: budget spent, skip {model} {fmt}", flush=True)
                continue
            shape = shape_for(model, tp, ep)
            t1 = time.perf_counter()
            try:
                rep = tune(shape, [int(b) for b in sizes.split(",")], progress=False,
                           quantization=ALL_FORMATS[fmt], force=os.environ.get("MOEKIT_TUNE_FORCE") == "1",
                           note=f"scripts/gpu_triton_quant.py --tune ({model} {fmt})")  # fmt: skip
                for r in rep.results:
                    print(f"tune {model} {fmt} T={r.num_tokens}: {r.summary()}", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"tune {model} {fmt} FAILED: {type(err).__name__}: {err}", flush=True)
            print(f"tune {model} {fmt}: {time.perf_counter() - t1:.0f}s", flush=True)


def _option(args: list[str], name: str) -> str | None:
    if name not in args:
        return None
    i = args.index(name)
    if i + 1 >= len(args):
        raise SystemExit(f"{name} needs a value")
    return args[i + 1]


def main() -> int:
    global SHAPES, FORMATS, BATCHES
    t_start = time.perf_counter()
    args = sys.argv[1:]
    if (models := _option(args, "--models")) is not None:
        bad = [m for m in models.split(",") if m not in ALL_SHAPES]
        if bad:
            raise SystemExit(f"--models: unknown {bad}; allowed: {', '.join(ALL_SHAPES)}")
        SHAPES = tuple((m, ALL_SHAPES[m], ALL_SHAPES[m]) for m in models.split(","))
    if (fmts := _option(args, "--formats")) is not None:
        bad = [f for f in fmts.split(",") if f not in FORMATS]
        if bad:
            raise SystemExit(f"--formats: unknown {bad}; allowed: {', '.join(FORMATS)}")
        FORMATS = {f: FORMATS[f] for f in fmts.split(",")}
    if (batches := _option(args, "--batches")) is not None:
        BATCHES = tuple(int(b) for b in batches.split(","))
    portable = "--portable" in args
    if (once := _option(args, "--once")) is not None:
        model, fmt, T = once.split(":")
        shape = shape_for(model, ALL_SHAPES[model], ALL_SHAPES[model])
        dev = torch.device("cuda")
        torch.manual_seed(0)
        wq = quantize_experts(random_weights(shape, dev), FORMATS[fmt])
        x = torch.randn(int(T), shape.hidden, device=dev, dtype=torch.bfloat16)
        tk = uniform_topk(int(T), shape.num_experts, shape.top_k, dev)
        for _ in range(3):
            ops.fused_moe(x, tk, wq, shape.act)
        torch.cuda.synchronize()
        return 0
    noswap = "--noswap" in args
    nosplit = "--nosplit" in args
    maxnregs = [int(n) for n in (_option(args, "--maxnreg") or "").split(",") if n]
    out_name = _option(args, "--out") or "triton_quant.json"
    if "--profile" in args and torch.cuda.is_available():
        profile(Path(os.environ.get("OUT", ".")))
    if "--tune" in args and torch.cuda.is_available():
        tune_tables(args[args.index("--tune") + 1])
        from moekit.runners.triton import configs as tcfg

        tcfg.clear_cache()
    if "--no-measure" in args:
        return 0
    t_start = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float16
    shapes = SHAPES if on_gpu else (("tiny", 0, 0),)
    batches = BATCHES if on_gpu else (1, 16)
    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    ceil = measure_ceilings(dev, dtype)
    bw = ceil.copy_bytes_per_s
    result = {
        "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu (interpreter smoke test)",
        "torch": torch.__version__,
        "commit": git_commit()[0],
        "copy_TBps": round(bw / 1e12, 3),
        "targets": TARGETS,
        "points": [],
        "checks": [],
        "skipped": [],
        "argv": args,
    }
    path = out_dir / out_name

    def save():
        path.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{result['device']}: copy {bw / 1e12:.2f} TB/s", flush=True)
    for model, tp, ep in shapes:
        if on_gpu:
            shape = shape_for(model, tp, ep)
        else:
            from moekit.tune import TuneShape

            shape = TuneShape(8, 2, 256, 128, dtype="float16", label="tiny")
        E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
        torch.manual_seed(0)
        w_bf16 = random_weights(shape, dev)
        gen = torch.Generator(device=dev).manual_seed(1)
        bf16_ms: dict[int, float] = {}
        inputs = {}
        for fmt, spec in FORMATS.items():
            elapsed = time.perf_counter() - t_start
            if elapsed > BUDGET_S:
                result["skipped"].append(f"{model} {fmt}: time budget ({elapsed:.0f}s)")
                print(f"skip {model} {fmt}: budget", flush=True)
                continue
            try:
                wq = quantize_experts(w_bf16, spec)
            except ValueError as err:
                result["skipped"].append(f"{model} {fmt}: {err}")
                continue
            per_expert_q = weight_bytes(wq)
            for T in batches:
                if T not in inputs:
                    touched = min(E, T * K)
                    R = max(1, min(16, math.ceil(ROTATE_BYTES / (touched * per_expert_q))))
                    R = R if on_gpu else 1
                    x = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
                    topks = [uniform_topk(T, E, K, dev, gen) for _ in range(R)]
                    inputs[T] = (x, topks)
                x, topks = inputs[T]
                R = len(topks)

                def call(w, x=x, topks=topks, cfgs=None):
                    for t in topks:
                        ops.fused_moe(x, t, w, shape.act, configs=cfgs)

                reps = dict(warmup=3, samples=10) if on_gpu else dict(warmup=1, samples=1)
                try:
                    if T not in bf16_ms:
                        bf16_ms[T] = time_ms(lambda: call(w_bf16), dev, **reps) / R
                    q_ms = time_ms(lambda: call(wq), dev, **reps) / R
                    p_ms = None
                    if portable and fmt in PACKED:
                        saved = ops.PIPELINE
                        ops.PIPELINE = replace(saved, asm_dequant=False)
                        try:
                            p_ms = time_ms(lambda: call(wq), dev, **reps) / R
                        finally:
                            ops.PIPELINE = saved
                    r_ms = {}
                    for nreg in maxnregs if fmt in PACKED else ():
                        saved = ops.PIPELINE
                        ops.PIPELINE = replace(saved, packed_maxnreg=nreg)
                        try:
                            r_ms[nreg] = time_ms(lambda: call(wq), dev, **reps) / R
                        finally:
                            ops.PIPELINE = saved
                    n_ms = None
                    if noswap and fmt in PACKED:
                        cf = tuple(replace(c, swap_ab=False)
                                   for c in ops.configs_for(T, K, wq, dtype, dev))  # fmt: skip
                        n_ms = time_ms(lambda: call(wq, cfgs=cf), dev, **reps) / R
                    s_ms = {}
                    for name, wt in (("bf16_nosplit_us", w_bf16), ("nosplit_us", wq)):
                        cf = ops.configs_for(T, K, wt, dtype, dev)
                        if nosplit and cf[1].split_k > 1:
                            cf = (cf[0], replace(cf[1], split_k=1))
                            s_ms[name] = time_ms(lambda: call(wt, cfgs=cf), dev, **reps) / R
                except Exception as err:  # noqa: BLE001 - report and go on with the others
                    msg = f"{type(err).__name__}: {str(err)[:300]}"
                    result["skipped"].append(f"{model} {fmt} T={T}: {msg}")
                    print(f"FAIL {model} {fmt} T={T}: {msg}", flush=True)
                    break
                floors = [
                    moe_cost(t.ids, E, H, I, act_bytes=2, weight_bytes_per_expert=per_expert_q).bytes
                    / bw * 1e3
                    for t in topks
                ]
                floor_ms = sum(floors) / len(floors)
                p = {
                    "model": model, "format": fmt, "spec": spec.describe(), "T": T,
                    "bf16_us": round(bf16_ms[T] * 1e3, 2), "quant_us": round(q_ms * 1e3, 2),
                    "speedup": round(bf16_ms[T] / q_ms, 3),
                    "floor_us": round(floor_ms * 1e3, 2), "time_over_floor": round(q_ms / floor_ms, 3),
                    "configs": [str(c) for c in ops.configs_for(T, K, wq, dtype, dev)],
                }  # fmt: skip
                if p_ms is not None:
                    p["portable_us"] = round(p_ms * 1e3, 2)
                    p["asm_speedup"] = round(p_ms / q_ms, 3)
                if n_ms is not None:
                    p["noswap_us"] = round(n_ms * 1e3, 2)
                for nreg, ms in r_ms.items():
                    p[f"maxnreg{nreg}_us"] = round(ms * 1e3, 2)
                for name, ms in s_ms.items():
                    p[name] = round(ms * 1e3, 2)
                result["points"].append(p)
                print(
                    f"{model:14} {fmt:11} T={T:5}  bf16 {p['bf16_us']:8.1f} us  quant "
                    f"{p['quant_us']:8.1f} us  speed-up {p['speedup']:5.2f}x  "
                    f"time/floor {p['time_over_floor']:5.2f}"
                    + (f"  portable {p['portable_us']:8.1f} us ({p['asm_speedup']:.2f}x)"
                       if p_ms is not None else "")
                    + (f"  noswap {p['noswap_us']:8.1f} us" if n_ms is not None else "")
                    + "".join(f"  maxnreg={n} {ms * 1e3:8.1f} us" for n, ms in r_ms.items())
                    + "".join(f"  {n} {ms * 1e3:8.1f}" for n, ms in s_ms.items()),
                    flush=True,
                )
            # one correctness check per format and shape (T = 16)
            x, topks = inputs.get(16, (None, None))
            if x is not None:
                d = StandardDispatchOutput(x, topks[0])
                err = rel_err(ops.fused_moe(x, topks[0], wq, shape.act),
                              TorchRunner().run(d, wq, shape.act).out)  # fmt: skip
                result["checks"].append({"model": model, "format": fmt, "T": 16, "rel_err": err})
                print(f"{model:14} {fmt:11} rel_err vs torch runner (T=16): {err:.2e}", flush=True)
            save()
            wq = None  # release before the next format
            torch.cuda.empty_cache()

    # the targets
    summary = []

    def pts(pred):
        return [p for p in result["points"] if pred(p)]

    for p in pts(lambda p: p["format"] == "fp8-block" and p["T"] >= 4096):
        summary.append((f"fp8 block {p['model']} T={p['T']} speed-up", p["speedup"], ">=", 1.5))
    for p in pts(lambda p: p["format"].startswith("fp8") and p["T"] <= 64):
        summary.append((f"{p['format']} {p['model']} T={p['T']} speed-up", p["speedup"], ">=", 1.7))
    for p in pts(lambda p: p["format"] in ("int4-g128", "mxfp4", "nvfp4") and p["T"] <= 16):
        summary.append((f"{p['format']} {p['model']} T={p['T']} speed-up", p["speedup"], ">=", 2.5))
        summary.append(
            (f"{p['format']} {p['model']} T={p['T']} time/floor", p["time_over_floor"], "<=", 1.3)
        )
    print("\ntargets:")
    rows = []
    for name, value, op, target in summary:
        ok = value >= target if op == ">=" else value <= target
        rows.append({"what": name, "value": value, "target": f"{op} {target}", "met": ok})
        print(f"  {'met ' if ok else 'MISS'} {name:45} {value:6.2f}  (target {op} {target})")
    result["summary"] = rows
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(f"wrote {path} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
