"""One-GPU diagnostics for the all-to-all dispatcher's normal mode (deepseek-v3 EP4 shapes):
(1) the triton runner on received rows that are strided views of packed rows (payload + 8K
bytes of metadata per row) against the same rows contiguous; (2) the normal plan kernel's
time by chunk count. Prints one line per measurement; writes $OUT/ep_diag.json."""

import json
import os

import torch
import triton.testing

from moekit.dispatch.layout import normal_plan
from moekit.dispatch.slots import SlotMap
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.runners.triton.ops import fused_moe


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300)


def main() -> None:
    dev = "cuda"
    torch.manual_seed(0)
    R, E_all, K, H, I = 4, 256, 8, 7168, 2048
    E = E_all // R
    N = 14800  # rows one rank receives at T = 4096 per rank, uniform routing
    res = {}
    ids = torch.stack([torch.randperm(E_all)[:K] for _ in range(N)]).to(dev)
    local = torch.where(ids < E, ids, -1).to(torch.int32)  # rank 0's experts, -1 elsewhere
    w = torch.rand(N, K, device=dev)
    topk = TopKOutput(w, local)
    packed = torch.randn(N, H + 4 * K, device=dev, dtype=torch.bfloat16)  # row = H + 8K bytes
    x_strided = packed[:, :H]
    x_contig = x_strided.contiguous()
    weights = ExpertWeights(torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
                            torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02)
    act = ActivationSpec()
    a = fused_moe(x_strided, topk, weights, act)
    b = fused_moe(x_contig, topk, weights, act)
    res["runner_same_output"] = bool(torch.equal(a, b))
    res["runner_strided_ms"] = bench(lambda: fused_moe(x_strided, topk, weights, act))
    res["runner_contiguous_ms"] = bench(lambda: fused_moe(x_contig, topk, weights, act))
    res["copy_to_contiguous_ms"] = bench(lambda: x_strided.contiguous())
    # the plan kernel at T = 4096 tokens per rank
    T = 4096
    slots = SlotMap(ExpertPlacement.contiguous(E_all, R), E_all)
    ids_T = torch.stack([torch.randperm(E_all)[:K] for _ in range(T)]).to(dev, torch.int32)
    ticket = torch.zeros(1, dtype=torch.int32, device=dev)
    for nc in (1, 2, 3, 4):
        res[f"plan_{nc}_chunks_ms"] = bench(lambda nc=nc: normal_plan(ids_T, slots, R, E, nc,
                                                                      ticket=ticket))
    for k, v in res.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "ep_diag.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **res}, f, indent=1)


if __name__ == "__main__":
    main()
