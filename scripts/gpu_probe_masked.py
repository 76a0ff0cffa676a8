"""The masked dispatch format (what a low-latency all-to-all delivers: x [E, C, H] with counts
[E]) on the runners that take it, timed in turns (`moekit.bench.time_ms_interleaved`, CUDA-graph
replay) and checked against the `torch` runner on the valid rows. deepseek-v3 EP8's local
shape (E=32, H=7168, I=2048), bf16 and fp8 block-wise, mean rows per expert 1 .. 64.

Usage (repo root, device machine, sgl-deep-gemm installed): python scripts/gpu_probe_masked.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

from moekit.bench import time_ms_interleaved
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import quantize_experts
from moekit.report import metadata
from moekit.runners import registry
from moekit.stages import MaskedDispatchOutput

E, H, I = 32, 7168, 2048
CASES = [(1, 64), (4, 64), (16, 64), (64, 128)]  # (mean rows per expert, capacity C)
RUNNERS = ("triton", "deep_gemm", "cutlass")


def main() -> None:
    torch.manual_seed(0)
    act = ActivationSpec("silu")
    base = ExpertWeights((torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16(),
                         (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16())  # fmt: skip
    out = {"meta": metadata(command=" ".join(["python", *sys.argv]))}
    for fmt in ("unquantized", "fp8_w8a8"):
        w = base if fmt == "unquantized" else quantize_experts(base, "fp8_w8a8")
        ref_runner = registry.runner_class("torch")()
        for mean, C in CASES:
            counts = torch.poisson(torch.full((E,), float(mean))).clamp(max=C).int().cuda()
            x = torch.randn(E, C, H, device="cuda").bfloat16()
            d = MaskedDispatchOutput(x, counts)
            ref = ref_runner.run(d, w, act).out.float()
            valid = torch.arange(C, device="cuda")[None, :] < counts[:, None]
            fns, errs = {}, {}
            for name in RUNNERS:
                runner = registry.runner_class(name)()
                try:
                    got = runner.run(d, w, act).out.float()
                except Exception as e:  # noqa: BLE001 - a runner that cannot take it says why
                    errs[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
                    continue
                diff = (got[valid] - ref[valid]).norm() / ref[valid].norm().clamp(min=1e-30)
                errs[name] = f"rel err {diff.item():.2e}"
                fns[name] = lambda runner=runner: runner.run(d, w, act)
            ms = time_ms_interleaved(fns, "cuda") if fns else {}
            key = f"{fmt} mean={mean} C={C} rows={int(counts.sum())}"
            out[key] = {n: {"ms": ms.get(n), "check": errs[n]} for n in RUNNERS}
            line = ", ".join(f"{n} {ms[n]:.4f} ms ({errs[n]})" if n in ms else f"{n}: {errs[n]}"
                             for n in RUNNERS)  # fmt: skip
            print(f"{key}: {line}", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "masked_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
