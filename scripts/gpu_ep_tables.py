"""The `triton` runner's tables for an EP rank that sees every token (deepseek-v3 at EP8, rank 0
of 8: about T * K / 8 local pairs), tuned with that routing and looked up for T * local_share
tokens, against the tables tuned with every pair local and looked up for T.

    PYTHONPATH=src python3 scripts/gpu_ep_tables.py [--formats unquantized,fp8_w8a8]
        [--batches 1,4,...] [--no-tune]

1. `moekit.tune.tune(shape_for('deepseek-v3', 8, 8), ...)` per format into $OUT/cfg, which
   starts as a copy of the shipped tables (so the files written hold the all-local keys and
   the new fractional ones: 0.125, 0.5, 2, ...).
2. Through the layer (MoE.forward_topk, `triton` runner, CUDA-graph replay, the backends'
   input sets rotated as `moekit bench` does), timed in turns per T:
     all_local  the dispatcher's local_share forced to 1 (the lookup before this change)
     ep         local_share 1/8 (keys T / 8, tuned with EP routing)
Writes $OUT/ep_tables.json and $OUT/cfg.tgz (the merged tables).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path
from unittest import mock

import torch

OUT = Path(os.environ.get("OUT", "."))
CFG = OUT / "cfg"
os.environ["MOEKIT_CONFIG_DIR"] = str(CFG)  # before moekit reads it

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.report import metadata
from moekit.runners.triton import configs as tcfg
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets
from moekit.tune import BATCH_SIZES, shape_for, tune


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def main() -> None:
    formats = _option("--formats", "unquantized,fp8_w8a8").split(",")
    batches = [int(b) for b in _option("--batches", ",".join(map(str, BATCH_SIZES))).split(",")]
    (CFG / "triton").mkdir(parents=True, exist_ok=True)
    for f in tcfg.shipped_dir().glob("*E=32,*"):
        shutil.copy(f, CFG / "triton" / f.name)
    out = {"meta": metadata(command=" ".join(["python", *sys.argv])), "tuned": {}, "layer": {}}
    shape = shape_for("deepseek-v3", 8, 8)
    for fmt in formats:
        if "--no-tune" not in sys.argv:
            rep = tune(shape, batches, out_dir=CFG / "triton", device="cuda", progress=False,
                       note="EP routing: rank 0 of 8 sees every token (scripts/gpu_ep_tables.py)",
                       quantization=None if fmt == "unquantized" else fmt)  # fmt: skip
            out["tuned"][fmt] = {str(r.num_tokens): round(r.ratio, 3) for r in rep.results}
            print(fmt, "tuned", out["tuned"][fmt], flush=True)
        tcfg.clear_cache()
        spec = sweep_spec("deepseek-v3", tp_size=8, ep_size=8, quantization=fmt,
                          batch_sizes=tuple(batches), backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        disp = module.dispatcher
        share = disp._share
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))

            def run(s, sets=sets, disp=disp, module=module):
                return layer_over_sets(module, sets, lambda: mock.patch.object(disp, "_share", s))

            ms = time_ms_interleaved({"all_local": run(1.0), "ep": run(share)}, "cuda",
                                     rounds=6, samples=36)  # fmt: skip
            row = {k: v / len(sets) for k, v in ms.items()}
            row["speedup"] = row["all_local"] / row["ep"]
            out["layer"][f"{fmt} T={T}"] = row
            print(fmt, T, {k: round(v, 4) for k, v in row.items()}, flush=True)
        del module
        torch.cuda.empty_cache()
    (OUT / "ep_tables.json").write_text(json.dumps(out, indent=1))
    with tarfile.open(OUT / "cfg.tgz", "w:gz") as tar:
        tar.add(CFG / "triton", arcname="triton")


if __name__ == "__main__":
    main()
