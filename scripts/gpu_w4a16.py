"""The `w4a16` runner against the `triton` runner on the same 4-bit weights and against bf16
`triton`, on one GPU: the issue's 4-bit targets at decode sizes.

    PYTHONPATH=src python3 scripts/gpu_w4a16.py [--jobs "qwen3-30b-a3b;deepseek-v3 --tp-size 8
        --ep-size 8"] [--formats int4_w4a16,mxfp4,nvfp4] [--batches 1,4,16] [--backends ...]

Per job: one `moekit.sweep.run_sweep` in bf16 (`triton`) and one per 4-bit format (`--backends`,
default triton, w4a16 and auto), with the ceilings measured once, each saved like a `moekit
bench` result under $OUT/results. Prints, per format and T: bf16 triton / w4a16 (target >= 2.5),
w4a16 time / its own floor (packed weights + scales; target <= 1.3) and triton / w4a16; the
ratios go to $OUT/w4a16_summary.json, with the two targets as a table for BENCHMARKS.md
(`moekit.report.render_script_md`, once the file is in benchmarks/results/).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from moekit import hardware
from moekit.bench import ceilings_for_format
from moekit.config import ParallelConfig
from moekit.presets import preset
from moekit.report import metadata, result_dict, save
from moekit.sweep import SweepSpec, run_sweep

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_out import layout_label, target_row, write_probe  # noqa: E402

JOBS = "qwen3-30b-a3b;gpt-oss-120b;deepseek-v3 --tp-size 8 --ep-size 8;mixtral-8x7b --tp-size 2"


def parse_job(text: str) -> tuple[str, ParallelConfig]:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    a = p.parse_args(shlex.split(text))
    return a.model, ParallelConfig(tp_size=a.tp_size, ep_size=a.ep_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default=JOBS)
    ap.add_argument("--formats", default="int4_w4a16,mxfp4,nvfp4")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--backends", default="triton,w4a16,auto")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    plat = hardware.detect()
    batches = tuple(int(b) for b in args.batches.split(","))
    ceilings = ceilings_for_format("cuda", torch.bfloat16, "unquantized")
    summary = []
    for job in args.jobs.split(";"):
        model, parallel = parse_job(job)
        times: dict[tuple[str, str, int], tuple[float | None, float | None]] = {}
        for fmt in ("unquantized", *args.formats.split(",")):
            t0 = time.perf_counter()
            backends = ("triton",) if fmt == "unquantized" else tuple(args.backends.split(","))
            spec = SweepSpec(preset=model, moe=preset(model, weight_format=fmt),
                             parallel=parallel, batch_sizes=batches, backends=backends,
                             device="cuda")  # fmt: skip
            try:
                result = run_sweep(spec, platform=plat, ceilings=ceilings)
            except Exception as err:
                print(f"{job} {fmt}: FAILED {type(err).__name__}: {err}", flush=True)
                continue
            command = f"python3 scripts/gpu_w4a16.py --jobs {shlex.quote(job)} ({fmt})"
            save(result_dict(result, metadata(plat=plat, command=command)), out / "results",
                 plot=False)  # fmt: skip
            for r in result.records:
                times[(fmt, r.backend, r.T)] = (r.ms, r.time_over_floor)
                if r.error or r.suspicious:
                    print(f"{model} {fmt} {r.backend} T={r.T}: error={r.error} "
                          f"rel_err={r.rel_err}", flush=True)  # fmt: skip
            print(f"{job} {fmt}: {time.perf_counter() - t0:.0f}s; skipped {result.skipped}",
                  flush=True)  # fmt: skip
        for fmt in args.formats.split(","):
            for T in batches:
                bf16 = times.get(("unquantized", "triton", T), (None, None))[0]
                tri = times.get((fmt, "triton", T), (None, None))[0]
                w4, w4_floor = times.get((fmt, "w4a16", T), (None, None))
                auto = times.get((fmt, "auto", T), (None, None))[0]
                row = {"job": job, "format": fmt, "T": T, "bf16_triton_ms": bf16,
                       "triton_ms": tri, "w4a16_ms": w4, "auto_ms": auto,
                       "w4a16_over_floor": w4_floor,
                       "bf16_over_w4a16": bf16 / w4 if bf16 and w4 else None,
                       "triton_over_w4a16": tri / w4 if tri and w4 else None}  # fmt: skip
                summary.append(row)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)  # fmt: skip
    write_probe("w4a16_summary.json", {
        "script": "scripts/gpu_w4a16.py",
        "title": "4-bit `w4a16` against bf16 `triton` and its own floor (issue 4, T <= 16)",
        "targets": TARGETS, "summary": target_rows(summary), "points": summary,
        "argv": sys.argv[1:]})  # fmt: skip
    return 0


TARGETS = {"w4_small": 2.5, "w4_floor": 1.3}  # bf16 triton / w4a16; w4a16 time / own floor


def target_rows(points: list[dict]) -> list[dict]:
    """Issue 4's two 4-bit targets for each point whose 4-bit sweep ran (a format that cannot
    exist for a shape, as gpt-oss's int4 groups of 128, has no rows; a failed backend has
    rows with no value)."""
    rows = []
    for p in points:
        if p["triton_ms"] is None and p["w4a16_ms"] is None and p["auto_ms"] is None:
            continue
        model, parallel = parse_job(p["job"])
        what = f"{p['format']} {layout_label(model, parallel.tp_size, parallel.ep_size)} T={p['T']}"
        rows += [target_row(f"{what} bf16 triton / w4a16", p["bf16_over_w4a16"], ">=",
                            TARGETS["w4_small"]),
                 target_row(f"{what} w4a16 time / own floor", p["w4a16_over_floor"], "<=",
                            TARGETS["w4_floor"])]  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
