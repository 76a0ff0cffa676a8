"""Where the `deep_gemm` runner's time goes (GPU): torch.profiler's CUDA kernel table for one
call, on the deepseek-v3 EP8 shape (32 local experts of 256: 7/8 of the pairs masked, as the
benchmark's global routing gives) and the qwen3 shape, fp8 block-wise and bf16.

With `multicast`: the contiguous GEMMs alone with TMA multicast of A over CTA pairs against
without (same inputs, outputs compared, alternated timing rounds).

Usage (repo root, device machine, sgl-deep-gemm installed):
  python scripts/gpu_profile_deep_gemm.py [profile] [multicast] [tiles]

With `tiles`: the contiguous GEMMs of the presets with other row / column tiles; with
`tiles-gpt-oss`: gpt-oss-120b's (H = I = 2880, off the 128 grid), fp8, column tiles 128-256.
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


def variant(fp8: bool, n: int, k: int, groups: int, bm: int, bn: int, sms: int):
    """A KernelConfig with row tile bm and column tile bn (as many stages as fit), or None."""
    import dataclasses

    from moekit.runners import deep_gemm_jit as jit

    base = jit.choose(fp8, False, n, k, groups, 1024, sms)
    stages = jit.MAX_STAGES
    while stages > 2 and jit._smem_bytes(fp8, bm, bn, k, stages) > jit.SMEM_LIMIT:
        stages -= 1
    if jit._smem_bytes(fp8, bm, bn, k, stages) > jit.SMEM_LIMIT:
        return None
    swizzle = next((s for s in (128, 64, 32) if (bn * 2) % s == 0), 0)
    return dataclasses.replace(base, block_m=bm, block_n=bn, stages=stages, swizzle_d=swizzle)


GPT_OSS = [  # name, E, N, K, pairs
    ("gpt-oss gate_up", 128, 5760, 2880, 4096 * 4), ("gpt-oss down", 128, 2880, 2880, 4096 * 4),
    ("gpt-oss gate_up", 128, 5760, 2880, 16384 * 4), ("gpt-oss down", 128, 2880, 2880, 16384 * 4),
]  # fmt: skip


def tiles(probs=None, fp8s=(True, False), fp8_bns=(128, 160, 192), row_tiles=(128, 64)) -> None:
    """The contiguous GEMMs of the presets at T = 4096 and 16384 (uniform routing, psum layout)
    with column tiles 128 .. 256 and row tiles 64 / 128: time and TFLOP/s per variant."""
    from concurrent.futures import ThreadPoolExecutor

    from moekit.quant.act_quant import quantize_act
    from moekit.quant.quantize import quantize
    from moekit.runners import deep_gemm_jit as jit

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    probs = probs or [  # name, E, N, K, pairs
        ("qwen3 gate_up", 128, 1536, 2048, 4096 * 8), ("qwen3 down", 128, 2048, 768, 4096 * 8),
        ("qwen3 gate_up", 128, 1536, 2048, 16384 * 8), ("qwen3 down", 128, 2048, 768, 16384 * 8),
        ("deepseek gate_up", 32, 4096, 7168, 16384), ("deepseek down", 32, 7168, 2048, 16384),
        ("mixtral gate_up", 8, 7168, 4096, 8192), ("mixtral down", 8, 4096, 3584, 8192),
    ]  # fmt: skip
    jobs = []
    for name, E, N, K, pairs in probs:
        for fp8 in fp8s:
            bns = fp8_bns if fp8 else (128, 192, 256)
            for bm in row_tiles:
                for bn in bns:
                    cfg = variant(fp8, N, K, E, bm, bn, sms)
                    if cfg is not None:
                        jobs.append((name, E, N, K, pairs, fp8, cfg))
    with ThreadPoolExecutor(16) as pool:  # build every variant in parallel
        built = list(pool.map(lambda j: _try_build(j[-1]), jobs))
    for (name, E, N, K, pairs, fp8, cfg), err in zip(jobs, built):
        if err:
            print(f"{name} pairs={pairs} {'fp8' if fp8 else 'bf16'} bm={cfg.block_m} "
                  f"bn={cfg.block_n}: BUILD FAILED {err}", flush=True)
    done = {}
    for (name, E, N, K, pairs, fp8, cfg), err in zip(jobs, built):
        if err:
            continue
        torch.manual_seed(0)
        counts = torch.bincount(torch.randint(0, E, (pairs,)), minlength=E)
        starts = torch.cumsum((counts + 127) // 128 * 128, 0) - (counts + 127) // 128 * 128
        ends = (starts + counts).int().cuda()
        M = int(((counts + 127) // 128 * 128).sum())
        key = (name, pairs, fp8)
        if key not in done:
            a = torch.randn(M, K, device="cuda").bfloat16()
            b = (torch.randn(E, N, K, device="cuda") / K**0.5).bfloat16()
            q, sc = quantize_act(a, "token_group", torch.float8_e4m3fn, group_size=128)
            qb = quantize(b, "fp8_w8a8")
            done.clear()
            done[key] = (a, b, q, sc.t().contiguous().unsqueeze(0), qb, {})
        a, b, q, sfa, qb, outs = done[key]
        d = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        args = ((cfg, q, qb.data.view(E * N, K), d, ends, M, sfa, qb.scale) if fp8
                else (cfg, a, b.view(E * N, K), d, ends, M))  # fmt: skip
        jit.launch(*args)
        torch.cuda.synchronize()
        ref = outs.setdefault("ref", d)
        rows = torch.cat([torch.arange(int(s), int(s + c)) for s, c in zip(starts, counts)])
        diff = (d[rows].float() - ref[rows].float()).abs().max().item()
        us = min(time_us(lambda: jit.launch(*args)) for _ in range(3))
        tf = 2 * pairs * N * K / us / 1e6
        print(f"{name} pairs={pairs} {'fp8' if fp8 else 'bf16'} bm={cfg.block_m} "
              f"bn={cfg.block_n} stages={cfg.stages}: {us:.1f} us, {tf:.0f} TFLOP/s "
              f"(useful), max |diff| vs first {diff:.3g}", flush=True)


def _try_build(cfg) -> str | None:
    from moekit.runners import deep_gemm_jit as jit

    try:
        jit.library(cfg)
    except Exception as e:  # noqa: BLE001
        return str(e).splitlines()[-1][:200]
    return None


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
    from moekit.report import git_commit

    print(f"# {' '.join(sys.argv)} on {torch.cuda.get_device_name()} at commit {git_commit()[0]}",
          flush=True)  # fmt: skip
    if "multicast" in what:
        multicast()
    if "tiles" in what:
        tiles()
    if "tiles-gpt-oss" in what:
        tiles(GPT_OSS, fp8s=(True,), fp8_bns=(128, 160, 192, 224, 256), row_tiles=(128,))
    if "profile" in what:
        profile_runner()
