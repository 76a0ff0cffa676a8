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
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _grouped_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, be_ptr, M, N, K,
    stride_ask, stride_bse, stride_bsn, stride_cm,
    SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, WS: tl.constexpr, NSTAGE: tl.constexpr,
):  # fmt: skip
    """C [M, N] bf16 = A [M, K] @ B [E * N, K]^T rows of expert be[m // BM]; SCALE: A's scales
    [K / 128, M] (float32, transposed) x B's [E, N / 128, K / 128] applied every K step."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    width = GROUP_M * num_pid_n
    first = (pid // width) * GROUP_M
    gsz = min(num_pid_m - first, GROUP_M)
    pid_m = first + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    e = tl.load(be_ptr + pid_m)
    m0 = pid_m * BM
    n0 = pid_n * BN
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for ki in tl.range(0, K // BK, warp_specialize=WS, num_stages=NSTAGE):
        a = a_desc.load([m0, ki * BK])
        b = b_desc.load([e * N + n0, ki * BK])
        if SCALE:
            sa = tl.load(as_ptr + ki * stride_ask + offs_m)
            sb = tl.load(bs_ptr + e * stride_bse + (offs_n // 128) * stride_bsn + ki)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b.T, acc)
    c = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(tl.bfloat16))


SHAPES = {  # name: (E, rows an expert at T = 4096, N, K)
    "qwen3_gate_up": (128, 256, 1536, 2048),
    "qwen3_down": (128, 256, 2048, 768),
    "deepseek_gate_up": (32, 1024, 4096, 7168),
    "deepseek_down": (32, 1024, 7168, 2048),
}
# (label, dtype, SCALE, WS, num_warps, BM, BN, stages)
VARIANTS = [
    ("bf16 plain nw8 128x256", "bf16", 0, False, 8, 128, 256, 3),
    ("fp8 plain nw8 128x256", "fp8", 0, False, 8, 128, 256, 4),
    ("fp8 plain ws nw4 128x256", "fp8", 0, True, 4, 128, 256, 4),
    ("fp8 block nw8 128x128", "fp8", 1, False, 8, 128, 128, 4),
    ("fp8 block nw4 128x128", "fp8", 1, False, 4, 128, 128, 4),
    ("fp8 block ws nw4 128x128 s3", "fp8", 1, True, 4, 128, 128, 3),
    ("fp8 block ws nw4 128x128 s4", "fp8", 1, True, 4, 128, 128, 4),
    ("fp8 block ws nw4 128x128 s5", "fp8", 1, True, 4, 128, 128, 5),
    ("fp8 block ws nw4 128x256 s3", "fp8", 1, True, 4, 128, 256, 3),
]


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


def _shape_run(name, E, rows, N, K, dev):
    M = E * rows
    torch.manual_seed(0)
    a_bf = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    b_bf = torch.randn(E * N, K, device=dev, dtype=torch.bfloat16) * 0.05
    a8 = (a_bf * 8).to(torch.float8_e4m3fn)
    b8 = (b_bf * 200).to(torch.float8_e4m3fn)
    a_s = torch.rand(K // 128, M, device=dev) * 0.1 + 0.05
    b_s = torch.rand(E, N // 128, K // 128, device=dev) * 0.01 + 0.001
    be = torch.arange(M // 128, device=dev, dtype=torch.int32) * 128 // rows
    out = []
    ref = None
    for label, dt, scale, ws, nw, bm, bn, st in VARIANTS:
        a, b = (a_bf, b_bf) if dt == "bf16" else (a8, b8)
        c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        da = TensorDescriptor.from_tensor(a, [bm, 128])
        db = TensorDescriptor.from_tensor(b, [bn, 128])
        grid = ((M // bm) * (N // bn),)

        def launch(da=da, db=db, c=c, grid=grid, scale=scale, ws=ws, nw=nw, bm=bm, bn=bn, st=st):
            _grouped_kernel[grid](
                da, db, a_s, b_s, c, be, M, N, K, a_s.stride(0), b_s.stride(0), b_s.stride(1),
                c.stride(0), SCALE=scale, BM=bm, BN=bn, BK=128, GROUP_M=8, WS=ws, NSTAGE=st,
                num_warps=nw,
            )

        rec = {"variant": label}
        try:
            us = _graph_us(launch)
            rec.update(us=us, tflops=2 * M * N * K / us / 1e6)
            if scale:
                if ref is None:
                    ref = {}
                    for e in (0, E - 1):
                        r = slice(e * rows, (e + 1) * rows)
                        sa = a_s[:, r].T.repeat_interleave(128, dim=1)
                        sb = b_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
                        bd = b8[e * N:(e + 1) * N].float() * sb
                        ref[e] = (a8[r].float() * sa) @ bd.T
                errs = []
                for e, want in ref.items():
                    got = c[e * rows:(e + 1) * rows].float()
                    errs.append(((got - want).abs().max() / want.abs().max()).item())
                rec["max_rel_err"] = max(errs)
        except Exception as err:  # noqa: BLE001 - report and go on
            rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(name, rec, flush=True)
        out.append(rec)
    base = next((r["us"] for r in out if r["variant"].startswith("fp8 plain nw8") and "us" in r),
                None)
    for r in out:
        if base and "us" in r:
            r["over_fp8_plain"] = r["us"] / base
    return {"shape": name, "E": E, "rows_per_expert": rows, "N": N, "K": K, "variants": out}


def main() -> None:
    dev = torch.device("cuda")
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("MOEKIT_GIT_COMMIT", "?"),
        "shapes": [_shape_run(n, *s, dev) for n, s in SHAPES.items()],
    }
    path = os.path.join(os.environ.get("OUT", "."), "fp8_ws_probe.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
