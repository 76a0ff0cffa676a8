"""One `triton`-runner layer call per (job, batch size) under Nsight Compute: where the decode
kernels' time goes (warp stall reasons, throughput, occupancy), e.g. fp8 against bf16.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --csv --page details \
        python3 scripts/gpu_ncu_decode.py --jobs 'qwen3-30b-a3b 1 1 fp8_w8a8;...' \
        --batches 1 > ncu.csv

Each point's layer runs on its first input set through `probe_out.profiled_call`: a fill
kernel of (point index + 1) elements before each profiled call, so the CSV's kernels split by
point (the order is printed to stderr).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import option, profiled_call, triton_layer_points


def main() -> None:
    jobs = [j.split() for j in option("--jobs", "qwen3-30b-a3b 1 1 fp8_w8a8").split(";")]
    batches = [int(b) for b in option("--batches", "1").split(",")]
    with torch.no_grad():
        for i, (name, _, module, sets) in enumerate(triton_layer_points(jobs, batches)):
            x, topk = sets[0]
            profiled_call(lambda: module.forward_topk(x, topk), i)
            print(f"point {i + 1}: {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
