"""The result file of a GPU probe script: one JSON object under $OUT, with the device, the
torch and Triton versions and the commit ($MOEKIT_GIT_COMMIT) in front of what the probe
measured."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def write_probe(name: str, payload: dict) -> Path:
    """Write {device, torch, triton, commit, **payload} to $OUT/name (default ./name), print
    and return its path. Keys of `payload` win over the header's."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    head = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": os.environ.get("MOEKIT_GIT_COMMIT", "?"),
    }
    path = Path(os.environ.get("OUT", ".")) / name
    path.write_text(json.dumps({**head, **payload}, indent=1) + "\n")
    print("wrote", path)
    return path


def target_row(what: str, value: float | None, op: str, bound: float) -> dict:
    """One row of an issue-target table as BENCHMARKS.md shows it (`moekit.report`): what was
    measured, its value (None: not measured), the target ('>= 2.5') and whether it is met."""
    met = value is not None and (value >= bound if op == ">=" else value <= bound)
    return {"what": what, "value": None if value is None else round(value, 3),
            "target": f"{op} {bound}", "met": met}  # fmt: skip


def layout_label(model: str, tp: int, ep: int) -> str:
    """'deepseek-v3 TP8 EP8', 'qwen3-30b-a3b': a preset and its parallel layout, in rows."""
    return model + "".join(f" {k}{n}" for k, n in (("TP", tp), ("EP", ep)) if n > 1)


def option(name: str, default: str) -> str:
    """The value after `name` on the command line, else `default` (the probes' flags)."""
    import sys

    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


def triton_layer_points(jobs: list[list[str]], batches: list[int], seed: int = 0,
                        backend: str = "triton"):  # fmt: skip
    """For each job (preset, tp, ep, weight format) and batch size T: (label, T, module, sets), the
    layer of `moekit bench`'s sweep on the runner `backend` and its input sets for T (routings
    drawn from `seed`, batch sizes in order, as the bench draws them); label
    'preset tpN epM format T=T'. A job's layer is released before the next one is built."""
    from moekit.config import RunnerConfig
    from moekit.layer import RunnerCache
    from moekit.select_tune import sweep_spec
    from moekit.bench import l2_cache_bytes
    from moekit.sweep import _input_sets, build_layer

    for model, tp, ep, fmt in jobs:
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=fmt,
                          batch_sizes=tuple(batches), backends=(backend,))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig(backend))
        gen = torch.Generator().manual_seed(seed)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))
            yield f"{model} tp{tp} ep{ep} {fmt} T={T}", T, module, sets
        del module
        torch.cuda.empty_cache()


def config_edits(spec: str) -> tuple[str, dict]:
    """'base+field=value+...' -> (base, {field: value}): a probe's variant of a config, for
    `dataclasses.replace(config, **edits)` (values of digits as int)."""
    base, *edits = spec.split("+")
    pairs = (e.split("=", 1) for e in edits)
    return base, {k: int(v) if v.lstrip("-").isdigit() else v for k, v in pairs}


def profiled_call(fn, index: int) -> None:
    """fn() twice unprofiled (compile, warm), then once between cudaProfilerStart / Stop (for
    `ncu --profile-from-start off`), after a fill kernel of index + 1 elements that marks in the
    report where this call's kernels start."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.zeros(index + 1, device="cuda")
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
