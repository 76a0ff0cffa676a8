"""The one-launch decode kernel (`ops.decode`) against the two-GEMM path, through the layer in turns.

    PYTHONPATH=src python3 scripts/gpu_decode_fused.py [--jobs 'J1;J2'] [--batches 1,4,16]
        [--configs all|heuristic] [--out NAME]

A job is `preset tp ep format` (e.g. 'deepseek-v3 8 8 fp8_w8a8'). Per job and batch size T, the
layer (MoE.forward_topk, `triton` runner, CUDA-graph replay, the input sets rotated as `moekit
bench` does) runs
  two         with the two GEMMs and their tables (`PIPELINE.decode_max_pairs` 0),
  decode      with `ops.decode` and the heuristic `configs.decode_config`,
  mM iI kK hH wW sS [swap] [tma]   with `ops.decode` and each config of CONFIGS (--configs all),
timed in turns (`time_ms_interleaved`). Prints and writes $OUT/NAME.json (default
decode_fused): microseconds per call, time / floor (ceilings measured in the same run), the
best variant and decode's speed-up over two.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from moekit.bench import ceilings_for_format, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.report import metadata
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton import ops
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, _l2_bytes, build_layer, layer_over_sets

OUT = Path(os.environ.get("OUT", "."))
JOBS = ("qwen3-30b-a3b 1 1 unquantized;qwen3-30b-a3b 1 1 fp8_w8a8;deepseek-v3 8 8 unquantized;"
        "deepseek-v3 8 8 fp8_w8a8;gpt-oss-120b 1 1 unquantized;mixtral-8x7b 2 1 unquantized;"
        "qwen3-30b-a3b 1 1 mxfp4;gpt-oss-120b 1 1 mxfp4;deepseek-v3 8 8 int4_w4a16")  # fmt: skip
CONFIGS = (
    tcfg.DecodeConfig(16, 128, 256),
    tcfg.DecodeConfig(32, 128, 256),
    tcfg.DecodeConfig(64, 128, 256),
    tcfg.DecodeConfig(32, 128, 128),
    tcfg.DecodeConfig(32, 128, 512),
    tcfg.DecodeConfig(32, 256, 256),
    tcfg.DecodeConfig(32, 128, 256, num_stages=4),
    tcfg.DecodeConfig(32, 128, 256, num_warps=8),
    tcfg.DecodeConfig(64, 128, 256, swap_ab=True),
    tcfg.DecodeConfig(32, 128, 256, block_m=1),
)


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def _name(c: tcfg.DecodeConfig) -> str:
    return (f"m{c.block_m} i{c.block_i} k{c.block_k} h{c.block_h} w{c.num_warps} s{c.num_stages}"
            + (" swap" if c.swap_ab else "") + (" tma" if c.tma else ""))  # fmt: skip


def variants(which: str) -> dict:
    """name -> (PipelineConfig, decode_config replacement or None for the heuristic)."""
    off = replace(tcfg.PIPELINE, decode_max_pairs=0.0)
    on = replace(tcfg.PIPELINE, decode_max_pairs=1e9)
    out = {"two": (off, None), "decode": (on, None)}
    if which == "all":
        for c in CONFIGS:
            out[_name(c)] = (on, c)
    return out


def main() -> None:
    jobs = [j.split() for j in _option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in _option("--batches", "1,4,16").split(",")]
    which = _option("--configs", "all")
    out_name = _option("--out", "decode_fused")
    res = {"meta": metadata(command=" ".join(["python", *sys.argv])), "points": {}}
    for model, tp, ep, fmt in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=fmt,
                          batch_sizes=tuple(batches), backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        ceilings = ceilings_for_format("cuda", spec.moe.torch_dtype, spec.moe.weight_format)
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            sets, cost, _ = _input_sets(spec, module, T, gen, _l2_bytes("cuda"))
            floor_us = cost.floor_s(ceilings) * 1e6

            def make(pipe, cfg, sets=sets, module=module):
                @contextlib.contextmanager
                def around():
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(mock.patch.object(ops, "PIPELINE", pipe))
                        if cfg is not None:
                            stack.enter_context(
                                mock.patch.object(ops, "decode_config", lambda *a, **k: cfg)
                            )
                        yield

                return layer_over_sets(module, sets, around)

            fns = {n: make(p, c) for n, (p, c) in variants(which).items()}
            try:
                ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            except Exception as err:  # noqa: BLE001 - report and go on
                print(model, fmt, T, "failed:", repr(err)[:400], flush=True)
                res["points"][f"{model} tp{tp} ep{ep} {fmt} T={T}"] = {"error": repr(err)[:400]}
                continue
            us = {n: round(v * 1e3 / len(sets), 2) for n, v in ms.items()}
            best = min(us, key=us.get)
            name = f"{model} tp{tp} ep{ep} {fmt} T={T}"
            res["points"][name] = {
                "us": us,
                "floor_us": round(floor_us, 2),
                "over_floor": {n: round(v / floor_us, 3) for n, v in us.items()},
                "best": best,
                "decode_speedup": round(us["two"] / us["decode"], 3),
                "best_speedup": round(us["two"] / us[best], 3),
            }
            print(name, f"floor {floor_us:.1f}", us, "->", best,
                  f"decode x{us['two'] / us['decode']:.3f}", flush=True)  # fmt: skip
            (OUT / f"{out_name}.json").write_text(json.dumps(res, indent=1))
        del module
        torch.cuda.empty_cache()
    (OUT / f"{out_name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
