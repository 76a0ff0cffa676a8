"""Why `auto` (which picks deep_gemm) timed slower than deep_gemm itself on deepseek-v3 EP8 fp8
at mid batch sizes in scripts/gpu_backends.sh (H100: T=1024, 4096; H200: T=256, 1024): there
the two are timed in two sweeps, each building its own layer. Here: three sweeps in one
process over the same points, (deep_gemm, auto) in one layer, then auto alone, then deep_gemm
alone, each in a new layer, so that the path (auto vs direct) and the layer instance are told
apart.

Usage (repo root, device machine, sgl-deep-gemm installed): python scripts/gpu_probe_auto_gap.py
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from moekit.report import metadata
from moekit.select_tune import sweep_spec
from moekit.sweep import run_sweep

BATCHES = (256, 1024, 4096)


def main() -> None:
    spec = sweep_spec("deepseek-v3", tp_size=8, ep_size=8, dtype="bfloat16",
                      quantization="fp8_w8a8", batch_sizes=BATCHES, routing="uniform",
                      time_budget_s=None, backends=("deep_gemm", "auto"))  # fmt: skip
    runs = [("both, one layer", spec), ("auto alone, new layer", replace(spec, backends=("auto",))),
            ("deep_gemm alone, new layer", replace(spec, backends=("deep_gemm",))),
            ("both again, new layer", spec)]  # fmt: skip
    out = {"meta": metadata(command=" ".join(["python", *sys.argv]))}
    for name, s in runs:
        res = run_sweep(s)
        rows = {f"{r.backend} T={r.T}": (r.ms, r.chosen) for r in res.records}
        out[name] = rows
        print(name, {k: (round(v[0], 4) if v[0] else None, v[1]) for k, v in rows.items()},
              flush=True)  # fmt: skip
    with open(os.path.join(os.environ.get("OUT", "."), "auto_gap.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
