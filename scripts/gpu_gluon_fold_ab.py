"""The triton_kernel runner's Gluon engine with an expert's last rows folded into its tile before
(`GluonConfig.fold_rows`) against the engine without, and against the `triton` runner: the
layer on `moekit bench`'s input sets, timed in turns (issue 5: `triton_kernel` faster than
`triton` at T >= 4096).

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_gluon_fold_ab.py [--jobs 'J1;J2']
        [--batches 1024,4096,16384] [--folds 0,16] [--rounds 4] [--out NAME]

A job is `preset tp ep`. A fold is `auto` (the engine's own rule, `gluon_ops.config_for`), a
fold size R (`tk foldR`, at every batch size), or one of two diagnostics:
`R-notiles` (the kernels built for R side rows, the routing folding none: what the code costs
tiles that do not fold) and `R-w64` (every epilogue store split at 64 columns, as folding
kernels do). Any of them may end in `+field=value` edits of the engine's config
(`auto+gate_up_block_n=64+gate_up_stages=6`: the rule's config with those fields replaced).
Per point: microseconds a call (over the bench's input sets) of `triton` and of
`triton_kernel` at each fold, the speed-up of each over `triton`, of each fold over the first,
the largest relative difference of each output from `triton`'s, and the work tiles of the
first set's routing at each size; variants that fail (a config past shared memory) are listed
under `failed`. Writes $OUT/NAME.json (default gluon_fold.json).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from dataclasses import replace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import config_edits, option, write_probe

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
import moekit.runners.triton_kernel as tk_pkg
from moekit.runners.triton_kernel import _gluon_kernels, gluon_ops, routing
from moekit.runners.triton_kernel.routing import route
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets, rel_err

JOBS = "qwen3-30b-a3b 1 1;mixtral-8x7b 2 1;deepseek-v3 8 8;gpt-oss-120b 1 1"


@functools.cache
def _w64_kernels():
    """A copy of `_gluon_kernels` whose epilogues always store in 64-column pieces."""
    src = open(_gluon_kernels.__file__).read()
    old = "STORE_W: gl.constexpr = 64 if FOLD > 0 else 128"
    assert src.count(old) == 2, "the kernels' STORE_W line changed"
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "_gluon_kernels_w64.py")
    with open(path, "w") as f:
        f.write(src.replace(old, "STORE_W: gl.constexpr = 64"))
    spec = importlib.util.spec_from_file_location("_gluon_kernels_w64", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _variant(module, cache: RunnerCache, fold: str):
    """The layer on `cache`'s runners, the Gluon engine at `fold` (module docstring)."""
    fold, fields = config_edits(fold)
    rows, _, diag = fold.partition("-")
    if rows != "auto":
        fields["fold_rows"] = int(rows)
    plain_config = gluon_ops.config_for

    def config_for(w, rows_per_expert=None):
        return replace(plain_config(w, rows_per_expert), **fields)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(module, "runners", cache))
        if fields:
            stack.enter_context(mock.patch.object(gluon_ops, "config_for", config_for))
        if diag == "notiles":
            plain = routing.route
            stack.enter_context(mock.patch.object(
                routing, "route", lambda ids, E, bm, f=0: replace(plain(ids, E, bm), fold=f)))
        elif diag == "w64":
            stack.enter_context(mock.patch.object(tk_pkg, "_gluon_kernels", _w64_kernels()))
        yield


def _tiles(topk, E: int, fold: int) -> int:
    """Work tiles of rank 0's routing (ids under E local; EPLB off)."""
    ids = topk.ids.to(torch.int32)
    ids = torch.where(ids < E, ids, -1).contiguous()  # an EP rank's other experts: masked
    return int(route(ids, E, 128, fold).num_tiles.item())


def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", "1024,4096,16384").split(",")]
    folds = option("--folds", "0,16").split(",")
    name = option("--out", "gluon_fold") + ".json"
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for model, tp, ep in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization="unquantized",
                          batch_sizes=tuple(batches), backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        caches = {"triton": RunnerCache(RunnerConfig("triton")),
                  "tk": RunnerCache(RunnerConfig("triton_kernel"))}  # fmt: skip
        E_local = module.expert_weights.num_experts
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))

            variants = {"triton": lambda m=module, c=caches["triton"]: _variant(m, c, "0")}
            variants |= {f"tk fold{f}": lambda m=module, c=caches["tk"], f=f: _variant(m, c, f)
                         for f in folds}  # fmt: skip
            outs, failed = {}, {}
            for n, ctx in list(variants.items()):
                try:
                    with ctx(), torch.no_grad():
                        outs[n] = module.forward_topk(*sets[0]).float()
                except Exception as err:  # noqa: BLE001 - e.g. a config past shared memory
                    failed[n] = f"{type(err).__name__}: {str(err)[:200]}"
                    del variants[n]
            fns = {n: layer_over_sets(module, sets, ctx) for n, ctx in variants.items()}
            ms = time_ms_interleaved(fns, "cuda", rounds=int(option("--rounds", "4")), samples=16)
            us = {n: round(v * 1e3 / len(sets), 1) for n, v in ms.items()}
            point = f"{model} tp{tp} ep{ep} T={T}"
            res["points"][point] = {
                "us": us,
                "triton_over": {n: round(us["triton"] / v, 4) for n, v in us.items()},
                "fold_gain": {f"fold{f}": round(us[f"tk fold{folds[0]}"] / us[f"tk fold{f}"], 4)
                              for f in folds if f"tk fold{f}" in us},  # fmt: skip
                "failed": failed,
                "rel_err_vs_triton": {n: rel_err(o, outs["triton"]) for n, o in outs.items()},
                "tiles": {f"fold{f}": _tiles(sets[0][1], E_local,
                                             int(f.split("+")[0].split("-")[0]))
                          for f in folds if not f.startswith("auto")},  # fmt: skip
                "sets": len(sets),
            }
            print(point, res["points"][point], flush=True)
            write_probe(name, res)
        del module, caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
