"""Probe: can Triton 3.6's Hopper warp specialization run the fp8 block-scaled grouped GEMM
near the speed of the unscaled fp8 one?

    PYTHONPATH=src python3 scripts/gpu_probe_fp8_ws.py      # writes $OUT/fp8_ws_probe.json

Why: with one scale per 128 columns of K, `acc += dot(a, b) * scale` waits for each wgmma
(`warp_group_dot_wait {pendings = 0}`), so the runner's fp8 block-wise GEMMs run at bf16 speed
(benchmarks/triton_notes.md). With `tl.range(..., warp_specialize=True)` and num_warps=4,
Triton 3.6 builds a TMA producer partition and two consumer warpgroups of 64 rows each
(TTGIR read on the CPU): one warpgroup's scale-and-add can run while the other's wgmma does,
which is how DeepGEMM overlaps them. That needs both operands through TMA descriptors, so the
activations are in expert-sorted rows (each expert's rows padded to the block).

One grouped GEMM C[m] = A[m] @ B[e(m)].T per variant, on the gate_up and down shapes of
qwen3-30b-a3b and deepseek-v3 (EP8) at T = 4096 (uniform routing: T * K / E rows an expert),
timed as CUDA-graph replays; TFLOP/s and time over the unscaled fp8 kernel of the same
schedule. Checked against a float32 reference on two experts.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import triton
import triton.language as tl
from probe_out import write_probe
from triton.tools.tensor_descriptor import TensorDescriptor

from moekit.runners._triton_common import tile_coords


@triton.jit
def _k_step(acc, a_desc, b_desc, as_ptr, bs_ptr, e, m0, n0, ki, N, stride_ask, stride_bse,
            stride_bsn, SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):  # fmt: skip
    """acc [BM, BN] += A [m0:, ki * BK:] @ B [e * N + n0:, ki * BK:]^T, times the step's
    scales when SCALE (A's [K / 128, M] float32, transposed; B's [E, N / 128, K / 128])."""
    a = a_desc.load([m0, ki * BK])
    b = b_desc.load([e * N + n0, ki * BK])
    if SCALE:
        sa = tl.load(as_ptr + ki * stride_ask + m0 + tl.arange(0, BM))
        sb = tl.load(bs_ptr + e * stride_bse + ((n0 + tl.arange(0, BN)) // 128) * stride_bsn + ki)
        acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
    else:
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _store_tile(acc, c_ptr, m0, n0, stride_cm, BM: tl.constexpr, BN: tl.constexpr):
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(tl.bfloat16))


@triton.jit
def _grouped_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, be_ptr, M, N, K,
    stride_ask, stride_bse, stride_bsn, stride_cm,
    SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WS: tl.constexpr, NSTAGE: tl.constexpr,
):  # fmt: skip
    """C [M, N] bf16 = A [M, K] @ B [E * N, K]^T rows of expert be[m // BM], one tile a
    program (`_k_step`), the warp specialization on the K loop."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    e = tl.load(be_ptr + pid_m)
    acc = tl.zeros([BM, BN], tl.float32)
    for ki in tl.range(0, K // BK, warp_specialize=WS, num_stages=NSTAGE):
        acc = _k_step(acc, a_desc, b_desc, as_ptr, bs_ptr, e, pid_m * BM, pid_n * BN, ki, N,
                      stride_ask, stride_bse, stride_bsn, SCALE, BM, BN, BK)  # fmt: skip
    _store_tile(acc, c_ptr, pid_m * BM, pid_n * BN, stride_cm, BM, BN)


@triton.jit
def _persistent_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, be_ptr, M, N, K,
    stride_ask, stride_bse, stride_bsn, stride_cm,
    SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WS: tl.constexpr, NSTAGE: tl.constexpr, NUM_SMS: tl.constexpr,
):  # fmt: skip
    """_grouped_kernel with NUM_SMS programs looping over the tiles, the warp specialization on
    the tile loop (the form Triton's own persistent matmul uses; flatten=True drops it)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for tile in tl.range(
        tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, warp_specialize=WS, num_stages=NSTAGE
    ):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        e = tl.load(be_ptr + pid_m)
        acc = tl.zeros([BM, BN], tl.float32)
        for ki in range(K // BK):
            acc = _k_step(acc, a_desc, b_desc, as_ptr, bs_ptr, e, pid_m * BM, pid_n * BN, ki, N,
                          stride_ask, stride_bse, stride_bsn, SCALE, BM, BN, BK)  # fmt: skip
        _store_tile(acc, c_ptr, pid_m * BM, pid_n * BN, stride_cm, BM, BN)


SHAPES = {  # name: (E, rows an expert at T = 4096, N, K)
    "qwen3_gate_up": (128, 256, 1536, 2048),
    "qwen3_down": (128, 256, 2048, 768),
    "deepseek_gate_up": (32, 1024, 4096, 7168),
    "deepseek_down": (32, 1024, 7168, 2048),
}
# (label, dtype, SCALE, WS, num_warps, BM, BN, stages, persistent[, BK]); BK default 128
VARIANTS = [
    ("fp8 plain nw8 128x256", "fp8", 0, False, 8, 128, 256, 4, False),
    ("fp8 block nw8 128x128", "fp8", 1, False, 8, 128, 128, 4, False),
    ("fp8 block ws nw4 128x128 s3", "fp8", 1, True, 4, 128, 128, 3, False),
    ("fp8 block ws nw4 128x128 s4", "fp8", 1, True, 4, 128, 128, 4, False),
    ("fp8 block ws nw4 128x128 s5", "fp8", 1, True, 4, 128, 128, 5, False),
    ("bf16 plain ws nw4 128x128 s3", "bf16", 0, True, 4, 128, 128, 3, False),
    ("fp8 plain ws nw4 128x128 s3", "fp8", 0, True, 4, 128, 128, 3, False),
    ("fp8 block persistent ws nw4 128x128 s3", "fp8", 1, True, 4, 128, 128, 3, True),
    ("fp8 plain persistent ws nw4 128x128 s3", "fp8", 0, True, 4, 128, 128, 3, True),
    ("bf16 plain nw8 128x256 k64 s3", "bf16", 0, False, 8, 128, 256, 3, False, 64),
    ("bf16 plain nw8 128x256 k64 s4", "bf16", 0, False, 8, 128, 256, 4, False, 64),
    ("bf16 plain nw8 128x128 k64 s4", "bf16", 0, False, 8, 128, 128, 4, False, 64),
    # the triton runner's gate_up on gathered rows (pointer loads of x by token), the config
    # it looks up for T = 4096, same routing sizes: for the qwen3 / deepseek gate_up shapes
    ("runner bf16 gate_up", "runner", 0, False, 0, 0, 0, 0, False),
    # cuBLAS on one dense [M, K] x [K, N] bf16 product of the same FLOPs: the rate ceiling
    ("cublas bf16 dense", "cublas", 0, False, 0, 0, 0, 0, False),
]
# Seen on the H100: every warp-specialized variant of _grouped_kernel timed out (a hung GPU),
# unscaled ones too; each (shape, variant) runs in its own process under a time limit.
# PROBE_SHAPES / PROBE_VARIANTS (comma lists of names / indices) narrow a run.
VARIANT_TIMEOUT_S = int(os.environ.get("PROBE_TIMEOUT_S", "45"))


def _graph_us(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    times = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / reps)
    return statistics.median(times)


def _one(name: str, vi: int) -> dict:
    """Time and check variant VARIANTS[vi] on shape SHAPES[name] (in this process)."""
    E, rows, N, K = SHAPES[name]
    label, dt, scale, ws, nw, bm, bn, st, persistent, *rest = VARIANTS[vi]
    bk = rest[0] if rest else 128
    dev = torch.device("cuda")
    if dt == "runner":
        return _runner_gate_up(name, label)
    if dt == "cublas":
        a = torch.randn(E * rows, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        c = torch.empty(E * rows, N, device=dev, dtype=torch.bfloat16)
        us = _graph_us(lambda: torch.mm(a, b.T, out=c))
        return {"variant": label, "us": us, "tflops": 2 * E * rows * N * K / us / 1e6}
    M = E * rows
    torch.manual_seed(0)
    dtype = torch.float8_e4m3fn if dt == "fp8" else torch.bfloat16
    a8 = (torch.randn(M, K, device=dev) * 8).to(dtype)
    b8 = (torch.randn(E * N, K, device=dev) * 10).to(dtype)
    a_s = torch.rand(K // 128, M, device=dev) * 0.1 + 0.05
    b_s = torch.rand(E, N // 128, K // 128, device=dev) * 0.01 + 0.001
    be = torch.arange(M // bm, device=dev, dtype=torch.int32) * bm // rows
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    da = TensorDescriptor.from_tensor(a8, [bm, bk])
    db = TensorDescriptor.from_tensor(b8, [bn, bk])
    tiles = (M // bm) * (N // bn)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    kernel, grid = (
        (_persistent_kernel, (min(sms, tiles),)) if persistent else (_grouped_kernel, (tiles,))
    )
    extra = {"NUM_SMS": min(sms, tiles)} if persistent else {}

    def launch():
        kernel[grid](
            da,
            db,
            a_s,
            b_s,
            c,
            be,
            M,
            N,
            K,
            a_s.stride(0),
            b_s.stride(0),
            b_s.stride(1),
            c.stride(0),
            SCALE=scale,
            BM=bm,
            BN=bn,
            BK=bk,
            GROUP_M=8,
            WS=ws,
            NSTAGE=st,
            num_warps=nw,
            **extra,
        )

    us = _graph_us(launch)
    rec = {"variant": label, "us": us, "tflops": 2 * M * N * K / us / 1e6}
    errs = []
    for e in (0, E - 1):  # every variant against float32 math on two experts
        r = slice(e * rows, (e + 1) * rows)
        a_e, b_e = a8[r].float(), b8[e * N : (e + 1) * N].float()
        if scale:
            a_e = a_e * a_s[:, r].T.repeat_interleave(128, dim=1)
            b_e = b_e * b_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        want = a_e @ b_e.T
        errs.append(((c[r].float() - want).abs().max() / want.abs().max()).item())
    rec["max_rel_err"] = max(errs)
    return rec


def _runner_gate_up(name: str, label: str) -> dict:
    """The triton runner's gate_up (bf16) at T = 4096 on the model of SHAPES[name], with the
    config it looks up, timed like the variants (one uniform routing, CUDA-graph replay)."""
    from moekit.runners.triton import ops
    from moekit.tune import _gate_up_fn, _Point, random_weights, shape_for

    model = {"qwen3": ("qwen3-30b-a3b", 1), "deepseek": ("deepseek-v3", 8)}[name.split("_")[0]]
    shape = shape_for(model[0], model[1], model[1])
    w = random_weights(shape, "cuda")
    p = _Point(shape, w, 4096, "cuda", seed=0)
    p.topks = p.topks[:1]
    cfg = ops.configs_for(4096, shape.top_k, w, torch.bfloat16, torch.device("cuda"))[0]
    fn, _ = _gate_up_fn(p, cfg)
    us = _graph_us(fn)
    M = 4096 * shape.top_k
    flops = 2 * M * 2 * shape.intermediate * shape.hidden
    return {"variant": label, "us": us, "tflops": flops / us / 1e6, "config": str(cfg)}


def _child(name: str, vi: int) -> dict:
    """_one in a child process under VARIANT_TIMEOUT_S (a hung kernel must not stop the run)."""
    import subprocess
    import sys

    cmd = [sys.executable, __file__, "--one", name, str(vi)]
    try:
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return {"variant": VARIANTS[vi][0], "error": f"timed out after {VARIANT_TIMEOUT_S} s"}
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = " ".join(r.stderr.strip().splitlines()[-2:])[-300:]
    return {"variant": VARIANTS[vi][0], "error": f"exit {r.returncode}: {tail}"}


def main() -> None:
    import sys

    if sys.argv[1:2] == ["--one"]:
        print("RESULT " + json.dumps(_one(sys.argv[2], int(sys.argv[3]))), flush=True)
        return
    only = os.environ.get("PROBE_SHAPES")
    pick = os.environ.get("PROBE_VARIANTS")
    indices = [int(v) for v in pick.split(",")] if pick else range(len(VARIANTS))
    shapes = []
    for name, (E, rows, N, K) in SHAPES.items():
        if only and name not in only.split(","):
            continue
        recs = []
        for vi in indices:
            recs.append(_child(name, vi))
            print(name, recs[-1], flush=True)
        base = recs[0].get("us")
        for r in recs:
            if base and "us" in r:
                r["over_fp8_plain"] = r["us"] / base
        shapes.append(
            {"shape": name, "E": E, "rows_per_expert": rows, "N": N, "K": K, "variants": recs}
        )
    write_probe("fp8_ws_probe.json", {"shapes": shapes})


if __name__ == "__main__":
    main()
