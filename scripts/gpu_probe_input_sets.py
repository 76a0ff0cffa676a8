"""How a sweep point's time depends on its input sets: one routing against several.

    PYTHONPATH=src python3 scripts/gpu_probe_input_sets.py [--jobs "gpt-oss-120b 1 1 mxfp4 w4a16;
        deepseek-v3 8 8 fp8_w8a8 triton"] [--batches 4,16] [--out NAME]   # $OUT/NAME.json

For each job (preset, tp, ep, weight format, runner) and batch size: the layer of `moekit
bench`'s sweep over the bench's input sets for T (at least 8 routings up to T = 256), timed in
turns (`time_ms_interleaved`, CUDA-graph replay) as
  distinct  every set, one forward each, in one graph (what the bench times);
  same      set 0 as many times, in one graph (as many forwards, one routing);
  one       set 0 alone (what the bench timed at T >= 4 while one set's bytes exceeded 4 L2s);
  set k     set k alone;
in us per forward, with each set's bytes (`point_cost`). same ~ distinct < one says the number
of forwards in a graph moves the time; distinct apart from same ~ one says the routing does.
"""

from __future__ import annotations

import sys

import torch

from moekit.bench import time_ms_interleaved
from moekit.config import ConfigError
from moekit.sweep import layer_over_sets, point_cost

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_out import option, triton_layer_points, write_probe  # noqa: E402

JOBS = ("gpt-oss-120b 1 1 mxfp4 w4a16;deepseek-v3 8 8 fp8_w8a8 triton;"
        "deepseek-v3 8 8 unquantized triton;qwen3-30b-a3b 1 1 unquantized triton")  # fmt: skip


def main() -> None:
    batches = [int(t) for t in option("--batches", "4,16").split(",")]
    points = []
    for job in option("--jobs", JOBS).split(";"):
        model, tp, ep, fmt, backend = job.split()
        for label, T, module, sets in triton_layer_points([[model, tp, ep, fmt]], batches,
                                                          backend=backend):  # fmt: skip
            n = len(sets)
            fns = {"distinct": layer_over_sets(module, sets),
                   "same": layer_over_sets(module, [sets[0]] * n),
                   "one": layer_over_sets(module, sets[:1])}  # fmt: skip
            fns.update({f"set {k}": layer_over_sets(module, [s]) for k, s in enumerate(sets)})
            forwards = {"distinct": n, "same": n, "one": 1} | {f"set {k}": 1 for k in range(n)}
            try:
                for fn in fns.values():
                    fn()  # compile, select
            except ConfigError as err:  # e.g. w4a16 past its pair limit
                print(f"{label} {backend}: skipped ({err})", flush=True)
                continue
            ms = time_ms_interleaved(fns, "cuda")
            us = {k: ms[k] * 1e3 / forwards[k] for k in fns}
            mb = [point_cost(module, *s)[0].bytes / 1e6 for s in sets]
            rec = {"label": f"{label} {backend}", "T": T, "sets": n, "us_per_forward": us,
                   "set_mb": mb, "mean_mb": sum(mb) / n}  # fmt: skip
            points.append(rec)
            each = " ".join(f"{us[f'set {k}']:.1f}/{mb[k]:.0f}" for k in range(n))
            print(f"{rec['label']}: distinct {us['distinct']:.1f} same {us['same']:.1f} one "
                  f"{us['one']:.1f} us (mean {rec['mean_mb']:.0f} MB); sets us/MB: {each}",
                  flush=True)  # fmt: skip
            del fns
            torch.cuda.empty_cache()
    write_probe(option("--out", "input_sets") + ".json", {"points": points, "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
