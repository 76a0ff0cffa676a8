"""Probe: would the triton runner's gate_up be faster reading its activation rows through TMA
from an expert-sorted copy of x, counting the pass that writes that copy?

    PYTHONPATH=src python3 scripts/gpu_probe_sorted_a.py       # writes $OUT/sorted_a_probe.json

Same run, same routing (uniform random), same alignment (128-row blocks padded per expert):
- runner: `ops.gate_up` as the layer calls it (rows gathered by token with pointer loads, the
  activation fused, h [rows, I] written), with the config the runner looks up;
- sorted: x[token of each sorted row] copied into xs [rows, H] (`index_select`), then one
  grouped GEMM over xs and w13 with both operands through TMA (scripts/gpu_probe_fp8_ws.py's
  `_grouped_kernel`, 128 x 256 x 64, 4 stages, 8 warps; no activation, [rows, 2I] written).
Checked against float32 math on a few rows. Why: on equal-rows layouts that kernel ran at
700-735 TFLOP/s on the deepseek-v3 shapes (benchmarks/triton_notes.md, session 12).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from moekit.bench import time_ms
from moekit.runners._align import align_block_size
from moekit.runners.triton import ops
from moekit.tune import random_weights, shape_for, uniform_topk

sys.path.insert(0, str(Path(__file__).parent))
from gpu_probe_fp8_ws import _grouped_kernel
from probe_out import write_probe

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip
BATCHES = (1024, 4096, 16384)
BM, BN, BK = 128, 256, 64


def _point(model, shape, w, T) -> dict:
    """Both paths at batch size T on preset `model` with weights w (see the module doc)."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    E, K, H = shape.num_experts, shape.top_k, shape.hidden
    n2 = w.w13.shape[1]  # 2I
    db = TensorDescriptor.from_tensor(w.w13.view(E * n2, H), [BN, BK])
    gen = torch.Generator(device=dev).manual_seed(T)
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=gen)
    tk = uniform_topk(T, E, K, dev, gen)
    c1, c2 = ops.configs_for(T, K, w, dtype, dev)
    rows = ops.Rows.sorted(align_block_size(tk.ids, E, max(c1.block_m, c2.block_m)), E)
    h = ops.gate_up(x, rows, w, shape.act, c1, K)
    runner_us = time_ms(lambda: ops.gate_up(x, rows, w, shape.act, c1, K, h), dev) * 1e3

    al = align_block_size(tk.ids, E, BM)
    n = int(al.num_rows)
    sid = al.sorted_ids[:n]
    tok = torch.where(sid < T * K, sid // K, 0)
    xs = torch.empty(n, H, device=dev, dtype=dtype)
    gather_us = time_ms(lambda: torch.index_select(x, 0, tok, out=xs), dev) * 1e3
    be = al.block_expert[: n // BM].contiguous()
    cols = triton.cdiv(n2, BN) * BN
    c = torch.empty(n, cols, device=dev, dtype=dtype)
    da = TensorDescriptor.from_tensor(xs, [BM, BK])
    grid = ((n // BM) * (cols // BN),)

    def gemm():
        _grouped_kernel[grid](da, db, xs, xs, c, be, n, n2, H, 0, 0, 0, c.stride(0), SCALE=0,
                              BM=BM, BN=BN, BK=BK, GROUP_M=8, WS=False, NSTAGE=4,
                              num_warps=8)  # fmt: skip

    gemm()
    torch.cuda.synchronize()
    gemm_us = time_ms(gemm, dev) * 1e3
    pick = torch.nonzero(sid < T * K).view(-1)[:: max(1, n // 7)][:8]
    experts = be[pick // BM].tolist()
    ref = torch.stack([x[tok[r]].float() @ w.w13[e].float().T
                       for r, e in zip(pick.tolist(), experts)])  # fmt: skip
    err = ((c[pick, :n2].float() - ref).abs().max() / ref.abs().max()).item()
    flops = 2 * T * K * n2 * H
    return {"model": model, "T": T, "rows": n, "runner_config": str(c1),
            "runner_gate_up_us": runner_us, "gather_us": gather_us, "tma_gemm_us": gemm_us,
            "sorted_total_us": gather_us + gemm_us,
            "runner_over_sorted": runner_us / (gather_us + gemm_us),
            "runner_tflops": flops / runner_us / 1e6, "tma_gemm_tflops": flops / gemm_us / 1e6,
            "max_rel_err": err}  # fmt: skip


def main() -> None:
    recs = []
    for model, (tp, ep) in PRESETS.items():
        shape = shape_for(model, tp, ep)
        torch.manual_seed(0)
        w = random_weights(shape, torch.device("cuda"))
        for T in BATCHES:
            rec = _point(model, shape, w, T)
            recs.append(rec)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()},
                  flush=True)  # fmt: skip
        del w
        torch.cuda.empty_cache()
    write_probe("sorted_a_probe.json", {"results": recs})


if __name__ == "__main__":
    main()
