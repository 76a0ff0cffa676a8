"""How fast can a decode call's few blocks stream one expert's 4-bit weights? (the `w4a16`
runner's gate_up at deepseek-v3 EP8 T = 1: 14.7 MB in 12-15 us, benchmarks/w4a16_notes.md).

    PYTHONPATH=src python3 scripts/gpu_probe_w4a16_stream.py stream [--mb 14.68]
    PYTHONPATH=src python3 scripts/gpu_probe_w4a16_stream.py one deepseek-v3:ep8:mxfp4
        (one local pair per call, eager, 6 calls: run it under `ncu -k regex:moe_w4`)

`stream`: a plain read kernel (16-byte `ld.global.nc` loads, UNROLL of them in flight per
thread) over a fresh MB-sized slice of a 2 GB buffer per launch, at grids of 128 ... 1056
blocks and 128 / 256 threads, in CUDA-graph replay of 32 launches (us per launch, and the GB/s
that makes); an empty launch for the fixed cost. Two access patterns: `dense`, the warps sweep
the slice together (grid stride); `segments`, each warp streams its own contiguous part (as a
w4a16 warp streams its weight tiles: one read cursor per warp); `ring`, segments through a
per-warp shared-memory ring of UNROLL slots filled with cp.async, as the w4a16 ring does.
Writes $OUT/w4a16_stream.json.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from moekit.runners import _nvcc

SOURCE = r"""
#include <cuda_runtime.h>
#include <stdint.h>
template <int UNROLL>
__global__ void stream(const uint4* __restrict__ src, long long n16, uint4* sink) {
  // each warp reads a contiguous run of 32 * UNROLL vectors a step; warps stride the buffer
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  uint32_t acc = 0;
  for (long long base = warp * 32 * UNROLL; base < n16; base += warps * 32 * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = base + u * 32 + lane;
      if (i < n16)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + i));
      else
        v[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = make_uint4(acc, 0, 0, 0);
}
// the same loads, but each warp streams its own contiguous segment of n16 / warps vectors (as
// a w4a16 warp streams its weight tiles): as many read cursors as warps, spread over the buffer
template <int UNROLL>
__global__ void stream_seg(const uint4* __restrict__ src, long long n16, uint4* sink) {
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const long long seg = (n16 + warps - 1) / warps, end = min(n16, (warp + 1) * seg);
  const int lane = threadIdx.x & 31;
  uint32_t acc = 0;
  for (long long base = warp * seg; base < end; base += 32 * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const long long i = base + u * 32 + lane;
      if (i < end)
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + i));
      else
        v[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = make_uint4(acc, 0, 0, 0);
}
// segments again, through a per-warp shared-memory ring of STAGES slots of 512 bytes filled
// with cp.async (16 bytes a lane, L2 only), as the w4a16 ring streams its weights: wait for the
// oldest slot, read this lane's 16 bytes back, refill the slot
template <int STAGES>
__global__ void stream_ring(const uint4* __restrict__ src, long long n16, uint4* sink) {
  __shared__ uint4 ring[4][STAGES][32];  // up to 4 warps a block
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + w;
  const long long seg = (n16 + warps - 1) / warps, begin = warp * seg;
  const long long end = min(n16, begin + seg);
  const long long steps = end > begin ? (end - begin + 31) / 32 : 0;
  auto issue = [&](int st, long long step) {
    const long long i = begin + step * 32 + lane;
    if (step < steps && i < end) {
      const unsigned dst = (unsigned)__cvta_generic_to_shared(&ring[w][st][lane]);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src + i) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
#pragma unroll
  for (int st = 0; st < STAGES; ++st) issue(st, st);
  uint32_t acc = 0;
  for (long long step = 0, st = 0; step < steps; ++step) {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
    const uint4 v = ring[w][st][lane];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
    issue(st, step + STAGES);
    st = st + 1 == STAGES ? 0 : st + 1;
  }
  if (acc == 0x9e3779b9u) sink[0] = make_uint4(acc, 0, 0, 0);
}
extern "C" int probe_stream(int unroll, int blocks, int threads, const void* src, long long n16,
                            void* sink, void* stream_) {
  cudaStream_t s = static_cast<cudaStream_t>(stream_);
  const uint4* p = static_cast<const uint4*>(src);
  uint4* q = static_cast<uint4*>(sink);
  switch (unroll) {
    case 1: stream<1><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 2: stream<2><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 4: stream<4><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 8: stream<8><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case -2: stream_seg<2><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case -4: stream_seg<4><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case -8: stream_seg<8><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 104: stream_ring<4><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 108: stream_ring<8><<<blocks, threads, 0, s>>>(p, n16, q); break;
    case 116: stream_ring<16><<<blocks, threads, 0, s>>>(p, n16, q); break;
    default: return -1;
  }
  return (int)cudaGetLastError();
}
"""

DEV = torch.device("cuda")
LAUNCHES = 32


def _library() -> ctypes.CDLL:
    src = Path(tempfile.mkdtemp()) / "stream.cu"
    src.write_text(SOURCE)
    major, minor = torch.cuda.get_device_capability()
    args = [str(src), "-shared", "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]  # fmt: skip
    lib = ctypes.CDLL(str(_nvcc.build(_nvcc.nvcc(), args, "probe", [SOURCE.encode()], "probe")))
    lib.probe_stream.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p, ctypes.c_longlong,
                                                      ctypes.c_void_p, ctypes.c_void_p]  # fmt: skip
    return lib


def stream(mb: float) -> dict:
    lib = _library()
    buf = torch.empty(2 << 30, dtype=torch.uint8, device=DEV)
    sink = torch.zeros(16, dtype=torch.uint8, device=DEV)
    n16 = int(mb * 1e6) // 16
    slices = (buf.numel() // 16) // n16
    s = torch.cuda.Stream()

    def timed(unroll: int, blocks: int, threads: int, n: int) -> float:
        def launches():
            for i in range(LAUNCHES):
                off = (i % slices) * n16 * 16
                stream_ = torch.cuda.current_stream().cuda_stream
                err = lib.probe_stream(unroll, blocks, threads, buf.data_ptr() + off, n,
                                       sink.data_ptr(), stream_)  # fmt: skip
                assert err == 0, err

        with torch.cuda.stream(s):
            launches()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            launches()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / LAUNCHES)
        return sorted(times)[len(times) // 2]

    rows = [{"what": "empty launch, 132 x 128", "us": timed(1, 132, 128, 0)}]
    patterns = {"dense": (1, 2, 4, 8), "segments": (2, 4, 8), "ring": (4, 8, 16)}
    for pattern, unrolls in patterns.items():
        for threads in (128,) if pattern == "ring" else (128, 256):
            for blocks in (128, 264, 528, 1056):
                for unroll in unrolls:
                    code = {"dense": unroll, "segments": -unroll, "ring": 100 + unroll}[pattern]
                    us = timed(code, blocks, threads, n16)
                    rows.append({"pattern": pattern, "blocks": blocks, "threads": threads,
                                 "unroll": unroll,
                                 "in_flight_kb_per_sm": round(blocks * threads * unroll * 16
                                                              / min(blocks, 132) / 1024, 1),
                                 "us": round(us, 2), "gb_s": round(n16 * 16 / us / 1e3, 1)})  # fmt: skip
                    print(rows[-1], flush=True)
    return {"mb": mb, "device": torch.cuda.get_device_name(), "rows": rows}


def one(target: str) -> None:
    """Eager calls with exactly one local pair (token 0's first expert), each a different
    local expert: what ncu should see of gate_up and down at deepseek-v3 EP8 T = 1."""
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_w4a16_profile import setup

    from moekit.router import TopKOutput
    from moekit.runners.w4a16 import W4A16Runner

    shape, w, _, x, share = setup(target + ":1")
    r = W4A16Runner()
    K = shape.top_k
    for e in range(6):
        ids = torch.full((1, K), -1, dtype=torch.int32, device=DEV)
        ids[0, 0] = (5 * e) % shape.num_experts
        tk = TopKOutput(torch.full((1, K), 1.0 / K, device=DEV), ids)
        r.run_standard(x, tk, w, shape.act, local_share=share)
    torch.cuda.synchronize()


def main() -> int:
    mode = sys.argv[1]
    if mode == "one":
        one(sys.argv[2])
        return 0
    mb = float(sys.argv[sys.argv.index("--mb") + 1]) if "--mb" in sys.argv else 14.68
    res = stream(mb)
    with open(os.path.join(os.environ.get("OUT", "."), "w4a16_stream.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
