"""moekit's own host time per eager `MoE.forward` on the `triton` runner, with every Triton launch
stubbed out: what the layer's Python (routing, selection, wrappers, allocations) costs on this
CPU, without a GPU and without Triton's launcher (which a GPU run adds on top: see
benchmarks/integration_notes.md, `scripts/gpu_probe_host.py`).

    .venv/bin/python scripts/cpu_host_overhead.py [--batch 1] [--iters 500] [--profile]

Prints the aten ops of one forward and the mean host us per forward (qwen3-30b-a3b's E and K,
H = 256, I = 128, float16, TRITON_INTERPRET=1 so that the runner is available on the CPU).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option  # noqa: E402

from moekit import MoE, MoEConfig, RunnerConfig  # noqa: E402


class _NoLaunch:
    """kernel[grid](...) that launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches() -> None:
    import moekit.runners._align_kernels as align_k
    import moekit.runners.triton._kernels as triton_k
    from moekit.runners.triton import ops

    ops._launch = lambda *args, **kwargs: None  # the two GEMMs
    for mod in (align_k, triton_k):
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(mod, name, _NoLaunch())


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def main() -> None:
    T, iters = int(option("--batch", "1")), int(option("--iters", "500"))
    _stub_launches()
    cfg = MoEConfig(num_experts=128, top_k=8, hidden_size=256, intermediate_size=128,
                    dtype="float16")  # fmt: skip
    layer = MoE(cfg, runner=RunnerConfig("triton"), device="cpu")
    x, logits = torch.randn(T, 256, dtype=torch.float16), torch.randn(T, 128)
    for _ in range(5):
        layer(x, logits)
    counter = _CountOps()
    with counter:
        layer(x, logits)
    print(f"aten ops per forward: {sum(counter.ops.values())}")
    for name, n in sorted(counter.ops.items(), key=lambda kv: -kv[1]):
        print(f"  {n:3d} {name}")
    t0 = time.perf_counter()
    for _ in range(iters):
        layer(x, logits)
    print(f"host us per forward (T = {T}): {(time.perf_counter() - t0) / iters * 1e6:.1f}")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            layer(x, logits)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
