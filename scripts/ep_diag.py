"""One-GPU diagnostic for the all-to-all dispatcher's normal mode (deepseek-v3 EP4 shapes): the
triton runner on received rows that are strided views of packed rows (payload + 8K bytes of
metadata per row, as normal mode hands them over) against the same rows contiguous, and what
a contiguous copy would cost. Prints one line per measurement; writes $OUT/ep_diag.json."""

import json
import os

import torch
import triton.testing

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.report import metadata
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
    for k, v in res.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "ep_diag.json"), "w") as f:
        json.dump({**metadata(), **res}, f, indent=1)


if __name__ == "__main__":
    main()
