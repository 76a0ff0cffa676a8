"""What cuBLAS reaches on the MoE's large-batch problems with none of the MoE's irregularity: every
expert gets exactly T * K / E rows, already grouped (torch.bmm over [E, m, H] x [E, H, 2I], the
activation, torch.bmm over [E, m, I] x [E, I, H]). Timed in turns with the `triton` runner's
layer on uniform random routing at the same point, and on a balanced routing (pair p to expert
p mod E: every expert exactly T * K / E pairs, as the bmm); each as time / the floor `moekit
bench` gives the random routing (ceilings measured at the start of the run; the bmm's own
activation bytes, per pair, are not counted).

    PYTHONPATH=src python3 scripts/gpu_probe_bmm_floor.py [--jobs 'J1;J2'] [--batches 1024,4096,16384]

A job is `preset tp ep` (bf16, unquantized; EP ranks as `moekit bench` sees rank 0, the bmm
with every local expert at T * K / E_global rows). Writes $OUT/bmm_floor.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import l2_cache_bytes, measure_ceilings, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.router import TopKOutput
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

JOBS = "qwen3-30b-a3b 1 1;mixtral-8x7b 2 1;deepseek-v3 8 8;gpt-oss-120b 1 1"



def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", "1024,4096,16384").split(",")]
    ceil = measure_ceilings("cuda")
    res: dict = {"ceilings": vars(ceil), "points": {}}
    for model, tp, ep in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), batch_sizes=tuple(batches),
                          backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig("triton"))
        w = module.expert_weights
        E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
        K, E_all = spec.moe.top_k, spec.moe.num_experts
        silu = spec.moe.activation == "silu"
        gen = torch.Generator().manual_seed(0)
        for T in batches:
            m = max(1, T * K // E_all)
            x = torch.randn(E, m, H, device="cuda", dtype=torch.bfloat16)
            w13t, w2t = w.w13.transpose(1, 2), w.w2.transpose(1, 2)

            def bmm_moe(x=x, w13t=w13t, w2t=w2t, I=I, silu=silu):
                gu = torch.bmm(x, w13t)
                g, u = gu[..., :I], gu[..., I:]
                h = torch.nn.functional.silu(g) * u if silu else torch.nn.functional.gelu(g) * u
                return torch.bmm(h, w2t)

            def bmm_only(x=x, w13t=w13t, w2t=w2t, I=I):
                gu = torch.bmm(x, w13t)
                return torch.bmm(gu[..., :I], w2t)

            ids = (torch.arange(T * K, device="cuda", dtype=torch.int32) % E_all).view(T, K)
            balanced = [(torch.randn(T, H, device="cuda", dtype=torch.bfloat16),
                         TopKOutput(torch.rand(T, K, device="cuda"), ids))]  # fmt: skip

            sets, cost, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))
            fns = {"triton layer": layer_over_sets(module, sets),
                   "triton balanced": layer_over_sets(module, balanced), "bmm+act": bmm_moe,
                   "bmm": bmm_only}  # fmt: skip
            ms = time_ms_interleaved(fns, "cuda", rounds=4, samples=16)
            ms["triton layer"] /= len(sets)
            floors = {"triton layer": cost.floor_s(ceil), "triton balanced": cost.floor_s(ceil),
                      "bmm+act": cost.floor_s(ceil), "bmm": cost.floor_s(ceil)}  # fmt: skip
            point = {n: {"ms": round(ms[n], 4), "floor_ms": round(floors[n] * 1e3, 4),
                         "x_floor": round(ms[n] / (floors[n] * 1e3), 3)} for n in fns}  # fmt: skip
            key = f"{model} tp{tp} ep{ep} T={T}"
            res["points"][key] = point
            print(key, {n: p["x_floor"] for n, p in point.items()}, flush=True)
            write_probe("bmm_floor.json", res)
            del x
        del module, w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
