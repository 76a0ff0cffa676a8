"""A/B on the GPU: `_cutlass_kernels.weighted_reduce_triton` (the top-k sum of the cutlass and
deep_gemm runners) with its loop over K unrolled, as in the tree, against the loop it had before
(copied below as `old_kernel`), on the row layouts of the four presets at large T (deepseek-v3
EP8: 7/8 of the pairs masked). Both timed in turns (`time_ms_interleaved`); outputs compared bit
for bit.

    PYTHONPATH=src python3 scripts/gpu_probe_reduce_unroll.py     # writes $OUT/reduce_ab.json
"""
import json, os, statistics
import torch, triton, triton.language as tl
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners._grouped import group_rows
from moekit.bench import time_ms_interleaved

@triton.jit
def old_kernel(y_ptr, out_ptr, row_ptr, w_ptr, ids_ptr, b_ptr, H, K, stride_y, stride_o, stride_b,
               HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(K):
        row = tl.load(row_ptr + t * K + k)
        ok = row >= 0
        safe = tl.maximum(row, 0)
        w = tl.load(w_ptr + t * K + k)
        y = tl.load(y_ptr + safe * stride_y + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.maximum(tl.load(ids_ptr + t * K + k), 0).to(tl.int64)
            y += tl.load(b_ptr + e * stride_b + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        acc += tl.where(ok, w, 0.0) * y
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

def old(y, row, w, ids, b2, H, dt):
    T, K = row.shape
    out = torch.empty(T, H, dtype=dt, device=y.device)
    bias = b2 if b2 is not None else y
    block = max(16, min(1024, triton.next_power_of_2(H)))
    old_kernel[(T, triton.cdiv(H, block))](y, out, row.contiguous(), w.float().contiguous(), ids.contiguous(),
        bias, H, K, y.stride(0), out.stride(0), bias.stride(0), HAS_BIAS=b2 is not None, BLOCK=block)
    return out

res = []
for name, T, K, E, Eg, H, bias in (("qwen3", 4096, 8, 128, 128, 2048, False), ("qwen3", 16384, 8, 128, 128, 2048, False),
                                   ("deepseek-ep8", 4096, 8, 32, 256, 7168, False), ("deepseek-ep8", 16384, 8, 32, 256, 7168, False),
                                   ("gpt-oss", 16384, 4, 128, 128, 2880, True), ("mixtral-tp2", 16384, 2, 8, 8, 4096, False)):
    ids = torch.rand(T, Eg, device="cuda").argsort(dim=1)[:, :K].int()
    ids = torch.where(ids < E, ids, -1)
    rows = group_rows(ids, E, 128, use_triton=True)
    y = torch.randn(rows.num_rows, H, device="cuda").bfloat16()
    w = torch.rand(T, K, device="cuda")
    b2 = torch.randn(E, H, device="cuda").bfloat16() if bias else None
    new_out = kernels.weighted_reduce_triton(y, rows.row_TK, w, ids, b2, H, torch.bfloat16)
    old_out = old(y, rows.row_TK, w, ids, b2, H, torch.bfloat16)
    same = torch.equal(new_out, old_out)
    ms = time_ms_interleaved({"old": lambda: old(y, rows.row_TK, w, ids, b2, H, torch.bfloat16),
                              "new": lambda: kernels.weighted_reduce_triton(y, rows.row_TK, w, ids, b2, H, torch.bfloat16)}, "cuda")
    pairs = int((rows.row_TK >= 0).sum())
    gb = (pairs + T) * H * 2 / 1e9
    r = {"shape": name, "T": T, "old_us": ms["old"] * 1e3, "new_us": ms["new"] * 1e3, "old_over_new": ms["old"] / ms["new"],
         "new_TBps": gb / ms["new"], "old_TBps": gb / ms["old"], "bit_identical": same}
    print(r, flush=True); res.append(r)
json.dump({"commit": os.environ.get("MOEKIT_GIT_COMMIT"), "device": torch.cuda.get_device_name(), "points": res},
          open(os.path.join(os.environ.get("OUT", "."), "reduce_ab.json"), "w"), indent=1)
