"""Profile probes for the `w4a16` kernels (H100 findings: benchmarks/w4a16_notes.md).

    # one target, a few eager calls (for ncu -k regex:moe_w4):
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py once deepseek-v3:ep8:mxfp4:16
    # measured plan tables (the fastest plan of each GEMM per batch size) for the presets:
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py tune [--jobs qwen3-30b-a3b:ep1,...]
        [--formats int4_w4a16,mxfp4,nvfp4] [--batches 1,4,16,64] [--out-dir DIR]
    # each GEMM alone at every plan (optionally of one build variant), and the layer:
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py splits --targets T1,T2 [--defines=
        -DMK_STAGES=2 --tag _st2]
    # layer time (CUDA-graph replay over 8 routings; the runner's plans, measured where a table
    # has the shape) per build variant (-D defines of the .cu;
    # `build` with the same --variants only builds them, in parallel):
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py variants --targets T1,T2 \
        --variants "base=;st2=-DMK_STAGES=2;always=OVERLAP=1"

A target is model:epN:format:T (EP: the rank holds E / N experts and sees every token; the
routing is uniform over all E experts, pairs on other ranks are masked).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

from moekit.bench import time_ms_interleaved
from moekit.presets import preset
from moekit.quant import make_spec, quantize_experts
from moekit.runners.w4a16 import W4A16Runner, jit
from moekit.tune import random_weights, shape_for, uniform_topk

DEV = torch.device("cuda")
BASE_LIBRARY = jit.library.__wrapped__  # the uncached builder (probes swap jit.library)
DOWN_OVERLAPS = jit.down_overlaps


def setup(target: str):
    model, ep, fmt, T = target.split(":")
    ep, T = int(ep.removeprefix("ep")), int(T)
    tp = 2 if model.startswith("mixtral") else ep
    shape = shape_for(model, tp, ep)
    E_all = preset(model).num_experts
    torch.manual_seed(0)
    w = quantize_experts(random_weights(shape, DEV), make_spec(fmt))
    gen = torch.Generator(device=DEV).manual_seed(T)
    sets = []
    for _ in range(8):
        tk = uniform_topk(T, E_all, preset(model).top_k, DEV, gen)
        tk.ids[tk.ids >= shape.num_experts] = -1
        sets.append(tk)
    x = torch.randn(T, shape.hidden, device=DEV, dtype=torch.bfloat16)
    return shape, w, sets, x, 1.0 / ep


def run_layer(runner, shape, w, sets, x, share):
    for tk in sets:
        runner.run_standard(x, tk, w, shape.act, local_share=share)


def once(target: str) -> None:
    shape, w, sets, x, share = setup(target)
    r = W4A16Runner()
    for _ in range(3):
        run_layer(r, shape, w, sets[:2], x, share)
    torch.cuda.synchronize()


def prebuild(specs: dict[str, tuple[str, ...]]) -> None:
    """Builds every variant's libraries for the weight-format variants in parallel (nvcc is
    single-threaded; one build per variant and format takes about 20 s)."""
    from concurrent.futures import ThreadPoolExecutor

    base = BASE_LIBRARY
    arch = jit.arch_of(DEV)
    formats = ((0, False, False), (0, True, False), (1, False, False), (1, False, True),
               (2, False, False), (2, False, True))  # fmt: skip
    jobs = [(tuple(x for x in d if not x.startswith("OVERLAP=")), *f) for d in specs.values()
            for f in formats]  # fmt: skip
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda j: _with_defines(base, j[0], *j[1:], arch), jobs))


def variants(targets: list[str], specs: dict[str, tuple[str, ...]]) -> dict:
    """The layer per build variant, timed in turns, for each target."""
    prebuild(specs)
    results = {}
    for target in targets:
        results[target] = _variants_of(target, specs)
        print(target, results[target], flush=True)
    return results


def _variants_of(target: str, specs: dict[str, tuple[str, ...]]) -> dict:
    base_library = BASE_LIBRARY
    shape, w, sets, x, share = setup(target)
    fns = {}
    for name, defines in specs.items():
        # OVERLAP=0 / 1: down never / always a programmatic dependent launch (else the rule)
        force = [d.removeprefix("OVERLAP=") == "1" for d in defines if d.startswith("OVERLAP=")]
        defines = tuple(d for d in defines if not d.startswith("OVERLAP="))
        lib_fn = functools.partial(lambda d, *a: _with_defines(base_library, d, *a), defines)
        overlaps = (lambda *a, v=force[0]: v) if force else DOWN_OVERLAPS
        r = W4A16Runner()
        r.packed(w, shape.act.interleaved)

        def layer(r=r, lib_fn=lib_fn, overlaps=overlaps):
            jit.library = lib_fn
            jit.down_overlaps = overlaps
            jit._occupancy.cache_clear()  # the variant's own occupancy for the plan
            jit.plan.cache_clear()
            jit._down_overlaps.cache_clear()
            run_layer(r, shape, w, sets, x, share)

        layer()
        fns[name] = layer
    ms = time_ms_interleaved(fns, DEV)
    return {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()}


@functools.cache
def _with_defines(base, defines: tuple[str, ...], fmt, zero, two_mul, arch):
    from moekit.runners import _nvcc
    from moekit.runners.w4a16.jit import SOURCE

    source = SOURCE
    if defines and defines[0].startswith("@"):  # another source file (e.g. an older kernel)
        source, defines = Path(defines[0][1:]).resolve(), defines[1:]
    args = [str(source), "-shared", "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-DMK_FMT={fmt}",
            f"-DMK_ZERO={int(zero)}", f"-DMK_TWO_MUL={int(two_mul)}", *defines]  # fmt: skip
    import ctypes

    path = _nvcc.build(_nvcc.nvcc(), args, "w4a16", [source.read_bytes()], "w4a16 variant")
    lib = ctypes.CDLL(str(path))
    real = base(fmt, zero, two_mul, arch)  # for the ctypes signatures
    for name in ("mk_w4_max_pairs", "mk_w4_last_error", "mk_w4_launch", "mk_w4_occupancy",
                 "mk_w4_items"):  # fmt: skip
        getattr(lib, name).restype = getattr(real, name).restype
    for name in ("mk_w4_launch", "mk_w4_occupancy", "mk_w4_items"):
        getattr(lib, name).argtypes = getattr(real, name).argtypes
    return lib


def splits(targets: list[str]) -> dict:
    """Each GEMM alone at every (nt, mt, split_k, k_blocks), and the layer with the runner's own
    plan, for each target."""
    results = {}
    for target in targets:
        results[target] = _splits_of(target)
        print(target, json.dumps(results[target]), flush=True)
    return results


def _splits_of(target: str) -> dict:
    res = _timed_plans(target)
    return {"us": res["us"], "plan": res["plan"]}


def _timed_plans(target: str) -> dict:
    """Each GEMM alone at every plan (ring or direct, nt, share), the layer with the runner's
    own plans, and the model's plans (`jit.plan`)."""
    shape, w, sets, x, share = setup(target)
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    r = W4A16Runner()
    p = r.packed(w, shape.act.interleaved)
    T = x.shape[0]
    h = torch.empty(T * K, I, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(T, H, device=DEV, dtype=torch.bfloat16)
    flat = [(tk.ids.to(torch.int32).contiguous().view(-1),
             tk.weights.float().contiguous().view(-1)) for tk in sets]  # fmt: skip

    def gemm(kind: int, how: jit.Plan) -> None:
        for ids, tw in flat:
            if kind == jit.GATE_UP:
                jit.launch(kind, p.w13, x, ids, tw, p.b13, h, K, I, how, shape.act.name,
                           shape.act.alpha, shape.act.limit, zero_out=out)  # fmt: skip
            else:
                jit.launch(kind, p.w2, h, ids, tw, p.b2, out, K, H, how)

    fns, plans = {}, {}
    for ring in (True, False):
        for nt in (1, 2):
            for kind, shares in jit.SHARES.items():
                name = "gate_up" if kind == jit.GATE_UP else "down"
                for mt, sk, kb in shares:
                    how = jit.Plan(nt, sk, mt, kb, ring)
                    label = f"{name} {'ring' if ring else 'direct'} nt{nt} sk{sk} mt{mt} kb{kb}"
                    fns[label] = functools.partial(gemm, kind, how)
                    plans[label] = how
    fns["layer"] = lambda: run_layer(r, shape, w, sets, x, share)
    ms = time_ms_interleaved(fns, DEV, rounds=3)
    pairs = T * K * share
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    model = [jit.plan(kind, pairs, E, n, k, sms, jit.occupancy(w_, kind, shape.act.name,
                                                               b is not None, DEV))
             for kind, n, k, w_, b in ((jit.GATE_UP, I, H, p.w13, p.b13),
                                       (jit.DOWN, H, I, p.w2, p.b2))]  # fmt: skip
    return {"us": {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()},
            "plan": [str(pl) for pl in model], "model": model, "plans": plans,
            "weights": w, "shape": shape, "share": share}  # fmt: skip


def tune(jobs: list[str], formats: list[str], batches: list[int], out_dir: Path) -> dict:
    """The measured plan table (`moekit.runners.w4a16.plans`) of each job and format: at each
    batch size, the fastest plan of each GEMM of `_timed_plans`."""
    from moekit.runners.triton.configs import table_key
    from moekit.runners.w4a16 import plans as plan_tables

    report = {}
    for job in jobs:
        model, ep = job.split(":")
        for fmt in formats:
            if model.startswith("gpt-oss") and fmt == "int4_w4a16":
                continue  # group 128 does not divide its H = 2880
            table, us, name = {}, {}, None
            for T in batches:
                if T * preset(model).top_k > jit.MAX_PAIRS:
                    continue
                target = f"{model}:{ep}:{fmt}:{T}"
                res = _timed_plans(target)
                shape, w, share = res["shape"], res["weights"], res["share"]
                best, row = [], {}
                for gemm, model_plan in zip(plan_tables.GEMMS, res["model"], strict=True):
                    times = {k: t for k, t in res["us"].items() if k.startswith(gemm + " ")}
                    label = min(times, key=times.get)
                    best.append(res["plans"][label])
                    model_label = next(k for k, v in res["plans"].items()
                                       if v == model_plan and k.startswith(gemm + " "))  # fmt: skip
                    row[gemm] = {"best": label, "best_us": times[label],
                                 "model": model_label, "model_us": times[model_label]}  # fmt: skip
                key = table_key(T, share)
                table[key], us[str(key)] = tuple(best), row
                name = plan_tables.table_name_for(w, shape.top_k, shape.act,
                                                  torch.cuda.get_device_name(DEV))  # fmt: skip
                print(target, json.dumps(row), flush=True)
            if name is None:
                continue
            meta = {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__,
                    "measured_by": "scripts/gpu_w4a16_profile.py tune (8 uniform routings, "
                                   "each GEMM alone, CUDA-graph replay)", "us": us}  # fmt: skip
            plan_tables.write_table(out_dir / name, table, meta)
            report[name] = us
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("once", "variants", "splits", "build", "tune"))
    ap.add_argument("target", nargs="?")
    ap.add_argument("--targets", default="")
    ap.add_argument("--variants", default="base=")
    ap.add_argument("--defines", default="", help="splits: -D flags of the build, comma-separated")
    ap.add_argument("--tag", default="", help="splits: suffix of the output file name")
    ap.add_argument(
        "--jobs",
        default="qwen3-30b-a3b:ep1,gpt-oss-120b:ep1,deepseek-v3:ep8,mixtral-8x7b:ep1",
        help="tune: model:epN, comma-separated",
    )
    ap.add_argument("--formats", default="int4_w4a16,mxfp4,nvfp4")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument(
        "--out-dir",
        default="",
        help="tune: where the tables go (default: the package's src/moekit/configs/w4a16)",
    )
    a = ap.parse_args()
    if a.mode == "tune":
        from moekit.runners.w4a16 import plans as plan_tables

        out_dir = Path(a.out_dir) if a.out_dir else plan_tables.table_dir()
        res = tune(a.jobs.split(","), a.formats.split(","),
                   [int(b) for b in a.batches.split(",")], out_dir)  # fmt: skip
        with open(os.path.join(os.environ.get("OUT", "."), "w4a16_tune.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    if a.mode == "once":
        once(a.target)
        return 0
    if a.mode == "splits":
        if a.defines:  # one build variant for every GEMM
            defines = tuple(d for d in a.defines.split(",") if d)
            jit.library = functools.partial(
                lambda d, *x: _with_defines(BASE_LIBRARY, d, *x), defines
            )
        res = splits(a.targets.split(","))
        name = f"w4a16_splits{a.tag}.json"
        with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    specs = {}
    for item in a.variants.split(";"):
        name, _, defs = item.partition("=")
        specs[name] = [d for d in defs.split(",") if d]
    specs = {k: tuple(v) for k, v in specs.items()}
    if a.mode == "build":  # only build the variants (in parallel), e.g. beside other work
        prebuild(specs)
        return 0
    res = variants(a.targets.split(","), specs)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "w4a16_variants.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
