"""The activation rows of the `deep_gemm` / `cutlass` runners (`gemm_rows` with an activation)
on gpt-oss-120b's interleaved gate / up columns: this tree's kernel against a previous copy of
`runners/_cutlass_kernels.py`, on the same inputs, outputs compared bit for bit, timed in turns.

    git show REV:src/moekit/runners/_cutlass_kernels.py > /tmp/prev_cutlass_kernels.py
    PREV_KERNELS=/tmp/prev_cutlass_kernels.py PYTHONPATH=src \
        python3 scripts/gpu_probe_rows_interleaved.py   # writes $OUT/rows_interleaved.json

Rows: T * K pairs of gpt-oss-120b at T = 4096 and 16384 (K = 4), h [M, 2I] bf16 with I = 2880,
biases b13 [128, 2I]; fp8 (DeepGEMM's input: e4m3 rows and MN-major scales per 128 rows) and
bf16 (the `cutlass` runner's). GB/s counts h read and the rows written.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from moekit.bench import time_ms_interleaved
from moekit.experts import ActivationSpec
from moekit.runners import _cutlass_kernels as new

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import write_probe  # noqa: E402

E, I = 128, 2880


def load_prev(path: str):
    spec = importlib.util.spec_from_file_location("prev_cutlass_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    prev = load_prev(os.environ["PREV_KERNELS"])
    act = ActivationSpec("swiglu_oai", interleaved=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = []
    for M in (16384, 65536):
        h = (torch.randn(M, 2 * I, device="cuda", generator=gen) * 3).bfloat16()
        expert = torch.randint(0, E, (M,), dtype=torch.int32, device="cuda", generator=gen)
        b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).bfloat16()
        for quant in (True, False):
            kw = dict(act=act, b13_EN=b13, quant=quant, rows_per_group=128 if quant else 1)
            q0, s0 = prev.gemm_rows_triton(h, expert, **kw)
            q1, s1 = new.gemm_rows_triton(h, expert, **kw)
            same = torch.equal(q0.float(), q1.float()) and (s0 is None or torch.equal(s0, s1))
            ms = time_ms_interleaved(
                {"prev": lambda: prev.gemm_rows_triton(h, expert, **kw),
                 "new": lambda: new.gemm_rows_triton(h, expert, **kw)},
                "cuda", rounds=6,
            )  # fmt: skip
            moved = h.numel() * 2 + M * I * (1 if quant else 2)
            point = {
                "rows": M,
                "out": "fp8" if quant else "bf16",
                "bit_equal": same,
                "us": {k: round(v * 1e3, 1) for k, v in ms.items()},
                "GB/s": {k: round(moved / (v * 1e-3) / 1e9) for k, v in ms.items()},
                "prev/new": round(ms["prev"] / ms["new"], 3),
            }
            print(point, flush=True)
            points.append(point)
    write_probe("rows_interleaved.json", {"points": points})


if __name__ == "__main__":
    main()
