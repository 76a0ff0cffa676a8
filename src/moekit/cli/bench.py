"""`moekit bench`: time the MoE layer over a batch-size sweep for each available runner backend.

Prints a table per backend (ms, TFLOP/s, GB/s, time over the roofline floor) and the winner per
batch size, writes a JSON record and a PNG plot, and regenerates BENCHMARKS.md when the results
go to the repository's benchmarks/results/. See moekit.sweep for what is timed and how.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moekit import hardware
from moekit.config import RUNNER_BACKENDS, ConfigError, ParallelConfig, check_choice, validate
from moekit.presets import PRESETS, QUANTIZATION_DEFAULT, model_and_format
from moekit.report import RESULTS_DIR, metadata, repo_root, result_dict, save, update_benchmarks_md
from moekit.sweep import (
    CPU_BATCH_SIZES,
    CPU_SHAPE,
    GPU_BATCH_SIZES,
    ROUTINGS,
    TIMED,
    SweepResult,
    SweepSpec,
    all_backends,
    cpu_scaled,
    run_sweep,
    winners,
)

DEFAULT_MODEL = "qwen3-30b-a3b"
CPU_TIME_BUDGET_S = 45.0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="time the MoE layer over batch sizes for each available backend",
        description="Time the MoE layer (routing precomputed) over a batch-size sweep for each "
        "available runner backend; print tables, write JSON + PNG into --out-dir. With no "
        f"arguments: {DEFAULT_MODEL}, every available backend, batch sizes "
        f"{','.join(map(str, GPU_BATCH_SIZES))} on a GPU; on a CPU a scaled-down shape and "
        f"batch sizes {','.join(map(str, CPU_BATCH_SIZES))}.",
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"preset ({', '.join(PRESETS)}) or a "
                   "Hugging Face config.json (file or directory)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (rank 0 is timed)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size")
    p.add_argument("--batch-sizes", help="comma-separated token counts T (default: see above)")
    p.add_argument(
        "--backends",
        help="comma-separated runner backends, or 'all' (default: every available one); "
        f"known: {', '.join(RUNNER_BACKENDS)}",
    )
    p.add_argument("--moe-runner-backend", help="one backend (alias of --backends NAME)")
    p.add_argument(
        "--dtype", default="bfloat16", help="activation dtype: bfloat16, float16, float32"
    )
    p.add_argument("--routing", default="uniform", help=f"synthetic routing: {', '.join(ROUTINGS)}")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent for --routing zipf")
    p.add_argument("--quantization", help="weight format: a name, or NAME:key=value,... with "
                   "its parameters (e.g. fp8_w8a8:weight_scale=tensor,activation_scheme="
                   f"static_tensor); {QUANTIZATION_DEFAULT}")
    p.add_argument("--out-dir", help="where the JSON and PNG go (default: benchmarks/results)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
    p.add_argument("--device", default="auto", help="auto (GPU if there is one), cuda or cpu")
    p.add_argument(
        "--full-size",
        action="store_true",
        help="on a CPU, run the preset's real shape instead of the scaled-down one",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        help="seconds; points that would end later are skipped (default: "
        f"{CPU_TIME_BUDGET_S:.0f} on a CPU scale-down, none otherwise)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing and inputs")
    p.add_argument(
        "--regenerate-md",
        action="store_true",
        help="only regenerate BENCHMARKS.md from benchmarks/results/ (e.g. after copying in "
        "results from a GPU machine); runs nothing",
    )
    p.set_defaults(func=run)
    return p


def parse_batch_sizes(text: str, minimum: int = 0) -> tuple[int, ...]:
    """--batch-sizes "1,4,16" -> (1, 4, 16), duplicates dropped; ConfigError unless every value
    is an integer >= minimum (0: an empty batch)."""
    try:
        sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(t < minimum for t in sizes):
        raise ConfigError(
            f"--batch-sizes: expected comma-separated integers >= {minimum} (e.g. 1,4,16), "
            f"got {text!r}"
        )
    return tuple(dict.fromkeys(sizes))


def parse_backends(args) -> tuple[tuple[str, ...], bool]:
    """(backend names, whether they were asked for explicitly)."""
    if args.moe_runner_backend and args.backends:
        raise ConfigError("give either --backends or --moe-runner-backend, not both")
    text = args.backends or args.moe_runner_backend
    if not text:
        return all_backends(), False
    names = [t.strip() for t in text.split(",") if t.strip()]
    option = "backends" if args.backends else "moe_runner_backend"
    if not names:
        raise ConfigError(f"--{option.replace('_', '-')}: empty list")
    out: list[str] = []
    for n in names:
        if n == "all":
            out.extend(all_backends())
            continue
        check_choice(option, n, set(RUNNER_BACKENDS) | ({"all"} if option == "backends" else set()))
        out.append(n)
    return tuple(dict.fromkeys(out)), True


def spec_from_args(args, plat: hardware.Platform) -> SweepSpec:
    """The sweep the arguments ask for; ConfigError (naming the option) when they cannot work."""
    check_choice("device", args.device, {"auto", "cuda", "cpu"})
    device = plat.device if args.device == "auto" else args.device
    if device == "cuda" and not plat.is_cuda:
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch here")
    moe, weight_spec = model_and_format(args.model, args.quantization, dtype=args.dtype)
    parallel = ParallelConfig(tp_size=args.tp_size, ep_size=args.ep_size)
    validate(moe, parallel)
    scaled = device == "cpu" and not args.full_size
    if scaled:
        moe = cpu_scaled(moe, parallel)
        validate(moe, parallel)
    if args.batch_sizes:
        sizes = parse_batch_sizes(args.batch_sizes)
    else:
        sizes = GPU_BATCH_SIZES if device == "cuda" else CPU_BATCH_SIZES
    budget = args.time_budget
    if budget is None and scaled:
        budget = CPU_TIME_BUDGET_S
    if budget is not None and budget <= 0:
        raise ConfigError(f"--time-budget must be > 0 seconds, got {budget}")
    backends, _ = parse_backends(args)
    return SweepSpec(
        preset=args.model,
        moe=moe,
        parallel=parallel,
        batch_sizes=sizes,
        backends=backends,
        device=device,
        routing=args.routing,
        zipf_s=args.zipf_s,
        scaled_down=scaled,
        seed=args.seed,
        time_budget_s=budget,
        weight_spec=weight_spec,
    )


def _fmt(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


def print_header(console, spec: SweepSpec, plat: hardware.Platform) -> None:
    m, par = spec.moe, spec.parallel
    dev = plat.device_name if spec.device == "cuda" else "cpu"
    console.print(f"[bold]moekit bench[/bold] on {spec.device}: {dev}")
    if spec.scaled_down:
        console.print(
            f"[bold yellow]No GPU: running a SCALED-DOWN version of {spec.preset} on the CPU "
            f"(H={CPU_SHAPE['hidden_size']}, I={m.intermediate_size}, E={m.num_experts}, "
            f"K={m.top_k}); the numbers say nothing about the real model's speed. "
            "Use --full-size for the real shape.[/bold yellow]"
        )
    console.print(
        f"preset {spec.preset}: E={m.num_experts} (E_local={spec.e_local} on rank 0), K={m.top_k}, "
        f"H={m.hidden_size}, I={m.intermediate_size} (I_local={spec.i_local}), {m.activation}"
        f"{' + biases' if m.has_bias else ''}, {m.dtype}, {spec.quantization} weights; "
        f"tp {par.tp_size} ep {par.ep_size}; {spec.routing} routing"
        + (f" (s={spec.zipf_s:g})" if spec.routing == "zipf" else "")
    )
    console.print(f"timed: {TIMED}")
    console.print(f"batch sizes: {', '.join(map(str, spec.batch_sizes))}")


def print_tables(console, result: SweepResult) -> None:
    from rich.table import Table

    c = result.ceilings
    console.print(
        f"ceilings ({c.dtype}, measured now): copy {c.copy_bytes_per_s / 1e9:.1f} GB/s, "
        f"matmul {c.matmul_flops_per_s / 1e12:.2f} TFLOP/s"
    )
    backends = list(dict.fromkeys(r.backend for r in result.records))
    for b in backends:
        t = Table(title=f"backend {b}", title_justify="left")
        cols = ("T", "ms", "TFLOP/s", "GB/s", "floor ms", "time/floor", "rel err vs torch", "graph")
        for col in cols:
            t.add_column(col, justify="right")
        if b == "auto":
            t.add_column("ran", justify="left")
        for r in (r for r in result.records if r.backend == b):
            if r.ms is None:
                row = [str(r.T), f"[red]{r.error}[/red]", "", "", "", "", "", ""]
            else:
                err = "(reference)" if b == "torch" else _fmt(r.rel_err, ".1e")
                if r.suspicious:
                    err = f"[red]{err} ![/red]"
                row = [str(r.T), _fmt(r.ms, ".4g"), _fmt(r.tflops), _fmt(r.gbps, ".4g"),
                       _fmt(r.floor_ms, ".4g"), _fmt(r.time_over_floor, ".2f"), err,
                       "yes" if r.cuda_graph else "no"]
            if b == "auto":
                row.append(r.chosen or "")
            t.add_row(*row)
        console.print(t)
    best = winners(result.records)
    by = {(r.backend, r.T): r for r in result.records}
    t = Table(title="winner per T", title_justify="left")
    for col in ("T", "winner", "ms", "time/floor", "auto picks", "auto's pick time/floor"):
        t.add_column(col, justify="right")
    for T in result.spec.batch_sizes:
        w = best.get(T)
        pick = result.auto_choice.get(T, "")
        picked = by.get((pick, T))
        pick_ratio = _fmt(picked.time_over_floor, ".2f") if picked and picked.ms else "-"
        if pick.startswith("error"):
            pick = "(none)"
        if w is None:
            t.add_row(str(T), "[red]none[/red]", "-", "-", pick, pick_ratio)
        else:
            t.add_row(str(T), w.backend, _fmt(w.ms, ".4g"), _fmt(w.time_over_floor, ".2f"), pick,
                      pick_ratio)
    console.print(t)
    for r in result.records:
        if r.suspicious:
            console.print(
                f"[red]warning: {r.backend} at T={r.T} differs from the torch reference "
                f"(rel err {r.rel_err:.2e})[/red]"
            )
    for note in result.notes:
        console.print(f"[yellow]{note}[/yellow]")


def _report_skipped(console, skipped: dict[str, str], explicit: bool) -> None:
    for b, why in skipped.items():
        style = "yellow" if explicit or b in ("torch", "auto") else "dim"
        console.print(f"[{style}]skipping {b}: {why}[/{style}]", highlight=False)


def _sweep_with_progress(console, spec: SweepSpec, explicit: bool) -> SweepResult:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    n_points = len(spec.batch_sizes)
    if not console.is_terminal:
        # Logs (CI, the GPU box): one line per point instead of a live bar.
        state = {"done": 0, "total": 0}

        def on_start(run, skipped):
            _report_skipped(console, skipped, explicit)
            state["total"] = len(run) * n_points
            if run:
                console.print(f"timing: {', '.join(run)}; measuring the ceilings first ...")

        def on_point(backend, T, rec):
            if rec is None:
                return
            state["done"] += 1
            what = (f"{rec.ms:.4g} ms, {_fmt(rec.time_over_floor, '.2f')} x floor"
                    if rec.ms is not None else rec.error)
            console.print(f"  [{state['done']}/{state['total']}] {backend:>18} T={T:<6} {what}",
                          highlight=False)

        return run_sweep(spec, on_start=on_start, on_point=on_point)

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("building the layer", total=None)

        def on_start(run, skipped):
            _report_skipped(console, skipped, explicit)
            if run:
                console.print(f"timing: {', '.join(run)}")
            progress.update(task, total=len(run) * n_points, description="measuring ceilings")

        def on_point(backend, T, rec):
            if rec is None:
                progress.update(task, description=f"{backend} T={T}")
            else:
                progress.advance(task)

        return run_sweep(spec, on_start=on_start, on_point=on_point)


def _out_dir(args) -> Path:
    if args.out_dir:
        return Path(args.out_dir)
    root = repo_root()
    return (root / RESULTS_DIR) if root is not None else Path(RESULTS_DIR)


def run(args) -> int:
    from rich.console import Console

    if args.regenerate_md:
        root = repo_root()
        if root is None:
            raise ConfigError("--regenerate-md needs a source checkout of moekit (none found)")
        print(f"updated {update_benchmarks_md(root)}")
        return 0

    # Wide enough for the tables when the output goes to a log rather than a terminal.
    console = Console(width=None if sys.stdout.isatty() else 130)
    plat = hardware.detect()
    spec = spec_from_args(args, plat)
    _, explicit = parse_backends(args)
    print_header(console, spec, plat)
    result = _sweep_with_progress(console, spec, explicit)
    if not result.records:
        print(
            "moekit bench: error: none of the requested backends can run this workload here "
            "(reasons above)",
            file=sys.stderr,
        )
        return 2
    print_tables(console, result)

    doc = result_dict(result, metadata(plat=plat))
    out = _out_dir(args)
    json_path, png_path = save(doc, out, plot=not args.no_plot)
    console.print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""), highlight=False)
    root = repo_root()
    if root is not None and out.resolve() == (root / RESULTS_DIR).resolve():
        md = update_benchmarks_md(root)
        console.print(f"updated {md}", highlight=False)
    console.print(f"done in {result.seconds:.1f} s", highlight=False)
    ok = any(r.ms is not None for r in result.records)
    return 0 if ok else 1
