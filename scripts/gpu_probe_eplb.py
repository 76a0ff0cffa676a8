"""Each EP rank's expert time before and after balancing the placement (`moekit.eplb`), the
ranks simulated in turn on one GPU.

    PYTHONPATH=src python3 scripts/gpu_probe_eplb.py [--model deepseek-v3] [--ep 8]
        [--redundant 32] [--tokens 512,4096] [--zipf-s 1.2] [--out eplb.json]

The routing: `tokens` per rank x ep ranks, Zipf over the experts (`moekit.sweep.make_routing`,
hot experts at random ids). Placements: `contiguous` (slot i holds expert i mod E, as a layer
starts) and `balanced` (`moekit.eplb.balanced_placement` on this routing's load). For each
placement and rank r: the `triton` runner on the pairs the alltoall dispatcher sends to r (its
slot map: an expert's tokens spread over its copies), over all ep x tokens rows with the other
pairs masked, CUDA-graph replay, the ranks timed in turns. An EP layer waits for its busiest
rank, so `max` is what balancing buys. Writes $OUT/NAME.json.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit.bench import time_ms_interleaved
from moekit.dispatch.slots import SlotMap
from moekit.eplb import ExpertLoadRecorder, balanced_placement, balancedness
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.placement import ExpertPlacement
from moekit.presets import model_config
from moekit.router import TopKOutput
from moekit.runners.triton import TritonRunner
from moekit.stages import StandardDispatchOutput
from moekit.sweep import make_routing


def main() -> None:
    model = option("--model", "deepseek-v3")
    ep, redundant = int(option("--ep", "8")), int(option("--redundant", "32"))
    zipf_s = float(option("--zipf-s", "1.2"))
    cfg = model_config(model)
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    slots = E + redundant
    n = slots // ep
    dev = torch.device("cuda")
    w = ExpertWeights(torch.randn(n, 2 * I, H, device=dev, dtype=torch.bfloat16) * H**-0.5,
                      torch.randn(n, H, I, device=dev, dtype=torch.bfloat16) * I**-0.5)  # fmt: skip
    act, runner = ActivationSpec(), TritonRunner()
    res = {"command": " ".join(["python", *sys.argv]), "model": model, "ep": ep,
           "redundant": redundant, "zipf_s": zipf_s, "points": []}  # fmt: skip
    for per_rank in [int(t) for t in option("--tokens", "512,4096").split(",")]:
        T = ep * per_rank
        topk = make_routing(T, E, K, routing="zipf", zipf_s=zipf_s,
                            generator=torch.Generator().manual_seed(per_rank), device=dev)  # fmt: skip
        rec = ExpertLoadRecorder(E, dev)
        rec.record(topk.ids)
        load = rec.counts.cpu()
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        placements = {
            "contiguous": ExpertPlacement.contiguous(E, ep, slots),
            "balanced": balanced_placement(load, slots, ep),
        }
        for name, placement in placements.items():
            slot_map = SlotMap(placement, E)
            fns, pairs = {}, []
            for r in range(ep):
                ids = slot_map.local_ids_torch(topk.ids, r)
                pairs.append(int((ids >= 0).sum()))
                d = StandardDispatchOutput(x, TopKOutput(topk.weights, ids),
                                           local_share=max(pairs[-1], 1) / (T * K))  # fmt: skip
                fns[f"rank{r}"] = lambda d=d: runner.run(d, w, act)
            with torch.no_grad():
                ms = time_ms_interleaved(fns, dev, rounds=3, samples=12)
            us = [round(ms[f"rank{r}"] * 1e3, 1) for r in range(ep)]
            point = {"tokens_per_rank": per_rank, "placement": name, "us": us,
                     "max_us": max(us), "mean_us": round(sum(us) / ep, 1), "pairs": pairs,
                     "balancedness": round(balancedness(load, placement), 4)}  # fmt: skip
            res["points"].append(point)
            print(per_rank, name, "max", max(us), "mean", point["mean_us"], "pairs max / mean",
                  max(pairs), sum(pairs) / ep, "balancedness", point["balancedness"], flush=True)  # fmt: skip
        write_probe(option("--out", "eplb") + ".json", res)


if __name__ == "__main__":
    main()
