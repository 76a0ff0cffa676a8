"""Profile probes for the `w4a16` kernels (H100 findings: benchmarks/w4a16_notes.md).

    # one target, a few eager calls (for ncu -k regex:moe_w4):
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py once deepseek-v3:ep8:mxfp4:16
    # measured plan tables (the fastest (gate_up, down) pair per batch size) for the presets:
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py tune [--jobs qwen3-30b-a3b:ep1,...]
        [--formats int4_w4a16,mxfp4,nvfp4] [--batches 1,4,16,64] [--out-dir DIR]
    # each GEMM alone at every plan (optionally of one build variant), and the layer:
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py splits --targets T1,T2 [--defines=
        -DMK_STAGES=2 --tag _st2]
    # layer time (CUDA-graph replay over 8-64 routings, `routings`; the runner's plans, measured
    # where a table has the shape) per build variant (-D defines of the .cu;
    # `build` with the same --variants only builds them, in parallel):
    PYTHONPATH=src python3 scripts/gpu_w4a16_profile.py variants --targets T1,T2 \
        --variants "base=;st2=-DMK_STAGES=2;always=OVERLAP=1;new=TABLES=/tmp/tables"
    (OVERLAP=0 / 1: down never / always overlaps gate_up; TABLES=DIR: plan tables from DIR;
    DUPSCALES=1: int4 groups of 128 packed as groups of 64 with each scale twice, the scale
    traffic of the layout before session 57;
    @FILE first: another .cu source, e.g. an older kernel; where the time goes, with the
    kernel's probe flags: "full=;fixed=-DMK_PROBE_NO_CHUNKS=1;loads=-DMK_PROBE_NO_MATH=1")

A target is model:epN:format:T, the format as --quantization spells it (EP: the rank holds
E / N experts and sees every token; the routing is uniform over all E experts, pairs on other
ranks are masked).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

from moekit.bench import time_ms_interleaved
from moekit.presets import preset
from moekit.quant import make_spec, quantize_experts
from moekit.runners.w4a16 import W4A16Runner, jit, pack, plans
from moekit.tune import random_weights, shape_for, uniform_topk

DEV = torch.device("cuda")
BASE_LIBRARY = jit.library.__wrapped__  # the uncached builder (probes swap jit.library)
DOWN_OVERLAPS = jit.down_overlaps
TABLE_DIR = plans.table_dir


def routings(T: int, top_k: int, ep: int) -> int:
    """Routings a target is timed over: 8, or more (up to 64) so that they hold about 64 local
    pairs in all. At deepseek-v3 EP8 T = 1 a routing holds one local pair on average; session
    26's 8 routings held 2 local experts in all, so the tables were measured on empty calls."""
    return max(8, min(64, math.ceil(64 * ep / (T * top_k))))


def setup(target: str):
    model, ep, *fmt, T = target.split(":")  # the format may hold ':' (int4_w4a16:group_size=32)
    fmt = ":".join(fmt)
    ep, T = int(ep.removeprefix("ep")), int(T)
    tp = 2 if model.startswith("mixtral") else ep
    shape = shape_for(model, tp, ep)
    E_all, K = preset(model).num_experts, preset(model).top_k
    torch.manual_seed(0)
    w = quantize_experts(random_weights(shape, DEV), make_spec(fmt))
    gen = torch.Generator(device=DEV).manual_seed(T)
    sets = []
    for _ in range(routings(T, K, ep)):
        tk = uniform_topk(T, E_all, K, DEV, gen)
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
    builds = ((0, False, False, False), (0, True, False, False), (0, False, False, True),
              (0, True, False, True), (1, False, False, False), (1, False, True, False),
              (2, False, False, False), (2, False, True, False))  # fmt: skip
    jobs = [(_nvcc_defines(d), b) for d in specs.values() for b in builds]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        list(pool.map(lambda j: _with_defines(base, j[0], j[1], arch), jobs))


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
        tables = [Path(d.removeprefix("TABLES=")) for d in defines if d.startswith("TABLES=")]
        table_dir = (lambda d=tables[0]: d) if tables else TABLE_DIR
        lib_fn = functools.partial(lambda d, *a: _with_defines(base_library, d, *a),
                                   _nvcc_defines(defines))  # fmt: skip
        overlaps = (lambda *a, v=force[0]: v) if force else DOWN_OVERLAPS
        r = W4A16Runner()
        if "DUPSCALES=1" in defines:  # the runner answers every call with this copy
            r._packed = _Fixed(pack.pack_experts(_with_dup_scales(w), shape.act.interleaved))
        r.packed(w, shape.act.interleaved)

        def layer(r=r, lib_fn=lib_fn, overlaps=overlaps, table_dir=table_dir):
            jit.library = lib_fn
            jit.down_overlaps = overlaps
            plans.table_dir = table_dir
            jit._occupancy.cache_clear()  # the variant's own occupancy for the plan
            jit.plan.cache_clear()
            jit._down_overlaps.cache_clear()
            run_layer(r, shape, w, sets, x, share)

        layer()
        fns[name] = layer
    ms = time_ms_interleaved(fns, DEV)
    return {k: round(v * 1e3 / len(sets), 2) for k, v in ms.items()}


def _with_dup_scales(w):
    """int4 weights with groups of 128 as groups of 64, each scale (and zero) twice."""
    def dup(t):
        return None if t is None else t.repeat_interleave(2, dim=-1)

    assert w.spec.name == "int4_w4a16" and w.spec.group_size == 128, w.spec.describe()
    return dataclasses.replace(
        w, spec=dataclasses.replace(w.spec, group_size=64), w13_scale=dup(w.w13_scale),
        w2_scale=dup(w.w2_scale), w13_zero=dup(w.w13_zero), w2_zero=dup(w.w2_zero))  # fmt: skip


class _Fixed:
    """A runner's packed-weights cache that always answers with one copy."""

    def __init__(self, packed):
        self.packed = packed

    def get(self, tensors, tag, build):
        return self.packed


def _nvcc_defines(defines: tuple[str, ...]) -> tuple[str, ...]:
    """A variant's -D flags for nvcc, without the probe's own tokens (OVERLAP=, TABLES=,
    DUPSCALES=)."""
    return tuple(d for d in defines if not d.startswith(("OVERLAP=", "TABLES=", "DUPSCALES=")))


@functools.cache
def _with_defines(base, defines: tuple[str, ...], build, arch):
    from moekit.runners import _nvcc
    from moekit.runners.w4a16.jit import SOURCE

    source = SOURCE
    if defines and defines[0].startswith("@"):  # another source file (e.g. an older kernel)
        source, defines = Path(defines[0][1:]).resolve(), defines[1:]
    args = [*jit.nvcc_args(build, arch, source), *defines]  # later -D flags win
    import ctypes

    path = _nvcc.build(_nvcc.nvcc(), args, "w4a16", [source.read_bytes()], "w4a16 variant")
    lib = ctypes.CDLL(str(path))
    real = base(build, arch)  # for the ctypes signatures
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


class Gemms:
    """One target's weights, routings and buffers, and its GEMMs launched as the runner does."""

    def __init__(self, target: str) -> None:
        self.shape, self.w, self.sets, self.x, self.share = setup(target)
        s = self.shape
        self.runner = W4A16Runner()
        self.p = self.runner.packed(self.w, s.act.interleaved)
        T = self.x.shape[0]
        self.h = torch.empty(T * s.top_k, s.intermediate, device=DEV, dtype=torch.bfloat16)
        self.out = torch.empty(T, s.hidden, device=DEV, dtype=torch.bfloat16)
        self.flat = [(tk.ids.to(torch.int32).contiguous().view(-1),
                      tk.weights.float().contiguous().view(-1)) for tk in self.sets]  # fmt: skip

    def gemm(self, kind: int, how: jit.Plan) -> None:
        """One GEMM alone over every routing."""
        for ids, tw in self.flat:
            self._one(kind, how, ids, tw)

    def _one(self, kind: int, how: jit.Plan, ids, tw, overlap: bool = False) -> None:
        s, p = self.shape, self.p
        if kind == jit.GATE_UP:
            jit.launch(kind, p.w13, self.x, ids, tw, p.b13, self.h, s.top_k, s.intermediate,
                       how, s.act.name, s.act.alpha, s.act.limit, zero_out=self.out)  # fmt: skip
        else:
            jit.launch(kind, p.w2, self.h, ids, tw, p.b2, self.out, s.top_k, s.hidden, how,
                       overlap=overlap)  # fmt: skip

    def overlaps(self, gate_up: jit.Plan, down: jit.Plan) -> bool:
        """The runner's decision (`jit.down_overlaps`) for this plan pair."""
        s, p = self.shape, self.p
        return jit.down_overlaps(p.w13, p.w2, s.act.name, p.b13 is not None, gate_up, down,
                                 self.x.shape[0] * s.top_k, s.top_k, DEV)  # fmt: skip

    def pair(self, gate_up: jit.Plan, down: jit.Plan) -> None:
        """gate_up then down over every routing, as the runner launches them."""
        overlap = self.overlaps(gate_up, down)
        for ids, tw in self.flat:
            self._one(jit.GATE_UP, gate_up, ids, tw)
            self._one(jit.DOWN, down, ids, tw, overlap)


def _label(kind: int, how: jit.Plan) -> str:
    name = "gate_up" if kind == jit.GATE_UP else "down"
    return (f"{name} {'ring' if how.ring else 'direct'} nt{how.nt} sk{how.split_k} mt{how.mt} "
            f"kb{how.k_blocks}")  # fmt: skip


def _all_plans(kind: int) -> list[jit.Plan]:
    return [jit.Plan(nt, sk, mt, kb, ring) for ring in (True, False) for nt in (1, 2)
            for mt, sk, kb in jit.SHARES[kind]]  # fmt: skip


def _timed_plans(target: str) -> dict:
    """Each GEMM alone at every plan (ring or direct, nt, share), the layer with the runner's
    own plans, and the model's plans (`jit.plan`)."""
    g = Gemms(target)
    shape, w, p = g.shape, g.w, g.p
    E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
    fns, by_label = {}, {}
    for kind in (jit.GATE_UP, jit.DOWN):
        for how in _all_plans(kind):
            label = _label(kind, how)
            fns[label] = functools.partial(g.gemm, kind, how)
            by_label[label] = how
    fns["layer"] = lambda: run_layer(g.runner, shape, w, g.sets, g.x, g.share)
    ms = time_ms_interleaved(fns, DEV, rounds=3)
    pairs = g.x.shape[0] * K * g.share
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    model = [jit.plan(kind, pairs, E, n, k, sms, jit.occupancy(w_, kind, shape.act.name,
                                                               b is not None, DEV))
             for kind, n, k, w_, b in ((jit.GATE_UP, I, H, p.w13, p.b13),
                                       (jit.DOWN, H, I, p.w2, p.b2))]  # fmt: skip
    return {"us": {k: round(v * 1e3 / len(g.sets), 2) for k, v in ms.items()},
            "plan": [str(pl) for pl in model], "model": model, "plans": by_label,
            "gemms": g}  # fmt: skip


PAIR_GATE_UPS = 3  # gate_up plans (the fastest alone) tried with every down plan


def _timed_pairs(g: Gemms, gate_ups: list[jit.Plan]) -> dict[tuple[jit.Plan, jit.Plan], float]:
    """gate_up then down as the runner launches them (down overlapping where the rule says),
    for each of `gate_ups` with every down plan: us per call. What each GEMM takes alone misses
    what the two do to each other (a down grid that fills a wave may start during gate_up's
    tail, benchmarks/w4a16_notes.md, session 26)."""
    fns = {(gu, dn): functools.partial(g.pair, gu, dn)
           for gu in gate_ups for dn in _all_plans(jit.DOWN)}  # fmt: skip
    ms = time_ms_interleaved(fns, DEV, rounds=3)
    return {k: round(v * 1e3 / len(g.sets), 2) for k, v in ms.items()}


def _confirmed(g: Gemms, best, alone_pair) -> tuple[tuple[jit.Plan, jit.Plan], dict]:
    """The fastest of many noisy timings is biased toward a lucky one (session 26: two H200
    tables lost 4-8% to the pair of the two plans fastest alone). Re-time the winner against
    that pair, in turns, and keep it only if it still wins."""
    if best == alone_pair:
        return best, {}
    fns = {"best": functools.partial(g.pair, *best), "alone": functools.partial(g.pair, *alone_pair)}
    ms = time_ms_interleaved(fns, DEV, rounds=6, samples=36)
    us = {k: round(v * 1e3 / len(g.sets), 2) for k, v in ms.items()}
    return (best if us["best"] < us["alone"] else alone_pair), us


def tune(jobs: list[str], formats: list[str], batches: list[int], out_dir: Path) -> dict:
    """The measured plan table (`moekit.runners.w4a16.plans`) of each job and format: at each
    batch size, the (gate_up, down) pair fastest when run as the runner runs them
    (`_timed_pairs`: the PAIR_GATE_UPS fastest gate_up plans alone, with every down plan),
    confirmed against the pair of the two fastest alone (`_confirmed`)."""
    from moekit.runners._tables import table_key

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
                g, alone = res["gemms"], res["us"]
                row, fastest = {}, []
                for gemm, kind, model_plan in zip(plans.GEMMS, (jit.GATE_UP, jit.DOWN),
                                                  res["model"], strict=True):  # fmt: skip
                    times = {k: t for k, t in alone.items() if k.startswith(gemm + " ")}
                    order = sorted(times, key=times.get)
                    fastest.append([res["plans"][k] for k in order])
                    model_label = _label(kind, model_plan)
                    row[gemm] = {"alone_best": order[0], "alone_best_us": times[order[0]],
                                 "model": model_label, "model_us": times[model_label]}  # fmt: skip
                pairs = _timed_pairs(g, fastest[0][:PAIR_GATE_UPS])
                alone_pair = (fastest[0][0], fastest[1][0])  # timed: every down is in `pairs`
                best, recheck = _confirmed(g, min(pairs, key=pairs.get), alone_pair)
                row["pair"] = {
                    "best": [_label(jit.GATE_UP, best[0]), _label(jit.DOWN, best[1])],
                    "best_us": pairs[best], "overlap": g.overlaps(*best),
                    "alone_best_pair_us": pairs[alone_pair],
                    "alone_best_overlap": g.overlaps(*alone_pair), "recheck_us": recheck,
                }  # fmt: skip
                key = table_key(T, g.share)
                table[key], us[str(key)] = best, row
                name = plans.table_name_for(g.w, g.shape.top_k, g.shape.act,
                                            torch.cuda.get_device_name(DEV))  # fmt: skip
                print(target, json.dumps(row), flush=True)
            if name is None:
                continue
            meta = {"device": torch.cuda.get_device_name(DEV), "torch": torch.__version__,
                    "measured_by": "scripts/gpu_w4a16_profile.py tune (8-64 uniform routings, "
                                   "CUDA-graph replay; each GEMM alone, then the "
                                   f"{PAIR_GATE_UPS} fastest gate_up plans with every down "
                                   "plan as the runner launches them, the winner re-timed "
                                   "against the pair fastest alone)", "us": us}  # fmt: skip
            plans.write_table(out_dir / name, table, meta)
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
        out_dir = Path(a.out_dir) if a.out_dir else plans.table_dir()
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
