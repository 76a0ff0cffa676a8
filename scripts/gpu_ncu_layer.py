"""One layer call per variant under Nsight Compute: which kernels each variant runs and where
their time goes (duration, DRAM and SM throughput per kernel).

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --csv \
        python3 scripts/gpu_ncu_layer.py --job 'deepseek-v3 8 8' --batch 4096 \
        --variants 'triton;auto;0;16' > ncu.csv

Variants as in gpu_gluon_fold_ab.py (`triton`, or a fold spec of the triton_kernel runner's
Gluon engine), each run by `probe_out.profiled_call`: a fill kernel of (variant index + 1)
elements before each profiled call, so the CSV's kernels split by variant.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gluon_fold_ab import _variant
from probe_out import option, profiled_call

from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer


def main() -> None:
    model, tp, ep = option("--job", "deepseek-v3 8 8").split()
    T = int(option("--batch", "4096"))
    names = option("--variants", "triton;auto").split(";")
    spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization="unquantized",
                      batch_sizes=(T,), backends=("triton",))  # fmt: skip
    module = build_layer(spec)
    caches = {"triton": RunnerCache(RunnerConfig("triton")),
              "tk": RunnerCache(RunnerConfig("triton_kernel"))}  # fmt: skip
    x, topk = _input_sets(spec, module, T, torch.Generator().manual_seed(0), 0)[0][0]

    def ctx(n):
        return _variant(module, caches["triton"], "0") if n == "triton" else \
            _variant(module, caches["tk"], n)

    def call(n):
        with ctx(n):
            module.forward_topk(x, topk)

    with torch.no_grad():
        for i, n in enumerate(names):
            profiled_call(lambda n=n: call(n), i)
    print("variants:", names, file=sys.stderr)


if __name__ == "__main__":
    main()
