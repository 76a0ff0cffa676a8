"""Decode-time choices of the `triton` runner's pipeline (`PipelineConfig`), timed through the
layer in turns.

    PYTHONPATH=src python3 scripts/gpu_probe_decode_pdl.py [--variants pdl|direct]
        [--jobs 'J1;J2'] [--batches 1,4,16,64] [--out NAME]
    ... --variants FIELD=V1,V2,...   (an int or bool field of PipelineConfig, set to each value)
    ... --set F1=V,F2=V   (int or bool fields set in every variant first)

A job is `preset tp ep format` (e.g. 'deepseek-v3 8 8 fp8_w8a8'). Per job and batch size T the
layer (MoE.forward_topk, `triton` runner, the shipped tables, CUDA-graph replay, the input sets
rotated as `moekit bench` does) runs with (--variants pdl, the default):
  plain        PIPELINE with pdl off
  pdl          PIPELINE with pdl on and decode_max_pairs unbounded (so that each T is measured)
or (--variants direct):
  align        the alignment kernel from T = 2 (direct_max_tokens 1)
  direct       direct rows, no alignment kernel, up to the largest T of --batches
Writes $OUT/NAME.json (default decode_pdl.json / decode_direct.json): per point the
microseconds of each, the fastest, and the first variant's time over the fastest's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from unittest import mock


sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, triton_layer_points, write_probe

from moekit.bench import time_ms_interleaved
from moekit.runners.triton import ops
from moekit.sweep import layer_over_sets

JOBS = ("qwen3-30b-a3b 1 1 unquantized;qwen3-30b-a3b 1 1 fp8_w8a8;"
        "deepseek-v3 8 8 unquantized;deepseek-v3 8 8 fp8_w8a8;"
        "gpt-oss-120b 1 1 unquantized;gpt-oss-120b 1 1 fp8_w8a8;"
        "mixtral-8x7b 2 1 unquantized;mixtral-8x7b 2 1 fp8_w8a8")  # fmt: skip



def _field(base, field: str, value: str):
    return replace(base, **{field: type(getattr(base, field))(int(value))})


def variants(kind: str, batches: list[int], base=None) -> dict:
    """name -> PipelineConfig; the first is the baseline."""
    base = base or ops.PIPELINE
    if "=" in kind:  # FIELD=V1,V2,...: `base` with FIELD set to each value
        field, values = kind.split("=")
        return {f"{field}={v}": _field(base, field, v) for v in values.split(",")}
    if kind == "direct":
        return {"align": replace(base, direct_max_tokens=1),
                "direct": replace(base, direct_max_tokens=max(batches))}  # fmt: skip
    plain = replace(base, decode_max_pairs=1 << 30, pdl=False)
    return {"plain": plain, "pdl": replace(plain, pdl=True)}


def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", "1,4,16,64").split(",")]
    kind = option("--variants", "pdl")
    name = option("--out", f"decode_{kind.split('=')[0]}") + ".json"
    base = ops.PIPELINE
    for item in filter(None, option("--set", "").split(",")):
        base = _field(base, *item.split("="))
    pipes = variants(kind, batches, base)
    first = next(iter(pipes))
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {},
                 "base": {f: getattr(base, f) for f in vars(base)}}
    for point, _, module, sets in triton_layer_points(jobs, batches):
        fns = {
            n: layer_over_sets(module, sets, lambda p=p: mock.patch.object(ops, "PIPELINE", p))
            for n, p in pipes.items()
        }
        ms = time_ms_interleaved(fns, "cuda", samples=36)
        us = {n: round(v * 1e3 / len(sets), 2) for n, v in ms.items()}
        best = min(us, key=us.get)
        res["points"][point] = {"us": us, "best": best,
                                "gain": round(us[first] / us[best], 4)}  # fmt: skip
        print(point, us, "->", best, f"{us[first] / us[best]:.3f}", flush=True)
        write_probe(name, res)


if __name__ == "__main__":
    main()
