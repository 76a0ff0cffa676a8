"""Driver of scripts/gpu_backends.sh (run from the repo root with PYTHONPATH=src):

  python3 scripts/gpu_backends.py smoke   --work DIR
      DeepGEMM: import, version, M alignment, first (JIT) and second call times of its bf16 and
      fp8 grouped GEMMs, and their error against torch.
  python3 scripts/gpu_backends.py sweep   --work DIR --jobs "J1;J2" --batch-sizes 1,4,..
                                          --deadline EPOCH
      Per job ("qwen3-30b-a3b --tp-size 2 --quantization fp8_w8a8 ..."): time every backend over
      the batch sizes (moekit.select_tune: CUDA-graph replay, correctness vs the reference) and
      write the selection table into $MOEKIT_CONFIG_DIR/select; then time `auto` (which now reads
      that table) on the same inputs, in turns with the backends that won a point (their times
      in the results are from this second pass); save both as one bench JSON + PNG
      (moekit.report) in DIR/results and print `auto` against the fastest backend at each T.
  python3 scripts/gpu_backends.py explain --work DIR --jobs ... --batch-sizes ...
      What `auto` picks for each job and T, with the reason, and every backend's status.

Every step catches its own errors (printed with the traceback) so one failure does not lose the
others' results. Exit status: 0 if every job/step succeeded, 1 otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shlex
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

MIN_JOB_S = 45  # a job needs about this long (more when Triton / DeepGEMM compile first)


def parse_job(text: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="job", add_help=False)
    p.add_argument("model")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--quantization", default="unquantized")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--routing", default="uniform")
    words = shlex.split(text.replace("--model", ""))
    return p.parse_args(words)


def jobs_of(text: str) -> list[tuple[str, argparse.Namespace]]:
    return [(j.strip(), parse_job(j)) for j in text.split(";") if j.strip()]


def sizes_of(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s.strip())


def gmean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


# ---------------------------------------------------------------------------- smoke


def smoke(work: Path) -> bool:
    """DeepGEMM's kernels on this GPU, built and launched by moekit (`deep_gemm_jit`): the four
    grouped GEMMs (bf16 / fp8 x contiguous / masked) against torch, with build time, then the
    timing of each (CUDA events, 20 calls) in TFLOP/s."""
    from moekit.quant.act_quant import quantize_act
    from moekit.quant.quantize import dequantize, quantize
    from moekit.runners import deep_gemm_jit as jit

    print(f"deep_gemm headers: {jit.include_dir()}; nvcc: {jit.nvcc()}; problem: {jit.problem()}")
    if jit.problem() or not torch.cuda.is_available():
        return False
    from concurrent.futures import ThreadPoolExecutor

    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    problems = ((4, 1536, 2048, 128), (32, 4096, 7168, 512))
    t0 = time.perf_counter()
    cfgs = [jit.choose(fp8, masked, N, K, E, per, sms) for E, N, K, per in problems
            for fp8 in (False, True) for masked in (False, True)]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(jit.library, cfgs))
    print(f"built {len(cfgs)} kernels in parallel in {time.perf_counter() - t0:.1f} s")
    ok = True
    for E, N, K, per in problems:
        M = E * per
        a = torch.randn(M, K, device=dev).to(torch.bfloat16)
        b = (torch.randn(E, N, K, device=dev) / K**0.5).to(torch.bfloat16)
        ends = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per  # end row per group
        q, s = quantize_act(a, "token_group", torch.float8_e4m3fn, group_size=128)
        qb = quantize(b, "fp8_w8a8")
        # fp8 is checked against the same math on its dequantized operands (exact up to the
        # bf16 output), bf16 against float32 matmuls
        a8 = (q.float().view(M, -1, 128) * s.unsqueeze(-1)).view(M, K)
        b8 = dequantize(qb).float()

        def grouped(x, w):
            return torch.cat([x[e * per:(e + 1) * per].float() @ w[e].float().T
                              for e in range(E)])  # fmt: skip

        refs = {False: grouped(a, b), True: grouped(a8, b8)}
        counts = torch.randint(0, per + 1, (E,), device=dev, dtype=torch.int32)
        counts[0] = per
        for fp8 in (False, True):
            for masked in (False, True):
                name = f"{'fp8' if fp8 else 'bf16'} {'masked' if masked else 'contiguous'}"
                try:
                    cfg = jit.choose(fp8, masked, N, K, E, per, sms)
                    t0 = time.perf_counter()
                    jit.library(cfg)
                    built = time.perf_counter() - t0
                    d = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
                    lay = counts if masked else ends
                    if fp8:
                        groups = E if masked else 1
                        sfa = s.view(groups, -1, s.shape[-1]).transpose(1, 2).contiguous()
                        args = (cfg, q, qb.data.view(E * N, K), d, lay, per if masked else M,
                                sfa, qb.scale)
                    else:
                        args = (cfg, a, b.view(E * N, K), d, lay, per if masked else M)
                    jit.launch(*args)
                    torch.cuda.synchronize()
                    if masked:
                        valid = (torch.arange(per, device=dev).unsqueeze(0)
                                 < counts.unsqueeze(1)).reshape(-1)
                        got, want = d[valid].float(), refs[fp8][valid]
                    else:
                        got, want = d.float(), refs[fp8]
                    err = ((got - want).norm() / want.norm()).item()
                    start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    for _ in range(20):
                        jit.launch(*args)
                    stop.record()
                    torch.cuda.synchronize()
                    ms = start.elapsed_time(stop) / 20
                    rows = int(counts.sum()) if masked else M
                    print(f"{name} E={E} M={M} N={N} K={K} {cfg}: built in {built:.1f} s, "
                          f"{ms * 1e3:.1f} us, {2 * rows * N * K / ms / 1e9:.0f} TFLOP/s, "
                          f"rel err {err:.2e}", flush=True)
                    ok &= err < 1e-2
                except Exception:  # noqa: BLE001
                    ok = False
                    print(f"{name}: failed:")
                    traceback.print_exc(file=sys.stdout)
    return ok


# ---------------------------------------------------------------------------- sweep


def auto_summary(records, title: str) -> list[str]:
    """Lines: per T the fastest backend, what auto chose and auto / fastest; then the geometric
    means of auto and of the best single backend over the batch sizes where all were timed."""
    by_t: dict[int, dict[str, float]] = {}
    chosen: dict[int, str] = {}
    for r in records:
        if r.ms is None or r.suspicious:
            continue
        by_t.setdefault(r.T, {})[r.backend] = r.ms
        if r.backend == "auto":
            chosen[r.T] = r.chosen or "?"
    lines = [f"== {title}", f"{'T':>6}  {'fastest':<16} {'ms':>9}  {'auto chose':<16} "
             f"{'auto ms':>9}  auto/fastest"]
    ratios = []
    for T in sorted(by_t):
        ms = {b: v for b, v in by_t[T].items() if b != "auto"}
        if not ms:
            continue
        best = min(ms, key=ms.get)
        auto = by_t[T].get("auto")
        ratio = auto / ms[best] if auto else None
        if ratio:
            ratios.append(ratio)
        flag = "" if ratio is None or ratio <= 1.05 else "  > 5% slower"
        lines.append(
            f"{T:>6}  {best:<16} {ms[best]:9.4f}  {chosen.get(T, '-'):<16} "
            f"{auto if auto else float('nan'):9.4f}  "
            f"{'-' if ratio is None else f'{ratio:.3f}'}{flag}"
        )
    ts = [T for T in sorted(by_t) if "auto" in by_t[T]]
    singles = {}
    for b in {b for T in ts for b in by_t[T] if b != "auto"}:
        if all(b in by_t[T] for T in ts):
            singles[b] = gmean([by_t[T][b] for T in ts])
    if ts and singles:
        best_single = min(singles, key=singles.get)
        ga = gmean([by_t[T]["auto"] for T in ts])
        lines.append(
            f"geomean over T={','.join(map(str, ts))}: auto {ga:.4f} ms, best single backend "
            f"{best_single} {singles[best_single]:.4f} ms -> auto is "
            f"{(1 - ga / singles[best_single]) * 100:+.1f}% faster; auto within 5% of the fastest "
            f"at {sum(r <= 1.05 for r in ratios)}/{len(ratios)} points"
        )
    return lines


def job_result(text: str, records, report, bench_path) -> dict:
    """One job as plain data: per T every backend's ms and time/floor, the fastest, what auto
    chose and auto / fastest; the geometric means of auto and of each single backend over the
    batch sizes where all of them were timed."""
    points: dict[int, dict] = {}
    for r in records:
        p = points.setdefault(r.T, {"T": r.T, "ms": {}, "over_floor": {}, "errors": {}})
        if r.ms is None or r.suspicious:
            p["errors"][r.backend] = r.error or f"wrong result, rel_err {r.rel_err}"
            continue
        p["ms"][r.backend] = r.ms
        p["over_floor"][r.backend] = r.time_over_floor
        if r.backend == "auto":
            p["auto_chose"] = r.chosen
    for p in points.values():
        singles = {b: v for b, v in p["ms"].items() if b != "auto"}
        if singles:
            p["fastest"] = min(singles, key=singles.get)
            if "auto" in p["ms"]:
                p["auto_over_fastest"] = p["ms"]["auto"] / singles[p["fastest"]]
    ts = [T for T in sorted(points) if "auto" in points[T]["ms"]]
    names = {b for T in ts for b in points[T]["ms"] if b != "auto"}
    geo = {b: gmean([points[T]["ms"][b] for T in ts]) for b in names
           if all(b in points[T]["ms"] for T in ts)}
    best = min(geo, key=geo.get) if geo else None
    auto_geo = gmean([points[T]["ms"]["auto"] for T in ts]) if ts else None
    return {
        "job": text,
        "table": str(report.path) if report.path else None,
        "bench_json": str(bench_path),
        "excluded": report.excluded,
        "points": [points[T] for T in sorted(points)],
        "geomean_ms": {"auto": auto_geo, **geo},
        "best_single": best,
        "auto_vs_best_single": (auto_geo / geo[best]) if best and auto_geo else None,
        "auto_within_5pct": sum(points[T].get("auto_over_fastest", 9) <= 1.05 for T in ts),
        "points_with_auto": len(ts),
    }


def sweep(work: Path, jobs: str, batch_sizes: tuple[int, ...], deadline: float) -> bool:
    from moekit import select_table
    from moekit.report import metadata, result_dict, save
    from moekit.select_tune import sweep_spec, tune_select
    from moekit.sweep import SweepResult, all_backends, run_sweep, winners

    ok = True
    todo = jobs_of(jobs)
    summary: list[str] = []
    results: list[dict] = []
    for i, (text, job) in enumerate(todo):
        left = deadline - time.time() - 15
        # an even share of what is left, at least MIN_JOB_S (jobs usually end early, and the
        # time they leave goes to the next ones)
        budget = min(left, max(left / (len(todo) - i), MIN_JOB_S))
        if budget < MIN_JOB_S:
            line = f"== {text}: NOT RUN, {left:.0f} s left (rerun with GPU_BACKENDS_JOBS='{text}')"
            print(line)
            summary.append(line)
            ok = False
            continue
        print(f"\n=== sweep {text}: about {budget:.0f} s left for it", flush=True)
        try:
            # every concrete backend but the reference `torch` (never the fastest on a GPU; it
            # still computes every point's reference output). No per-point time budget: the
            # sweep estimates a point's cost from its first call, which includes the Triton JIT
            # compile, and skipped most triton points on the H100 (about 400 s "needed" for
            # less than 1 s of work); the job deadline and the step's timeout bound the time.
            spec = sweep_spec(job.model, tp_size=job.tp_size, ep_size=job.ep_size, dtype=job.dtype,
                              quantization=job.quantization, batch_sizes=batch_sizes,
                              routing=job.routing, time_budget_s=None,
                              backends=tuple(b for b in all_backends() if b != "torch"))

            def on_point(backend, T, rec):
                if rec is not None:
                    f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
                    what = (f"{f(rec.ms, '.4f')} ms, x{f(rec.time_over_floor, '.2f')} floor, "
                            f"rel_err {f(rec.rel_err, '.1e')}" if rec.ms is not None else rec.error)
                    extra = f" -> {rec.chosen}" if rec.chosen else ""
                    print(f"  T={T:>6} {backend:<18}{extra} {what}", flush=True)

            report = tune_select(spec, on_point=on_point)
            for b, why in sorted(report.excluded.items()):
                print(f"  not in the table: {b}: {why}")
            if report.table is None:
                raise RuntimeError("no backend could be measured")
            print(f"  table {report.path}: fastest {report.table.crossovers()}")
            select_table.reload()
            # auto again with the backends that won a point, timed in turns with them (one
            # layer, alternating rounds), so that auto / fastest compares like with like
            won = sorted({r.backend for r in winners(report.result.records).values()})
            auto_spec = replace(spec, backends=("auto", *won))
            auto = run_sweep(auto_spec, ceilings=report.result.ceilings, on_point=on_point)
            first = [r for r in report.result.records if r.backend not in won]
            merged = SweepResult(
                spec=replace(spec, backends=spec.backends + ("auto",)),
                ceilings=report.result.ceilings,
                records=first + auto.records,
                skipped={**report.result.skipped, **auto.skipped},
                auto_choice=auto.auto_choice,
                seconds=report.result.seconds + auto.seconds,
                notes=report.result.notes + auto.notes + [
                    "every backend timed by `moekit tune --select` (its selection table written); "
                    f"then `auto` timed on the same inputs with that table in place, in turns with "
                    f"the backends that won a point ({', '.join(won)}), whose times shown here "
                    f"are from that second pass"],
            )
            argv = ["moekit", "bench", "--model", job.model, "--tp-size", str(job.tp_size),
                    "--ep-size", str(job.ep_size), "--quantization", job.quantization,
                    "--backends", "all,auto", "(scripts/gpu_backends.sh)"]
            path, _ = save(result_dict(merged, metadata(argv)), work / "results")
            print(f"  wrote {path}")
            lines = auto_summary(merged.records, text)
            print("\n".join(lines))
            summary.extend(lines)
            results.append(job_result(text, merged.records, report, path))
            write_results(work, summary, results)  # after every job: a timeout keeps the rest
        except Exception:  # noqa: BLE001
            ok = False
            print(f"sweep {text}: failed:")
            traceback.print_exc(file=sys.stdout)
            summary.append(f"== {text}: FAILED (see the log)")
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_results(work, summary, results)
    return ok


def write_results(work: Path, summary: list[str], results: list[dict]) -> None:
    from moekit.report import git_commit

    (work / "auto_summary.txt").write_text("\n".join(summary) + "\n")
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "commit": git_commit()[0],
           "command": "scripts/gpu_backends.sh (sweep step)", "jobs": results}
    (work / "select_result.json").write_text(json.dumps(doc, indent=1) + "\n")


# ---------------------------------------------------------------------------- explain


def explain(work: Path, jobs: str, batch_sizes: tuple[int, ...]) -> bool:
    from moekit.config import ParallelConfig, RunnerConfig
    from moekit.hardware import detect
    from moekit.presets import preset
    from moekit.quant import make_spec
    from moekit.select import explain as explain_rows
    from moekit.select import select_runner, workload_for

    plat = detect()
    lines = [f"device: {plat.device_name} {plat.capability}; libraries {plat.libraries}"]
    ok = True
    for text, job in jobs_of(jobs):
        try:
            moe = preset(job.model, dtype=job.dtype, weight_format=job.quantization)
            par = ParallelConfig(tp_size=job.tp_size, ep_size=job.ep_size)
            spec = make_spec(job.quantization)
            lines.append(f"== {text}")
            for T in batch_sizes:
                work_ = workload_for(moe, T, parallel=par, device=plat.device, weight_spec=spec)
                try:
                    d = select_runner(work_, RunnerConfig("auto"), plat)
                    lines.append(f"  T={T:>6}: {d.backend}: {d.reason}")
                except Exception as err:  # noqa: BLE001
                    lines.append(f"  T={T:>6}: error: {err}")
            work_ = workload_for(moe, batch_sizes[0], parallel=par, device=plat.device,
                                 weight_spec=spec)
            for name, status in explain_rows(work_, RunnerConfig("auto"), plat):
                lines.append(f"    {name:<20} {status}")
        except Exception:  # noqa: BLE001
            ok = False
            lines.append(f"== {text}: failed: {traceback.format_exc()}")
    (work / "explain.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_backends.py")
    p.add_argument("step", choices=("smoke", "sweep", "explain"))
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--jobs", default="qwen3-30b-a3b")
    p.add_argument("--batch-sizes", default="1,4,16,64,256,1024,4096,16384")
    p.add_argument("--deadline", type=float, default=None, help="epoch seconds to end by")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = sizes_of(args.batch_sizes)
    if args.step == "smoke":
        ok = smoke(args.work)
    elif args.step == "sweep":
        ok = sweep(args.work, args.jobs, sizes, args.deadline or time.time() + 3600)
    else:
        ok = explain(args.work, args.jobs, sizes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
