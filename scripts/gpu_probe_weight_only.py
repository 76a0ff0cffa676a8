"""fp8 block-wise decode: the triton runner's w8a8 kernels against the same weights run
weight-only (`GemmConfig.weight_only`: fp8 weights scaled in registers, bf16 activations,
bf16 tensor cores), and the bf16 runner for the fp8 / bf16 ratio, in one run.

    PYTHONPATH=src python3 scripts/gpu_probe_weight_only.py [--points SPEC] [--write DIR]
        # writes $OUT/weight_only.json

SPEC: ';'-separated model:T1,T2 (default the four presets at T = 1, 4, 16, 64; deepseek-v3 at
EP8 as `moekit bench` times rank 0: global routing, other ranks' ids masked, tables looked up
by T / 8). Per point, timed
in turns (`moekit.bench.time_ms_interleaved`, CUDA-graph replay of R rotated routings, the
whole `ops.fused_moe` call):
  w8a8       the fp8 configs the runner looks up now;
  wo_fp8     the same configs with weight_only;
  wo_bf16    the bf16 runner's configs for T with weight_only;
  bf16       bf16 weights with their configs (the denominator of issue 4's fp8 / bf16 ratio).
Each variant's output is checked against the torch runner (relative error).
--write DIR: fp8 tables in DIR/triton for every model (the shipped table, or the configs the
runner looks up now at the usual batch sizes where there is none), with the fastest
weight-only pair at each point where it beats w8a8 by WIN (default 2%) in this run.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from moekit.bench import time_ms_interleaved
from moekit.quant import Fp8W8A8, quantize_experts
from moekit.router import TopKOutput
from moekit.runners.torch import TorchRunner
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton import ops
from moekit.stages import StandardDispatchOutput
from moekit.tune import random_weights, shape_for, uniform_topk

sys.path.insert(0, str(Path(__file__).parent))
from gpu_triton_quant import PRESET_PARALLEL, ROTATE_BYTES, rel_err, weight_bytes

ROUNDS = int(os.environ.get("WO_ROUNDS", "4"))
WIN = float(os.environ.get("WO_WIN", "0.02"))
DEFAULT = ";".join(f"{m}:1,4,16,64" for m in PRESET_PARALLEL)
TABLE_KEYS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SPEC = Fp8W8A8("block")


def _option(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def _rank0_topk(T: int, E: int, K: int, ep: int, dev, gen) -> TopKOutput:
    """Uniform routing over the E * ep experts of all ranks, as rank 0 (experts 0..E-1) sees
    it: the other ranks' ids masked (-1), as `moekit bench` times an EP rank."""
    t = uniform_topk(T, E * ep, K, dev, gen)
    return TopKOutput(t.weights, torch.where(t.ids < E, t.ids, -1))


def write_tables(out_dir: Path, model: str, w8, winners: dict) -> list[str]:
    """The fp8 tables of `model` with the winning weight-only pairs (`winners`: T -> pair)."""
    dev = torch.cuda.get_device_name()
    E, H, I = w8.num_experts, w8.hidden_size, w8.intermediate_size
    quant = tcfg.quant_tag(w8.spec)
    written = []
    for which, gemm in enumerate(("gate_up", "down")):
        n, k = tcfg.gemm_shape(gemm, H, I)
        key = tcfg.TableKey(gemm, E, n, k, "bfloat16", dev, tcfg.triton_version(), quant)
        table = tcfg.find_table(key)
        if table is not None and Path(table.source).name == key.filename():
            data = json.loads(Path(table.source).read_text())
            configs = dict(table.configs)
            meta = data.get("meta", {})
        else:
            tp, ep = PRESET_PARALLEL[model]
            K = shape_for(model, tp, ep).top_k
            configs = {tcfg.table_key(T, 1 / ep): ops.configs_for(
                tcfg.table_key(T, 1 / ep), K, w8, torch.bfloat16, torch.device("cuda"))[which]
                for T in TABLE_KEYS}  # fmt: skip
            meta = {"note": "the configs the runner used before (bf16 table adapted to fp8 "
                            "block-wise) at every key but the weight-only ones"}  # fmt: skip
        for T, pair in winners.items():
            configs[T] = pair[which]
        meta["weight_only"] = {
            "note": "decode keys run weight-only (GemmConfig.weight_only) where "
                    "scripts/gpu_probe_weight_only.py timed them faster than w8a8 "
                    f"(alternated, {ROUNDS} rounds, win > {WIN:.0%})",
            "keys": sorted(winners),
        }  # fmt: skip
        path = out_dir / "triton" / key.filename()
        tcfg.write_table(path, key, configs, meta)
        written.append(str(path))
    return written


def main() -> None:
    spec = _option("--points") or DEFAULT
    out_dir = _option("--write")
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "rounds": ROUNDS, "win": WIN, "points": [],
           "tables": []}  # fmt: skip
    for item in spec.split(";"):
        model, sizes = item.split(":")
        tp, ep = PRESET_PARALLEL[model]
        shape = shape_for(model, tp, ep)
        E, K, H = shape.num_experts, shape.top_k, shape.hidden
        torch.manual_seed(0)
        wb = random_weights(shape, dev)
        w8 = quantize_experts(wb, SPEC)
        gen = torch.Generator(device=dev).manual_seed(1)
        winners = {}
        for T in (int(t) for t in sizes.split(",")):
            R = max(1, min(16, math.ceil(ROTATE_BYTES / (min(E, T * K) * weight_bytes(w8)))))
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
            topks = [_rank0_topk(T, E, K, ep, dev, gen) for _ in range(R)]
            key = tcfg.table_key(T, 1 / ep)  # as the runner looks tables up on an EP rank
            c8 = ops.configs_for(key, K, w8, torch.bfloat16, dev)
            cb = ops.configs_for(key, K, wb, torch.bfloat16, dev)
            variants = {
                "w8a8": (w8, c8),
                "wo_fp8": (w8, tuple(replace(c, weight_only=True) for c in c8)),
                "wo_bf16": (w8, tuple(replace(c, weight_only=True) for c in cb)),
                "bf16": (wb, cb),
            }
            ref = TorchRunner().run(StandardDispatchOutput(x, topks[0]), w8, shape.act).out
            errs = {name: rel_err(ops.fused_moe(x, topks[0], w, shape.act, configs=c), ref)
                    for name, (w, c) in variants.items() if name != "bf16"}  # fmt: skip

            def call(w, c, x=x, topks=topks, act=shape.act):
                for t in topks:
                    ops.fused_moe(x, t, w, act, configs=c)

            fns = {name: (lambda w=w, c=c: call(w, c)) for name, (w, c) in variants.items()}
            ms = time_ms_interleaved(fns, dev, rounds=ROUNDS, warmup=3, samples=4 * ROUNDS)
            us = {name: v / R * 1e3 for name, v in ms.items()}
            best = min(("wo_fp8", "wo_bf16"), key=us.get)
            fp8_us = us[best] if us[best] < us["w8a8"] * (1 - WIN) else us["w8a8"]
            if fp8_us < us["w8a8"]:
                winners[key] = variants[best][1]
            rec = {"model": model, "T": T, "key": key, "R": R, "us": {k: round(v, 2) for k, v in us.items()},
                   "rel_err_vs_torch": {k: round(v, 5) for k, v in errs.items()},
                   "w8a8_over_best_wo": round(us["w8a8"] / us[best], 3), "best_wo": best,
                   "bf16_over_fp8_before": round(us["bf16"] / us["w8a8"], 3),
                   "bf16_over_fp8_after": round(us["bf16"] / fp8_us, 3),
                   "configs": {k: [str(c) for c in v[1]] for k, v in variants.items()}}  # fmt: skip
            out["points"].append(rec)
            print(f"{model:14} T={T:3}  " + "  ".join(f"{k} {v:8.1f}" for k, v in us.items())
                  + f" us  w8a8/{best} {rec['w8a8_over_best_wo']:.3f}  bf16/fp8 "
                  f"{rec['bf16_over_fp8_before']:.2f} -> {rec['bf16_over_fp8_after']:.2f}  "
                  f"err {errs}", flush=True)  # fmt: skip
        if out_dir and winners:
            out["tables"] += write_tables(Path(out_dir), model, w8, winners)
        del wb, w8
        torch.cuda.empty_cache()
    path = Path(os.environ.get("OUT", ".")) / "weight_only.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
