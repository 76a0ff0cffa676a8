"""Probe: a persistent, software-pipelined bf16 grouped GEMM written in Gluon (Triton >= 3.9),
against Triton's own TMA kernel, the runner's gate_up and cuBLAS, on the MoE shapes at large T.

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_probe_gluon.py      # $OUT/gluon_probe.json
    python3 scripts/gpu_probe_gluon.py --compile    # CPU: compile for sm_90 only, no GPU

Why: at T >= 4096 the triton runner's GEMMs run at 70-75% of cuBLAS's dense rate (notes:
'Why the misses'); Triton 3.6 / 3.9 build no Hopper warp specialization or cluster multicast
for them. Gluon writes the schedule by hand: each program loops over (expert-row block,
column block) tiles, keeps STAGES TMA loads in flight across the K loop, issues async wgmma
with one group outstanding, and stores each tile through TMA while the next tile's loads run.

C[m] = A[m] @ B[e(m)].T per 128-row block m of expert e (A: expert-sorted rows, padded per
expert to the block, as the runner's alignment lays them out; B: weights [E * N, K]).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_probe_fp8_ws import _graph_us  # CUDA-graph replay timing shared with that probe
from probe_out import write_probe

# name: (E, rows per expert, N, K): gate_up (N = 2I, K = H) and down (N = H, K = I) at T = 4096
# and 16384 with uniform routing (T * K / E rows an expert; deepseek-v3 EP8 with every pair local)
SHAPES = {
    "qwen3_gate_up_T4096": (128, 256, 1536, 2048),
    "qwen3_down_T4096": (128, 256, 2048, 768),
    "qwen3_gate_up_T16384": (128, 1024, 1536, 2048),
    "mixtral_gate_up_T4096": (8, 1024, 14336, 4096),
    "deepseek_gate_up_T4096": (32, 1024, 4096, 7168),
    "deepseek_down_T4096": (32, 1024, 7168, 2048),
}


@gluon.constexpr_function
def _mma_layout(BM, BN, num_warps):
    """wgmma accumulator layout: warps stacked along M (16 rows each), widest N instruction."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, min(BN, 256), 16]
    )


@gluon.jit
def _load(desc_a, desc_b, bars, a_bufs, b_bufs, count, off_m, off_bn, k, pred,
          STAGES: gl.constexpr):  # fmt: skip
    """Issue the TMA loads of K step k into stage count % STAGES (pred: whether to)."""
    s = count % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes, pred=pred)
    tma.async_load(desc_a, [off_m, k], bar, a_bufs.index(s), pred)
    tma.async_load(desc_b, [off_bn, k], bar, b_bufs.index(s), pred)


@gluon.jit
def grouped_gemm_kernel(desc_a, desc_b, desc_c, c_ptr, block_expert_ptr, num_m_blocks, N, K,
                        STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
                        num_warps: gl.constexpr):  # fmt: skip
    """TMA_STORE: the tile leaves through shared memory and TMA, overlapped with the next
    tile (one stage less fits); else straight from the registers (c_ptr, row-major [M, N])."""
    BM: gl.constexpr = desc_c.block_type.shape[0]
    BN: gl.constexpr = desc_c.block_type.shape[1]
    BK: gl.constexpr = desc_a.block_type.shape[1]
    dtype: gl.constexpr = desc_a.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_a.block_type.shape, desc_a.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_b.block_type.shape, desc_b.layout)
    if TMA_STORE:
        c_smem = gl.allocate_shared_memory(dtype, desc_c.block_type.shape, desc_c.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    layout: gl.constexpr = _mma_layout(BM, BN, num_warps)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))

    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    loads = 0  # K steps loaded / consumed so far by this program (stage, phase); equal
    used = 0  # after each tile. Needs num_k >= STAGES - 1 (checked by the caller).
    for tile in range(gl.program_id(0), num_m_blocks * num_n, gl.num_programs(0)):
        # column block fastest: the programs running at once share their row blocks (A) and
        # an expert's weight tiles (B) through L2 (row-block fastest re-read A from DRAM for
        # every column block: 1.6x slower on deepseek-v3 gate_up)
        n_blk = tile % num_n
        m_blk = tile // num_n
        e = gl.load(block_expert_ptr + m_blk)
        if e >= 0:
            off_m = m_blk * BM
            off_bn = e * N + n_blk * BN
            for i in gl.static_range(STAGES - 1):
                _load(desc_a, desc_b, bars, a_bufs, b_bufs, loads, off_m, off_bn, i * BK, True,
                      STAGES)  # fmt: skip
                loads += 1
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
            for ki in range(num_k):
                s = used % STAGES
                mbarrier.wait(bars.index(s), (used // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                # the previous step's wgmma is done: its stage takes the load STAGES-1 ahead
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                used += 1
                if ki + STAGES - 1 < num_k:
                    _load(desc_a, desc_b, bars, a_bufs, b_bufs, loads, off_m, off_bn,
                          (ki + STAGES - 1) * BK, True, STAGES)  # fmt: skip
                    loads += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if TMA_STORE:
                tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
                c_smem.store(acc.to(dtype))
                fence_async_shared()
                tma.async_store(desc_c, [off_m, n_blk * BN], c_smem)
            else:
                ptrs = c_ptr + (off_m + rows)[:, None] * N + (n_blk * BN + cols)[None, :]
                gl.store(ptrs, acc.to(dtype), mask=(n_blk * BN + cols)[None, :] < N)
    if TMA_STORE:
        tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def _descs(a, b, c, BM, BN, BK):
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    lc = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
    return (TensorDescriptor.from_tensor(a, [BM, BK], la),
            TensorDescriptor.from_tensor(b, [BN, BK], lb),
            TensorDescriptor.from_tensor(c, [BM, BN], lc))  # fmt: skip


def compile_only(BM=128, BN=256, BK=64, STAGES=4, num_warps=8, TMA_STORE=False) -> None:
    """Compile for sm_90 on the CPU (no driver) and print the resource use."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    a = torch.empty(1024, 2048, dtype=torch.bfloat16)
    b = torch.empty(4 * 1536, 2048, dtype=torch.bfloat16)
    c = torch.empty(1024, 1536, dtype=torch.bfloat16)
    da, db, dc = _descs(a, b, c, BM, BN, BK)
    sig = {"desc_a": da.__mangle__(), "desc_b": db.__mangle__(), "desc_c": dc.__mangle__(),
           "c_ptr": "*bf16", "block_expert_ptr": "*i32", "num_m_blocks": "i32", "N": "i32",
           "K": "i32", "STAGES": "constexpr", "TMA_STORE": "constexpr",
           "num_warps": "constexpr"}  # fmt: skip
    src = GluonASTSource(grouped_gemm_kernel, sig, constexprs={"STAGES": STAGES,
                         "TMA_STORE": TMA_STORE, "num_warps": num_warps})  # fmt: skip
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ttgir = k.asm["ttgir"]
    print("compiled: shared", k.metadata.shared, "wgmma", ttgir.count("warp_group_dot "),
          "tma loads", ttgir.count("async_tma_copy_global_to_local"))  # fmt: skip


def measure(name, E, rows, N, K, BM=128, BN=256, BK=64, STAGES=3, num_warps=8,
            TMA_STORE=True) -> dict:  # fmt: skip
    dev = torch.device("cuda")
    M = E * rows
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    be = (torch.arange(M // BM, device=dev, dtype=torch.int32) * BM) // rows
    da, db, dc = _descs(a, b, c, BM, BN, BK)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    tiles = (M // BM) * triton.cdiv(N, BN)
    assert K // BK >= STAGES - 1 and M % BM == 0 and rows % BM == 0

    def run():
        grouped_gemm_kernel[(min(sms, tiles),)](da, db, dc, c, be, M // BM, N, K, STAGES,
                                                TMA_STORE, num_warps=num_warps)  # fmt: skip

    run()
    torch.cuda.synchronize()
    err = 0.0
    for e in (0, E - 1):
        ref = a[e * rows : (e + 1) * rows].float() @ b[e * N : (e + 1) * N].float().T
        got = c[e * rows : (e + 1) * rows].float()
        err = max(err, ((got - ref).abs().max() / ref.abs().max()).item())
    us = _graph_us(run)
    flops = 2 * M * N * K
    dense_a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dense_b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dense_c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    cublas_us = _graph_us(lambda: torch.mm(dense_a, dense_b.T, out=dense_c))
    return {"shape": name, "E": E, "rows": rows, "N": N, "K": K,
            "tile": [BM, BN, BK, STAGES, num_warps, TMA_STORE], "gluon_us": us,
            "gluon_tflops": flops / us / 1e6, "max_rel_err": err, "cublas_dense_us": cublas_us,
            "cublas_tflops": flops / cublas_us / 1e6}  # fmt: skip


def main() -> None:
    if "--compile" in sys.argv:
        compile_only()
        return
    recs = []
    for name, shape in SHAPES.items():
        for tile in ((128, 256, 64, 3, 8, True), (128, 256, 64, 4, 8, False)):
            try:
                rec = measure(name, *shape, *tile)
            except Exception as exc:  # noqa: BLE001 - a failing variant is a result
                rec = {
                    "shape": name,
                    "tile": list(tile),
                    "error": f"{type(exc).__name__}: {exc}"[:400],
                }
            print(rec, flush=True)
            recs.append(rec)
    write_probe("gluon_probe.json", {"results": recs})


if __name__ == "__main__":
    main()
