"""Probe: the warp-specialized bf16 grouped GEMM of gpu_probe_gluon_ws.py run by 2-CTA clusters
whose two CTAs share one operand tile through TMA multicast (Triton >= 3.9, Gluon multi-CTA).

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_probe_gluon_multicast.py  # $OUT/gluon_multicast_probe.json
    python3 scripts/gpu_probe_gluon_multicast.py --compile    # CPU: compile for sm_90 only
    (PROBE_SHAPES=name,...: only those shapes; PROBE_ROUNDS: rounds in turns, default 5)

Why: the session-6 ncu reading (triton_notes.md "ncu at the balance point") had the large-T
GEMMs bound by L2 -> SM traffic: a 128 x 256 tile moves 48 KB per K step of 64 for 4 MFLOP.
Two CTAs that multiply two 128-row blocks of one expert by the same 256 weight columns ("rows")
need the weight tile once: the cluster's lead CTA loads it by one TMA multicast into both CTAs'
shared memory, so the pair moves 64 KB a step instead of 96. "cols": one 128-row block by two
256-column blocks, the activation tile multicast (80 KB for 96).
Outcome (benchmarks/triton_kernel_notes.md, session 45): correct everywhere, gains within the
run spread at the compute-bound shapes, which run at the H100's power cap.

Schedule per CTA (as gpu_probe_gluon_ws.py): a producer warp issuing TMA loads into STAGES
stages and a default partition of two wgmma warpgroups. Stage hand-back: each CTA's consumer
arrives on its own `empty` barrier (this CTA's own tile may be overwritten) and on the pair
barrier held by the lead CTA (the shared tile may be overwritten in both CTAs); the lead's
producer waits on both, the other CTA's on its own.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_probe_gluon_ws import SHAPES as WS_SHAPES
from gpu_probe_gluon_ws import _check, _consumer, _tile_coords, run_shapes, time_in_turns
from gpu_probe_gluon_ws import _descs as ws_descs
from gpu_probe_gluon_ws import ws_grouped_gemm_kernel

SHAPES = WS_SHAPES  # rows-paired variants skip gpt-oss T = 4096 (128 rows an expert)


@gluon.jit
def _mc_producer(desc_a, desc_b, a_bufs, b_bufs, ready, empty, empty_pair, block_expert_ptr,
                 num_m_blocks, N, K, GROUP_M: gl.constexpr, PAIR_N: gl.constexpr):  # fmt: skip
    """1 warp a CTA: this CTA's own operand tile and (lead CTA) the shared one, multicast:
    the weight tile (PAIR_N False: the CTAs take different rows) or the activation tile
    (PAIR_N: different weight columns)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BN: gl.constexpr = desc_b.block_type.shape[0]  # the cluster's columns
    BM2: gl.constexpr = desc_a.block_type.shape[0]  # the cluster's rows
    BK: gl.constexpr = desc_a.block_type.shape[1]
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n, gl.num_programs(0)):
        m_blk, n_blk = _tile_coords(tile, num_m_blocks, num_n, GROUP_M)
        e = gl.load(block_expert_ptr + m_blk)
        if e >= 0:
            for ki in range(num_k):
                s = count % STAGES
                phase = ((count // STAGES) & 1) ^ 1  # stages start free
                mbarrier.wait(empty_pair.index(s), phase)  # lead CTA only: both consumers done
                mbarrier.wait(empty.index(s), phase)
                bar = ready.index(s)
                mbarrier.expect(bar, desc_a.nbytes_per_cta + desc_b.nbytes_per_cta)
                tma.async_load(desc_a, [m_blk * BM2, ki * BK], bar, a_bufs.index(s),
                               multicast=PAIR_N)  # fmt: skip
                tma.async_load(desc_b, [e * N + n_blk * BN, ki * BK], bar, b_bufs.index(s),
                               multicast=not PAIR_N)  # fmt: skip
                count += 1


@gluon.jit
def mc_grouped_gemm_kernel(desc_a, desc_b, desc_c, block_expert_ptr, num_m_blocks, N, K,
                           STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
                           GROUP_M: gl.constexpr, PAIR_N: gl.constexpr,
                           num_warps: gl.constexpr):  # fmt: skip
    """C[rows of cluster tile m] = A[those rows] @ B[e(m)].T over cluster tiles of one expert:
    2 * BM rows by BN columns, or (PAIR_N) BM rows by 2 * BN columns (block_expert_ptr: expert
    of each row block of the cluster tile, -1 for none)."""
    gl.static_assert(gl.num_ctas() == 2)
    dtype: gl.constexpr = desc_a.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_a.block_type.shape, desc_a.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_b.block_type.shape, desc_b.layout)
    c_smem = gl.allocate_shared_memory(dtype, desc_c.block_type.shape, desc_c.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    empty_pair = mbarrier.allocate_mbarrier(batch=STAGES, two_ctas=True)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
        mbarrier.init(empty_pair.index(i), count=1)
    # each CTA's accumulators hold its half of the cluster tile (its rows, or its columns)
    BN: gl.constexpr = desc_b.block_type.shape[0]
    CTA_BN: gl.constexpr = BN // 2 if PAIR_N else BN
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, CTA_BN, 16],
        cga_layout=[[0, 1]] if PAIR_N else [[1, 0]])  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (desc_c, a_bufs, b_bufs, c_smem, ready, empty, empty_pair,
                         block_expert_ptr, num_m_blocks, N, K, layout, EPI_SPLIT, GROUP_M,
                         True)),  # fmt: skip
            (_mc_producer, (desc_a, desc_b, a_bufs, b_bufs, ready, empty, empty_pair,
                            block_expert_ptr, num_m_blocks, N, K, GROUP_M, PAIR_N)),  # fmt: skip
        ],
        [1],
        [40],
    )


def _mc_descs(a, b, c, BM, BN, BK, EPI_SPLIT, pair_n):
    """TMA descriptors of a cluster tile: A and C split over the two CTAs along rows and B
    broadcast, or (pair_n) A broadcast and B and C split along the columns (EPI_SPLIT 1)."""
    if pair_n:
        assert EPI_SPLIT == 1, "the column pieces of an N-split tile are not one box"
        shape_a, cga_a, shape_b, cga_b = [BM, BK], [[0, 0]], [2 * BN, BK], [[1, 0]]
        shape_c, cga_c = [BM, 2 * BN], [[0, 1]]
    else:
        shape_a, cga_a, shape_b, cga_b = [2 * BM, BK], [[1, 0]], [BN, BK], [[0, 0]]
        shape_c, cga_c = [2 * BM, BN // EPI_SPLIT], [[1, 0]]
    descs = []
    for t, shape, cga in ((a, shape_a, cga_a), (b, shape_b, cga_b), (c, shape_c, cga_c)):
        layout = gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16, cga_layout=cga)
        descs.append(TensorDescriptor.from_tensor(t, shape, layout))
    return descs


# (label, pair_n, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M (in cluster tiles), num_warps, maxnreg):
# BM x BN the tile of one CTA
VARIANTS = [
    ("mc rows 2x128x256x64 s4 epi/2 g4", False, 128, 256, 64, 4, 2, 4, 8, 168),
    ("mc rows 2x128x256x64 s4 epi/2 g2", False, 128, 256, 64, 4, 2, 2, 8, 168),
    ("mc cols 128x2x256x64 s3 epi/1 g8", True, 128, 256, 64, 3, 1, 8, 8, 168),
    ("mc cols 128x2x256x64 s3 epi/1 g4", True, 128, 256, 64, 3, 1, 4, 8, 168),
]
# the single-CTA kernel of gpu_probe_gluon_ws.py at its best config (the ratios' base) and at
# the column-paired variants' stages and epilogue, timed beside
BASELINES = [("ws 128x256x64 s4 epi/2 g8", False, 128, 256, 64, 4, 2, 8, 8, 168),
             ("ws 128x256x64 s3 epi/1 g8", False, 128, 256, 64, 3, 1, 8, 8, 168)]


def _signature(da, db, dc) -> dict:
    return {"desc_a": da.__mangle__(), "desc_b": db.__mangle__(), "desc_c": dc.__mangle__(),
            "block_expert_ptr": "*i32", "num_m_blocks": "i32", "N": "i32", "K": "i32",
            "STAGES": "constexpr", "EPI_SPLIT": "constexpr", "GROUP_M": "constexpr",
            "PAIR_N": "constexpr", "num_warps": "constexpr"}  # fmt: skip


def compile_only() -> None:
    """Compile each variant for sm_90 on the CPU (no driver) and print what it became."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for label, pair_n, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, nw, maxnreg in VARIANTS:
        a = torch.empty(1024, 2048, dtype=torch.bfloat16)
        b = torch.empty(4 * 1536, 2048, dtype=torch.bfloat16)
        c = torch.empty(1024, 1536, dtype=torch.bfloat16)
        da, db, dc = _mc_descs(a, b, c, BM, BN, BK, EPI_SPLIT, pair_n)
        src = GluonASTSource(mc_grouped_gemm_kernel, _signature(da, db, dc),
                             constexprs={"STAGES": STAGES, "EPI_SPLIT": EPI_SPLIT,
                                         "GROUP_M": GROUP_M, "PAIR_N": pair_n,
                                         "num_warps": nw})  # fmt: skip
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": nw, "maxnreg": maxnreg, "num_ctas": 2})  # fmt: skip
        ptx = k.asm["ptx"]
        print(label, "| shared", k.metadata.shared, "| multicast loads",
              ptx.count(".multicast::cluster"), "| cluster arrives",
              ptx.count("mbarrier.arrive.release.cluster") + ptx.count("shared::cluster.b64"),
              "| wgmma", ptx.count("wgmma.mma_async"))  # fmt: skip
        if os.environ.get("PROBE_DUMP"):
            with open(os.environ["PROBE_DUMP"], "w") as f:
                f.write(ptx)


def measure_shape(name, E, rows, N, K) -> list[dict]:
    """Every variant, the single-CTA kernel and cuBLAS on one shape, in turns, same inputs."""
    dev = torch.device("cuda")
    M = E * rows
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flops = 2 * M * N * K
    runs = {}
    for label, pair_n, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, nw, maxnreg in VARIANTS:
        bm, bn = (BM, 2 * BN) if pair_n else (2 * BM, BN)  # the cluster tile
        if rows % bm:
            continue  # a cluster tile's rows are one expert's
        c = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        blocks = M // bm
        be = (torch.arange(blocks, device=dev, dtype=torch.int32) * bm) // rows
        da, db, dc = _mc_descs(a, b, c, BM, BN, BK, EPI_SPLIT, pair_n)
        grid = (min(sms // 2, blocks * triton.cdiv(N, bn)),)  # clusters

        def run(da=da, db=db, dc=dc, be=be, grid=grid, blocks=blocks, STAGES=STAGES,
                EPI_SPLIT=EPI_SPLIT, GROUP_M=GROUP_M, pair_n=pair_n, nw=nw,
                maxnreg=maxnreg):  # fmt: skip
            mc_grouped_gemm_kernel[grid](da, db, dc, be, blocks, N, K, STAGES, EPI_SPLIT,
                                         GROUP_M, pair_n, num_warps=nw, maxnreg=maxnreg,
                                         num_ctas=2)  # fmt: skip

        runs[label] = (run, c)
    for label, _, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, nw, maxnreg in BASELINES:
        c1 = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        be1 = (torch.arange(M // BM, device=dev, dtype=torch.int32) * BM) // rows
        d1 = ws_descs(a, b, c1, BM, BN, BK, BN // EPI_SPLIT)
        grid1 = (min(sms, (M // BM) * triton.cdiv(N, BN)),)

        def run1(d1=d1, be1=be1, grid1=grid1, BM=BM, STAGES=STAGES, EPI_SPLIT=EPI_SPLIT,
                 GROUP_M=GROUP_M, nw=nw, maxnreg=maxnreg):  # fmt: skip
            ws_grouped_gemm_kernel[grid1](*d1, be1, M // BM, N, K, STAGES, EPI_SPLIT, GROUP_M,
                                          num_warps=nw, maxnreg=maxnreg)  # fmt: skip

        runs[label] = (run1, c1)
    dense_a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dense_b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dense_c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    runs["cublas dense"] = (lambda: torch.mm(dense_a, dense_b.T, out=dense_c), None)

    rounds = int(os.environ.get("PROBE_ROUNDS", "5"))
    recs = time_in_turns(name, runs, lambda c: _check(c, a, b, E, rows, N), flops, rounds)
    # the GEMMs at these sizes run into the power cap: rounds spread 5-20 %, so medians
    base = recs[BASELINES[0][0]].get("median_us")
    for r in recs.values():
        if r.get("median_us") and base:
            r["median_over_single_cta"] = r["median_us"] / base
    return list(recs.values())


def main() -> None:
    if "--compile" in sys.argv:
        compile_only()
        return
    run_shapes(SHAPES, measure_shape, "gluon_multicast_probe.json")


if __name__ == "__main__":
    main()
