"""`moekit tune --select`: time every runner backend over the batch-size sweep on this device and
write the selection table that `auto` ranks backends by (`moekit.select_table`). With
`--skewed`, the sweep runs a second time on Zipf-skewed routing, whose times go into the table
beside the uniform ones (`Point.skewed_ms`).

The measurement is the bench sweep (`moekit.sweep.run_sweep`: `MoE.forward_topk` with CUDA-graph
replay where the runner is graph safe, inputs rotated past L2, each backend's output checked
against the reference runner). A backend enters the table at a batch size only with a time and a
result within the sweep's error bound: a fast wrong backend must never be selected.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from moekit import hardware, select_table
from moekit.config import ConfigError, ParallelConfig, validate
from moekit.presets import model_and_format
from moekit.select import workload_for
from moekit.select_table import Point, SelectionTable, TableKey
from moekit.sweep import (
    CPU_BATCH_SIZES,
    GPU_BATCH_SIZES,
    Record,
    SweepResult,
    SweepSpec,
    all_backends,
    cpu_scaled,
    run_sweep,
)


@dataclass
class SelectTuneReport:
    """table: what was written (None when nothing could be measured); path: its file;
    excluded: backend -> why it is missing from some or all points; result: the uniform sweep,
    skewed_result: the skewed one (None without it)."""

    table: SelectionTable | None
    path: Path | None
    excluded: dict[str, str]
    result: SweepResult
    skewed_result: SweepResult | None = None


def sweep_spec(
    model: str,
    *,
    tp_size: int = 1,
    ep_size: int = 1,
    dtype: str = "bfloat16",
    quantization: str | None = None,
    batch_sizes: tuple[int, ...] | None = None,
    device: str | None = None,
    routing: str = "uniform",
    backends: tuple[str, ...] | None = None,
    time_budget_s: float | None = None,
) -> SweepSpec:
    """The sweep of `moekit tune --select` for a preset: every concrete backend (not 'auto'),
    GPU batch sizes; on a CPU the preset is scaled down (tests)."""
    plat = hardware.detect()
    device = device or plat.device
    moe, weight_spec = model_and_format(model, quantization, dtype=dtype)
    parallel = ParallelConfig(tp_size=tp_size, ep_size=ep_size)
    validate(moe, parallel)
    scaled = device == "cpu"
    if scaled:
        moe = cpu_scaled(moe, parallel)
    sizes = batch_sizes or (GPU_BATCH_SIZES if device == "cuda" else CPU_BATCH_SIZES)
    return SweepSpec(
        preset=model,
        moe=moe,
        parallel=parallel,
        batch_sizes=tuple(sizes),
        backends=tuple(b for b in (backends or all_backends()) if b != "auto"),
        device=device,
        routing=routing,
        scaled_down=scaled,
        time_budget_s=time_budget_s,
        weight_spec=weight_spec,
    )


def table_key(spec: SweepSpec, platform: hardware.Platform) -> TableKey:
    """The table key of the sweep's layer (rank 0): the key the layer's workloads look up."""
    work = workload_for(spec.moe, 1, parallel=spec.parallel, device=spec.device,
                        weight_spec=spec.weight_spec)  # fmt: skip
    key = select_table.key_of(work, platform)
    assert key is not None
    return key


def points_from_records(records: list[Record]) -> tuple[list[Point], dict[str, str]]:
    """Measured points (backends with a time and a correct result) and why others are out."""
    by_t: dict[int, dict[str, float]] = {}
    excluded: dict[str, str] = {}
    for r in records:
        if r.backend == "auto":
            continue
        if r.error is not None or r.ms is None:
            excluded.setdefault(r.backend, f"T={r.T}: {r.error or 'no time'}")
            continue
        if r.suspicious:
            excluded.setdefault(r.backend, f"T={r.T}: wrong result, rel_err {r.rel_err:.3g}")
            continue
        by_t.setdefault(r.T, {})[r.backend] = float(r.ms)
    points = [Point(t, ms) for t, ms in sorted(by_t.items()) if ms]
    return points, excluded


def with_skewed(points: Sequence[Point], skewed: Sequence[Point]) -> tuple[Point, ...]:
    """`points` (uniform routing) with the times of `skewed` at the same batch sizes as their
    `skewed_ms` (none where `skewed` has no point of that size)."""
    by_t = {p.num_tokens: p.ms for p in skewed}
    return tuple(replace(p, skewed_ms=by_t.get(p.num_tokens, {})) for p in points)


def tune_select(
    spec: SweepSpec,
    *,
    out_dir: str | Path | None = None,
    platform: hardware.Platform | None = None,
    on_start: Callable[[list[str], dict[str, str]], None] | None = None,
    on_point: Callable[[str, int, Record | None], None] | None = None,
    skewed_zipf_s: float | None = None,
) -> SelectTuneReport:
    """Run the sweep of `spec` (on uniform routing) and write its selection table into `out_dir`
    (default: the user config dir, $MOEKIT_CONFIG_DIR/select). `skewed_zipf_s`: also run it on
    Zipf routing of that exponent and record those times as the points' `skewed_ms`."""
    if spec.routing != "uniform":
        raise ConfigError(f"moekit tune --select: the table's times are on uniform routing, got "
                          f"routing {spec.routing!r}; skewed times: --skewed")  # fmt: skip
    platform = platform or hardware.detect()
    spec = replace(spec, backends=tuple(b for b in spec.backends if b != "auto"))
    result = run_sweep(spec, platform=platform, on_start=on_start, on_point=on_point)
    points, excluded = points_from_records(result.records)
    excluded.update(result.skipped)
    skewed = None
    if skewed_zipf_s is not None and points:
        skewed = run_sweep(replace(spec, routing="zipf", zipf_s=skewed_zipf_s),
                           platform=platform, ceilings=result.ceilings, on_start=on_start,
                           on_point=on_point)  # fmt: skip
        skewed_points, skewed_excluded = points_from_records(skewed.records)
        for b, why in {**skewed_excluded, **skewed.skipped}.items():
            excluded.setdefault(b, f"on skewed routing: {why}")
        points = list(with_skewed(points, skewed_points))
    if not points:
        return SelectTuneReport(None, None, excluded, result)
    from moekit.report import git_commit

    commit, dirty = git_commit()
    table = SelectionTable(
        key=table_key(spec, platform),
        libraries=select_table.library_versions(platform),
        points=tuple(points),
        meta={
            "preset": spec.preset,
            "tp_size": spec.parallel.tp_size,
            "ep_size": spec.parallel.ep_size,
            "local_share": 1.0 / spec.parallel.ep_size,
            "capability": list(platform.capability) if platform.capability else None,
            "routing": spec.routing,
            **({"skewed_routing": f"zipf s={skewed_zipf_s:g}"} if skewed else {}),
            "scaled_down": spec.scaled_down,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit,
            "dirty": dirty,
            "excluded": excluded,
            "command": "moekit tune --select" + (" --skewed" if skewed else ""),
        },
    )
    return SelectTuneReport(table, select_table.save(table, out_dir), excluded, result, skewed)


def run_cli(args, sizes: tuple[int, ...]) -> int:
    """`moekit tune --select` (called by moekit.cli.tune): args model, tp_size, ep_size, dtype,
    out_dir, no_progress, skewed, zipf_s, and optionally quantization; sizes: the batch
    sizes."""
    spec = sweep_spec(
        args.model,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        dtype=args.dtype,
        quantization=getattr(args, "quantization", None),
        batch_sizes=sizes,
    )

    skewed_zipf_s = args.zipf_s if args.skewed else None
    phases = iter(["uniform routing", f"zipf s={args.zipf_s:g} routing"])

    def on_start(backends: list[str], skipped: dict[str, str]) -> None:
        if not args.no_progress:
            print(f"{next(phases, '')}: {', '.join(backends)}", flush=True)

    def on_point(backend: str, T: int, rec: Record | None) -> None:
        if rec is not None and not args.no_progress:
            what = f"{rec.ms:.4f} ms" if rec.ms is not None else f"- ({rec.error})"
            print(f"  T={T:>6} {backend:<20} {what}", flush=True)

    report = tune_select(spec, out_dir=args.out_dir, on_start=on_start, on_point=on_point,
                         skewed_zipf_s=skewed_zipf_s)  # fmt: skip
    for backend, why in sorted(report.excluded.items()):
        print(f"not in the table: {backend}: {why}")
    if report.table is None:
        print("moekit tune --select: no backend could be measured", file=sys.stderr)
        return 1
    crossings = ", ".join(f"T>={t}: {b}" for t, b in report.table.crossovers())
    served = ", ".join(f"{lo}-{hi}" for lo, hi in report.table.served())
    print(f"auto picks: {crossings} (this table ranks batch sizes T = {served}, within "
          f"{select_table.POINT_REACH:g}x of a measured one; others borrow the nearest measured "
          "shape's point or the default order)")
    print(f"wrote {report.path}")
    return 0
