"""Probe: a warp-specialized, persistent bf16 grouped GEMM in Gluon (Triton >= 3.9), against
the session-12 Gluon kernel without specialization, Triton's own TMA kernel and cuBLAS.

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_probe_gluon_ws.py  # $OUT/gluon_ws_probe.json
    python3 scripts/gpu_probe_gluon_ws.py --compile     # CPU: compile for sm_90 only, no GPU

Why: at T >= 4096 the triton runner's GEMMs run at 70-75% of cuBLAS's dense rate, and the
session-12 Gluon kernel (one instruction stream for loads, wgmma and the epilogue) was no
faster than Triton's own. CUTLASS's Hopper kernels reach cuBLAS by giving the TMA loads their
own warp (the producer), so that the loads of the next tile run while the math warpgroups
finish and store this one. Here:

- producer partition, 1 warp: loops over the program's tiles and K steps, waits for a free
  stage (`empty[s]`), issues the A and B TMA loads into it, signalling `ready[s]`;
- default partition, 2 warpgroups (num_warps = 8, 64 rows each of a 128-row tile): waits for
  `ready[s]`, issues the async wgmma, and once the previous step's wgmma has retired frees its
  stage; after the K loop it converts the tile and stores it through shared memory and TMA
  (EPI_SPLIT column pieces, so that a fourth load stage fits) while the producer already
  fills the stages with the next tile's operands.

C[m] = A[m] @ B[e(m)].T per 128-row block m of expert e (A: expert-sorted rows, padded per
expert to the block; B: weights [E * N, K]), as in scripts/gpu_probe_gluon.py.
"""

from __future__ import annotations

import os
import statistics
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
from gpu_probe_gluon import _mma_layout, grouped_gemm_kernel
from probe_out import write_probe

# name: (E, rows per expert, N, K) with uniform routing (T * K / E rows an expert)
SHAPES = {
    "qwen3_gate_up_T4096": (128, 256, 1536, 2048),
    "qwen3_down_T4096": (128, 256, 2048, 768),
    "qwen3_gate_up_T16384": (128, 1024, 1536, 2048),
    "mixtral_gate_up_T4096": (8, 1024, 14336, 4096),
    "mixtral_down_T4096": (8, 1024, 4096, 7168),
    "deepseek_gate_up_T4096": (32, 1024, 4096, 7168),
    "deepseek_down_T4096": (32, 1024, 7168, 2048),
    "gptoss_gate_up_T4096": (128, 128, 5760, 2880),
    "gptoss_down_T4096": (128, 128, 2880, 2880),
}


@gluon.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """(row block, column block) of tile. GROUP_M 0: column block fastest over all columns;
    else GROUP_M row blocks fastest within each column block, so that the programs running at
    once read each weight tile once from DRAM (mixtral: the 56 column tiles of one row block
    are 117 MB, more than L2)."""
    if GROUP_M == 0:
        m_blk = tile // num_n
        n_blk = tile % num_n
    else:
        width = GROUP_M * num_n
        first_m = (tile // width) * GROUP_M
        size_m = gl.minimum(num_m - first_m, GROUP_M)
        m_blk = first_m + (tile % width) % size_m
        n_blk = (tile % width) // size_m
    return m_blk, n_blk


@gluon.jit
def _producer(desc_a, desc_b, a_bufs, b_bufs, ready, empty, block_expert_ptr, num_m_blocks, N,
              K, GROUP_M: gl.constexpr):  # fmt: skip
    """1 warp: the TMA loads of every (tile, K step) of this program, STAGES ahead at most."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BN: gl.constexpr = desc_b.block_type.shape[0]
    BM: gl.constexpr = desc_a.block_type.shape[0]
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
                # stages start free: the first pass waits on the phase before the initial one
                mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
                tma.async_load(desc_a, [m_blk * BM, ki * BK], bar, a_bufs.index(s))
                tma.async_load(desc_b, [e * N + n_blk * BN, ki * BK], bar, b_bufs.index(s))
                count += 1


@gluon.jit
def _consumer(desc_c, a_bufs, b_bufs, c_smem, ready, empty, empty_pair, block_expert_ptr,
              num_m_blocks, N, K, layout: gl.constexpr, EPI_SPLIT: gl.constexpr,
              GROUP_M: gl.constexpr, PAIRED: gl.constexpr):  # fmt: skip
    """The wgmma of every K step into accumulators of `layout`, and the epilogue of every tile.
    PAIRED (a 2-CTA cluster, gpu_probe_gluon_multicast): a freed stage is also signalled on
    empty_pair, the lead CTA's barrier; else empty_pair is not used."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    dtype: gl.constexpr = a_bufs.dtype
    num_n = gl.cdiv(N, BN)
    num_k = gl.cdiv(K, BK)
    count = 0
    for tile in range(gl.program_id(0), num_m_blocks * num_n, gl.num_programs(0)):
        m_blk, n_blk = _tile_coords(tile, num_m_blocks, num_n, GROUP_M)
        e = gl.load(block_expert_ptr + m_blk)
        if e >= 0:
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
            for ki in range(num_k):
                s = count % STAGES
                mbarrier.wait(ready.index(s), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                # the previous step's wgmma has retired: its stage is free for the producer
                prev = (count + STAGES - 1) % STAGES
                mbarrier.arrive(empty.index(prev), pred=ki > 0)
                if PAIRED:
                    mbarrier.arrive(empty_pair.index(prev), pred=ki > 0)
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            prev = (count + STAGES - 1) % STAGES
            mbarrier.arrive(empty.index(prev))
            if PAIRED:
                mbarrier.arrive(empty_pair.index(prev))
            _store_tile(desc_c, c_smem, acc.to(dtype), m_blk * BM, n_blk * BN, EPI_SPLIT)
    tma.store_wait(pendings=0)


@gluon.jit
def _store_tile(desc_c, c_smem, out, row0, col0, EPI_SPLIT: gl.constexpr):
    """out [BM, BN] to C at (row0, col0) through c_smem and TMA, in EPI_SPLIT column pieces."""
    EPI_N: gl.constexpr = out.shape[1] // EPI_SPLIT
    for j in gl.static_range(EPI_SPLIT):
        if EPI_SPLIT == 1:
            piece = out
        else:
            piece = _column_piece(out, j, EPI_SPLIT)
        tma.store_wait(pendings=0)  # the previous piece has left c_smem
        c_smem.store(piece)
        fence_async_shared()
        tma.async_store(desc_c, [row0, col0 + j * EPI_N], c_smem)


@gluon.jit
def _half(x, hi: gl.constexpr):
    """Columns [0, N / 2) of x [M, N] (hi False) or [N / 2, N) (hi True)."""
    lo_cols, hi_cols = x.reshape([x.shape[0], 2, x.shape[1] // 2]).permute((0, 2, 1)).split()
    if hi:
        piece = hi_cols
    else:
        piece = lo_cols
    return piece


@gluon.jit
def _column_piece(out, j: gl.constexpr, EPI_SPLIT: gl.constexpr):
    """Columns [j * BN / EPI_SPLIT, (j + 1) * BN / EPI_SPLIT) of out [BM, BN] (EPI_SPLIT 2 or 4)."""
    piece = _half(out, (j * 2) // EPI_SPLIT == 1)
    if EPI_SPLIT == 4:
        piece = _half(piece, j % 2 == 1)
    return piece


@gluon.jit
def ws_grouped_gemm_kernel(desc_a, desc_b, desc_c, block_expert_ptr, num_m_blocks, N, K,
                           STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
                           GROUP_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = desc_a.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_a.block_type.shape, desc_a.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + desc_b.block_type.shape, desc_b.layout)
    c_smem = gl.allocate_shared_memory(dtype, desc_c.block_type.shape, desc_c.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    layout: gl.constexpr = _mma_layout(desc_a.block_type.shape[0], desc_b.block_type.shape[0],
                                       num_warps)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (desc_c, a_bufs, b_bufs, c_smem, ready, empty, empty, block_expert_ptr,
                         num_m_blocks, N, K, layout, EPI_SPLIT, GROUP_M, False)),  # fmt: skip
            (_producer, (desc_a, desc_b, a_bufs, b_bufs, ready, empty, block_expert_ptr,
                         num_m_blocks, N, K, GROUP_M)),  # fmt: skip
        ],
        [1],
        [40],
    )


def _descs(a, b, c, BM, BN, BK, EPI_N):
    la = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    lb = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
    lc = gl.NVMMASharedLayout.get_default_for([BM, EPI_N], gl.bfloat16)
    return (TensorDescriptor.from_tensor(a, [BM, BK], la),
            TensorDescriptor.from_tensor(b, [BN, BK], lb),
            TensorDescriptor.from_tensor(c, [BM, EPI_N], lc))  # fmt: skip


# (label, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, num_warps, maxnreg)
VARIANTS = [
    ("ws 128x256x64 s4 epi/2 g0", 128, 256, 64, 4, 2, 0, 8, 168),
    ("ws 128x256x64 s4 epi/2 g8", 128, 256, 64, 4, 2, 8, 8, 168),
    ("ws 128x256x64 s4 epi/2 g4", 128, 256, 64, 4, 2, 4, 8, 168),
    ("ws 128x256x64 s3 epi/1 g8", 128, 256, 64, 3, 1, 8, 8, 168),
    ("ws 128x256x64 s4 epi/4 g8", 128, 256, 64, 4, 4, 8, 8, 168),
]


def compile_only() -> None:
    """Compile each variant for sm_90 on the CPU (no driver) and print the resource use."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for label, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, nw, maxnreg in VARIANTS:
        a = torch.empty(1024, 2048, dtype=torch.bfloat16)
        b = torch.empty(4 * 1536, 2048, dtype=torch.bfloat16)
        c = torch.empty(1024, 1536, dtype=torch.bfloat16)
        da, db, dc = _descs(a, b, c, BM, BN, BK, BN // EPI_SPLIT)
        sig = {"desc_a": da.__mangle__(), "desc_b": db.__mangle__(), "desc_c": dc.__mangle__(),
               "block_expert_ptr": "*i32", "num_m_blocks": "i32", "N": "i32", "K": "i32",
               "STAGES": "constexpr", "EPI_SPLIT": "constexpr", "GROUP_M": "constexpr",
               "num_warps": "constexpr"}  # fmt: skip
        src = GluonASTSource(ws_grouped_gemm_kernel, sig, constexprs={"STAGES": STAGES,
                             "EPI_SPLIT": EPI_SPLIT, "GROUP_M": GROUP_M,
                             "num_warps": nw})  # fmt: skip
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": nw, "maxnreg": maxnreg})  # fmt: skip
        ttgir = k.asm["ttgir"]
        print(label, "| shared", k.metadata.shared,
              "| wgmma", ttgir.count("warp_group_dot "), "| tma loads",
              ttgir.count("async_tma_copy_global_to_local"), "| setmaxnreg",
              k.asm["ptx"].count("setmaxnreg"))  # fmt: skip
        if os.environ.get("PROBE_DUMP"):
            with open(os.environ["PROBE_DUMP"], "w") as f:
                f.write(k.asm["ptx"])


def _check(c, a, b, E, rows, N) -> float:
    err = 0.0
    for e in (0, E // 2, E - 1):
        ref = a[e * rows : (e + 1) * rows].float() @ b[e * N : (e + 1) * N].float().T
        got = c[e * rows : (e + 1) * rows].float()
        err = max(err, ((got - ref).abs().max() / ref.abs().max()).item())
    return err


def measure_shape(name, E, rows, N, K) -> list[dict]:
    """Every variant, the session-12 kernel and cuBLAS on one shape, in turns, same inputs."""
    dev = torch.device("cuda")
    M = E * rows
    torch.manual_seed(0)
    a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) / K**0.5
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flops = 2 * M * N * K
    runs = {}
    for label, BM, BN, BK, STAGES, EPI_SPLIT, GROUP_M, nw, maxnreg in VARIANTS:
        c = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        be = (torch.arange(M // BM, device=dev, dtype=torch.int32) * BM) // rows
        da, db, dc = _descs(a, b, c, BM, BN, BK, BN // EPI_SPLIT)
        grid = (min(sms, (M // BM) * triton.cdiv(N, BN)),)

        def run(da=da, db=db, dc=dc, be=be, grid=grid, BM=BM, STAGES=STAGES, EPI_SPLIT=EPI_SPLIT,
                GROUP_M=GROUP_M, nw=nw, maxnreg=maxnreg):  # fmt: skip
            ws_grouped_gemm_kernel[grid](da, db, dc, be, M // BM, N, K, STAGES, EPI_SPLIT,
                                         GROUP_M, num_warps=nw, maxnreg=maxnreg)  # fmt: skip

        runs[label] = (run, c)
    # the session-12 kernel: 128x256x64, 3 stages, TMA store, no specialization
    c12 = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
    be12 = (torch.arange(M // 128, device=dev, dtype=torch.int32) * 128) // rows
    from gpu_probe_gluon import _descs as descs12

    d12 = descs12(a, b, c12, 128, 256, 64)

    def run12():
        grouped_gemm_kernel[(min(sms, (M // 128) * triton.cdiv(N, 256)),)](
            *d12, c12, be12, M // 128, N, K, 3, True, num_warps=8)

    runs["session-12 gluon 128x256x64 s3"] = (run12, c12)
    # Triton's own kernel, one tile a program, both operands through TMA, GROUP_M 8 (session 12:
    # 735 TFLOP/s on deepseek-v3 gate_up)
    from gpu_probe_fp8_ws import _grouped_kernel
    from triton.tools.tensor_descriptor import TensorDescriptor as TritonDescriptor

    ct = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
    ta = TritonDescriptor.from_tensor(a, [128, 64])
    tb = TritonDescriptor.from_tensor(b, [256, 64])

    def run_triton():
        _grouped_kernel[((M // 128) * triton.cdiv(N, 256),)](
            ta, tb, a, a, ct, be12, M, N, K, 0, 0, 0, ct.stride(0), SCALE=0, BM=128, BN=256,
            BK=64, GROUP_M=8, WS=False, NSTAGE=4, num_warps=8)

    runs["triton tma 128x256x64 s4 g8"] = (run_triton, ct)
    dense_a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    dense_b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    dense_c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    runs["cublas dense"] = (lambda: torch.mm(dense_a, dense_b.T, out=dense_c), None)

    recs = time_in_turns(name, runs, lambda c: _check(c, a, b, E, rows, N), flops, rounds=3)
    base = recs["cublas dense"].get("best_us")
    for r in recs.values():
        if r.get("best_us") and base:
            r["time_over_cublas"] = r["best_us"] / base
    return list(recs.values())


def time_in_turns(shape, runs, check, flops, rounds) -> dict:
    """{label: record} for runs {label: (fn, output or None)}: each run once and checked
    (`check(output)`; an exception is the record's error), then timed in `rounds` rounds in
    turns (heat and clocks move all runs alike): us per round, best_us, median_us, tflops
    (from the best)."""
    recs = {}
    for label, (fn, c) in runs.items():
        try:
            fn()
            torch.cuda.synchronize()
            err = check(c) if c is not None else None
            recs[label] = {"shape": shape, "variant": label, "us": [], "max_rel_err": err}
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result
            recs[label] = {"shape": shape, "variant": label,
                           "error": f"{type(exc).__name__}: {exc}"[:400]}  # fmt: skip
    for _ in range(rounds):
        for label, (fn, _c) in runs.items():
            if "error" not in recs[label]:
                recs[label]["us"].append(_graph_us(fn))
    for r in recs.values():
        if r.get("us"):
            r["best_us"] = min(r["us"])
            r["median_us"] = statistics.median(r["us"])
            r["tflops"] = flops / r["best_us"] / 1e6
    return recs


def run_shapes(shapes, measure, out_name) -> None:
    """measure(name, *shape) for each shape (only those named in $PROBE_SHAPES, if set),
    printing each record without its rounds; all records into $OUT/out_name."""
    recs = []
    only = os.environ.get("PROBE_SHAPES")
    for name, shape in shapes.items():
        if only and name not in only.split(","):
            continue
        for rec in measure(name, *shape):
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()
                   if k != "us"}, flush=True)  # fmt: skip
            recs.append(rec)
    write_probe(out_name, {"results": recs})


def main() -> None:
    if "--compile" in sys.argv:
        compile_only()
        return
    run_shapes(SHAPES, measure_shape, "gluon_ws_probe.json")


if __name__ == "__main__":
    main()
