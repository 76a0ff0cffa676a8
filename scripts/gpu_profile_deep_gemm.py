"""Where the `deep_gemm` runner's time goes (GPU): torch.profiler's CUDA kernel table for one
call, on the deepseek-v3 EP8 shape (32 local experts of 256: 7/8 of the pairs masked, as the
benchmark's global routing gives) and the qwen3 shape, fp8 block-wise and bf16.

With `multicast`: the contiguous GEMMs alone with TMA multicast of A over CTA pairs against
without (same inputs, outputs compared, alternated timing rounds).

Usage (repo root, device machine, sgl-deep-gemm installed):
  python scripts/gpu_profile_deep_gemm.py [profile] [multicast]
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import quantize_experts
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.stages import StandardDispatchOutput

CASES = [  # name, E local, E global, K, H, I, T, fp8
    ("qwen3 fp8", 128, 128, 8, 2048, 768, 4096, True),
    ("qwen3 fp8", 128, 128, 8, 2048, 768, 16384, True),
    ("qwen3 bf16", 128, 128, 8, 2048, 768, 4096, False),
    ("qwen3 bf16", 128, 128, 8, 2048, 768, 16384, False),
    ("deepseek-ep8 fp8", 32, 256, 8, 7168, 2048, 4096, True),
    ("deepseek-ep8 fp8", 32, 256, 8, 7168, 2048, 16384, True),
    ("deepseek-ep8 bf16", 32, 256, 8, 7168, 2048, 16384, False),
    ("mixtral-tp2 bf16", 8, 8, 2, 4096, 3584, 4096, False),
]


def time_us(fn, rounds: int = 20) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / rounds


def multicast() -> None:
    from moekit.quant.act_quant import quantize_act
    from moekit.quant.quantize import quantize
    from moekit.runners import deep_gemm_jit as jit

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for E, N, K, per in ((32, 4096, 7168, 512), (32, 7168, 2048, 512), (128, 1536, 2048, 1024),
                         (128, 2048, 768, 1024)):  # fmt: skip
        M = E * per
        a = torch.randn(M, K, device="cuda").bfloat16()
        b = (torch.randn(E, N, K, device="cuda") / K**0.5).bfloat16()
        ends = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * per
        q, s = quantize_act(a, "token_group", torch.float8_e4m3fn, group_size=128)
        sfa = s.t().contiguous().unsqueeze(0)
        qb = quantize(b, "fp8_w8a8")
        for fp8 in (True, False):
            outs, calls = {}, {}
            for mc in (1, 2):
                cfg = jit.choose(fp8, False, N, K, E, per, sms, multicast=mc)
                d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                args = ((cfg, q, qb.data.view(E * N, K), d, ends, M, sfa, qb.scale) if fp8
                        else (cfg, a, b.view(E * N, K), d, ends, M))  # fmt: skip
                calls[mc] = lambda args=args: jit.launch(*args)
                calls[mc]()
                outs[mc] = d
            torch.cuda.synchronize()
            same = torch.equal(outs[1], outs[2])
            t = {1: [], 2: []}
            for _ in range(3):
                for mc in (1, 2):
                    t[mc].append(time_us(calls[mc]))
            t1, t2 = min(t[1]), min(t[2])
            tf = 2 * M * N * K / 1e6
            print(f"{'fp8' if fp8 else 'bf16'} E={E} M={M} N={N} K={K}: multicast 1 {t1:.0f} us "
                  f"({tf / t1:.0f} TFLOP/s), 2 {t2:.0f} us ({tf / t2:.0f}); 1/2 = {t1 / t2:.3f}; "
                  f"outputs equal: {same}", flush=True)


def profile_runner() -> None:
    runner = registry.runner_class("deep_gemm")()
    act = ActivationSpec("silu")
    for name, E, Eg, K, H, I, T, fp8 in CASES:
        w = ExpertWeights((torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16(),
                          (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16())
        if fp8:
            w = quantize_experts(w, "fp8_w8a8")
        ids = torch.rand(T, Eg, device="cuda").argsort(dim=1)[:, :K].int()
        ids = torch.where(ids < E, ids, -1)  # experts of other ranks are masked here
        d = StandardDispatchOutput(torch.randn(T, H, device="cuda").bfloat16(),
                                   TopKOutput(torch.rand(T, K, device="cuda"), ids))
        for _ in range(3):
            runner.run(d, w, act)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(d, w, act)
            torch.cuda.synchronize()
        from moekit.bench import time_ms

        graph_us = time_ms(lambda: runner.run(d, w, act), "cuda") * 1e3
        print(f"\n=== {name} T={T} (local pairs {(ids >= 0).sum().item()}): "
              f"CUDA-graph replay {graph_us:.0f} us")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24,
                                        max_name_column_width=70))


if __name__ == "__main__":
    import sys

    what = sys.argv[1:] or ["profile"]
    if "multicast" in what:
        multicast()
    if "profile" in what:
        profile_runner()
