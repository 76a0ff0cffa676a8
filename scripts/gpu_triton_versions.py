"""Time the triton runner with its shipped tables under whichever Triton this process imports,
so that two Triton versions can be compared run by run on one GPU.

    PYTHONPATH=src python3 scripts/gpu_triton_versions.py LABEL [--points SPEC]
        # writes $OUT/versions_LABEL.json

SPEC: ';'-separated model:format:T1,T2 (format 'bf16' or a name of gpu_triton_quant.FORMATS).
Each point: the whole runner call (`ops.fused_moe`, CUDA-graph replay of rotated routings,
`moekit.bench.time_ms`), best of ROUNDS. The tables are looked up as the runner does; a Triton
version with no table of its own falls back to the newest other version's (configs.py), so
both versions run the same configs. A driver (scripts/gpu_triton_versions.sh) alternates the
versions in separate processes, since one process can import only one Triton.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from moekit.bench import time_ms
from moekit.runners.triton import ops

sys.path.insert(0, str(Path(__file__).parent))
from gpu_triton_quant import spec_points
from probe_out import write_probe

ROUNDS = int(os.environ.get("VERSIONS_ROUNDS", "3"))
DEFAULT = (
    "qwen3-30b-a3b:bf16:1,256,1024,4096,16384;mixtral-8x7b:bf16:256,1024,4096,16384;"
    "deepseek-v3:bf16:1,1024,4096,16384;gpt-oss-120b:bf16:1,4096,16384;"
    "qwen3-30b-a3b:fp8-block:4096;deepseek-v3:fp8-block:4096;qwen3-30b-a3b:mxfp4:1,16"
)


def main() -> None:
    label = sys.argv[1]
    spec = sys.argv[sys.argv.index("--points") + 1] if "--points" in sys.argv else DEFAULT
    dev = torch.device("cuda")
    out = {"label": label, "rounds": ROUNDS, "points": []}
    for model, fmt, shape, w, T, x, topks in spec_points(spec, dev):
        K, R = shape.top_k, len(topks)
        cfgs = ops.configs_for(T, K, w, torch.bfloat16, dev)

        def call(w=w, x=x, topks=topks, act=shape.act, cfgs=cfgs):
            for t in topks:
                ops.fused_moe(x, t, w, act, configs=cfgs)

        try:
            times = [time_ms(call, dev, warmup=3, samples=10) / R * 1e3 for _ in range(ROUNDS)]
            rec = {"us": round(min(times), 2), "all": [round(t, 2) for t in times]}
        except Exception as exc:  # noqa: BLE001 - a compile failure under one version is a result
            rec = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rec.update(model=model, format=fmt, T=T, R=R, configs=[str(c) for c in cfgs])
        out["points"].append(rec)
        print(f"{label} {model:14} {fmt:9} T={T:5}  {rec.get('us', rec.get('error'))}",
              flush=True)  # fmt: skip
    write_probe(f"versions_{label}.json", out)


if __name__ == "__main__":
    main()
