"""One expert at decode (an EP rank at T = 1 with one local pair): how fast the `triton` runner
streams that expert's weights, against cuBLAS's GEMVs on the same matrices and a plain read.

For a preset's per-rank shape (all E_local experts allocated, so the tables' key is the layer's),
16 of them (more bytes than L2) are visited in turn, one per call,
each call T = 1 with one local id (the token's other K - 1 ids -1, as on an EP rank):
  table        ops.fused_moe with the configs the tables give (key T x 1/ep, as the layer asks)
  CODE,CODE    ops.fused_moe with these (gate_up, down) configs (`GemmConfig.code`)
  cublas       F.linear(x, w13[e]), the activation, F.linear(h, w2[e]) (three launches)
  read         a sum over w13[e] and w2[e] (two launches): the bytes at a plain read's speed
All CUDA-graph replays of the 16 calls, timed in turns; us per call and TB/s over the expert's
weight bytes.

    PYTHONPATH=src python3 scripts/gpu_probe_one_expert.py [--job 'deepseek-v3 8 8']
        [--pairs 'CODE,CODE;...']

Writes $OUT/one_expert.json.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import time_ms_interleaved
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.router import TopKOutput
from moekit.runners.triton import ops
from moekit.runners.triton.configs import GemmConfig
from moekit.select_tune import sweep_spec

EXPERTS = 16


def main() -> None:
    model, tp, ep = option("--job", "deepseek-v3 8 8").split()
    pairs = [p.split(",") for p in option("--pairs", "").split(";") if p]
    spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), batch_sizes=(1,),
                      backends=("triton",))  # fmt: skip
    moe = spec.moe
    H, I, K = moe.hidden_size, spec.i_local, moe.top_k
    dev, dt = "cuda", torch.bfloat16
    E = spec.e_local
    w = ExpertWeights(torch.randn(E, 2 * I, H, device=dev, dtype=dt) / H**0.5,
                      torch.randn(E, H, I, device=dev, dtype=dt) / I**0.5)  # fmt: skip
    act = ActivationSpec.from_config(moe)
    x = torch.randn(1, H, device=dev, dtype=dt)
    topks = []
    for e in range(EXPERTS):
        ids = torch.full((1, K), -1, device=dev, dtype=torch.int32)
        ids[0, 0] = e
        topks.append(TopKOutput(torch.full((1, K), 1.0 / K, device=dev), ids))
    share = 1.0 / int(ep)

    def runner(configs):
        def run():
            for t in topks:
                ops.fused_moe(x, t, w, act, configs=configs, local_share=share)
        return run

    def cublas():
        for e in range(EXPERTS):
            gu = F.linear(x, w.w13[e])
            F.linear(F.silu(gu[:, :I]) * gu[:, I:], w.w2[e])

    def read():
        for e in range(EXPERTS):
            w.w13[e].sum()
            w.w2[e].sum()

    fns = {"table": runner(None), "cublas": cublas, "read": read}
    for g, d in pairs:
        fns[f"{g},{d}"] = runner((GemmConfig.from_code(g), GemmConfig.from_code(d)))
    ms = time_ms_interleaved(fns, dev, rounds=5, samples=25)
    per_expert = 3 * H * I * 2
    res = {"job": f"{model} tp{tp} ep{ep}", "H": H, "I": I, "K": K, "bytes_per_expert": per_expert,
           "table_configs": [c.code() for c in ops.configs_for(share, K, w, dt, x.device)],
           "us": {}, "TBps": {}}  # fmt: skip
    for name, t in ms.items():
        us = t * 1e3 / EXPERTS
        res["us"][name] = round(us, 2)
        res["TBps"][name] = round(per_expert / (us * 1e-6) / 1e12, 3)
        print(f"{name:40s} {us:8.2f} us  {res['TBps'][name]:.3f} TB/s")
    write_probe("one_expert.json", res)


if __name__ == "__main__":
    main()
