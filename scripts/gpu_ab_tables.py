"""A/B of two sets of triton-runner tables on one GPU: the shipped tables against re-tuned ones
(and the re-tuned ones with the down GEMM unsplit), alternating, several rounds.

    PYTHONPATH=src python3 scripts/gpu_ab_tables.py NEW_CONFIG_DIR [--points SPEC]
        # writes $OUT/ab_tables.json

NEW_CONFIG_DIR holds triton/*.json as `moekit tune` writes them (a MOEKIT_CONFIG_DIR).
SPEC: ';'-separated model:format:T1,T2 (format 'bf16' or a name of gpu_triton_quant.FORMATS),
default every preset at T = 1, 4, 16 in bf16, qwen3-30b-a3b in int4-g128 and gpt-oss-120b in
fp8 block-wise (no table of its own: the bf16 one, adapted). For each point: the whole runner call (`ops.fused_moe`, CUDA-graph replay of
rotated routings, `moekit.bench.time_ms`) with 'shipped', 'new' and 'new_unsplit' configs, in
turn, ROUNDS times; the median of each and the ratios shipped / new and new_unsplit / new.
Why: single timings of decode points move by 5-15% between runs on the H100, more than most
differences between configs, so a table is shipped only on a same-run, alternated comparison.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit.bench import time_ms
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton import ops

sys.path.insert(0, str(Path(__file__).parent))
from gpu_triton_quant import PRESET_PARALLEL, spec_points
from probe_out import write_probe

ROUNDS = int(os.environ.get("AB_ROUNDS", "5"))
DEFAULT = ";".join(
    [f"{m}:bf16:1,4,16" for m in PRESET_PARALLEL]
    + ["qwen3-30b-a3b:int4-g128:1,4,16", "gpt-oss-120b:fp8-block:1,4,16"]
)


def _configs(w, T, K, config_dir: str | None):
    """(gate_up, down) configs the runner looks up with MOEKIT_CONFIG_DIR = config_dir (None:
    a directory with no tables, so the shipped ones)."""
    os.environ["MOEKIT_CONFIG_DIR"] = config_dir or "/nonexistent/moekit-ab"
    tcfg.clear_cache()
    return ops.configs_for(T, K, w, torch.bfloat16, torch.device("cuda"))


def main() -> None:
    new_dir = sys.argv[1]
    spec = sys.argv[sys.argv.index("--points") + 1] if "--points" in sys.argv else DEFAULT
    dev = torch.device("cuda")
    out = {"new_dir": new_dir, "rounds": ROUNDS, "points": []}
    for model, fmt, shape, w, T, x, topks in spec_points(spec, dev):
        K, R = shape.top_k, len(topks)
        shipped = _configs(w, T, K, None)
        new = _configs(w, T, K, new_dir)
        variants = {"shipped": shipped, "new": new,
                    "new_unsplit": (new[0], replace(new[1], split_k=1))}  # fmt: skip

        def call(cfgs, w=w, x=x, topks=topks, act=shape.act):
            for t in topks:
                ops.fused_moe(x, t, w, act, configs=cfgs)

        times = {name: [] for name in variants}
        for _ in range(ROUNDS):
            for name, cfgs in variants.items():
                times[name].append(time_ms(lambda c=cfgs: call(c), dev, warmup=3,
                                           samples=10) / R * 1e3)  # fmt: skip
        med = {name: statistics.median(v) for name, v in times.items()}
        rec = {"model": model, "format": fmt, "T": T, "R": R,
               "us": {k: round(v, 2) for k, v in med.items()},
               "spread": {k: round((max(v) - min(v)) / statistics.median(v), 3)
                          for k, v in times.items()},
               "shipped_over_new": round(med["shipped"] / med["new"], 3),
               "unsplit_over_new": round(med["new_unsplit"] / med["new"], 3),
               "configs": {k: [str(c) for c in v] for k, v in variants.items()}}  # fmt: skip
        out["points"].append(rec)
        print(
            f"{model:14} {fmt:9} T={T:3}  shipped {med['shipped']:8.1f}  new "
            f"{med['new']:8.1f}  new_unsplit {med['new_unsplit']:8.1f} us  "
            f"shipped/new {rec['shipped_over_new']:.3f}  unsplit/new "
            f"{rec['unsplit_over_new']:.3f}  split_k {new[1].split_k}",
            flush=True,
        )
    write_probe("ab_tables.json", out)


if __name__ == "__main__":
    main()
