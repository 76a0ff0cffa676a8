"""Bench results on disk: the JSON record of a sweep, its PNG plot, and BENCHMARKS.md.

BENCHMARKS.md is generated from the newest result JSON per (device, preset, parallel layout,
dtype, weight format, routing) in benchmarks/results/, then the newest run of each GPU script
per device, then every expert-parallel run; never edit it by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform as py_platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from moekit import envs, hardware
from moekit.bench import (
    L2_ROTATION_FACTOR,
    MAX_INPUT_SETS,
    MIN_ROUTINGS,
    MIN_SKEWED_ROUTINGS,
    MULTI_ROUTING_MAX_T,
)
from moekit.presets import model_label
from moekit.sweep import TIMED, SweepResult, winners

SCHEMA = 1
BENCHMARKS_MD = "BENCHMARKS.md"
RESULTS_DIR = Path("benchmarks") / "results"


def repo_root() -> Path | None:
    """The source checkout this moekit runs from (src layout), or None when installed elsewhere."""
    root = Path(__file__).resolve().parents[2]
    is_checkout = (root / "pyproject.toml").is_file() and (root / "src" / "moekit").is_dir()
    return root if is_checkout else None


def git_commit(root: Path | None = None) -> tuple[str, bool | None]:
    """(commit, whether the tree has uncommitted changes). MOEKIT_GIT_COMMIT wins when set (a
    copy of a tree run inside another checkout, or one without .git: git would name the wrong
    commit); else HEAD of the checkout; else 'unknown'."""
    pinned = envs.MOEKIT_GIT_COMMIT.get()
    if pinned:
        return pinned, None
    root = root or repo_root()
    if root is not None:
        try:
            head = subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
            )
            if head.returncode == 0:
                status = subprocess.run(
                    ["git", "status", "--porcelain", "--untracked-files=no"],
                    cwd=root, capture_output=True, text=True, timeout=10,
                )
                dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
                return head.stdout.strip(), dirty
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown", None


def metadata(
    argv: list[str] | None = None,
    plat: hardware.Platform | None = None,
    *,
    command: str | None = None,
) -> dict:
    """Where and how a run happens: device, library versions, git commit, command line, time.
    `command` replaces the `moekit ...` line built from argv (a script's own command)."""
    plat = plat or hardware.detect()
    commit, dirty = git_commit()
    libs = {"torch": torch.__version__}
    libs.update({k: v for k, v in sorted(plat.libraries.items()) if k != "torch" and v})
    argv = sys.argv if argv is None else argv
    return {
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": {
            "type": plat.device,
            "name": plat.device_name,
            "capability": list(plat.capability) if plat.capability else None,
            "num_gpus": plat.num_gpus,
        },
        "libraries": libs,
        "cuda": torch.version.cuda,
        "python": py_platform.python_version(),
        "commit": commit,
        "dirty": dirty,
        "command": command or " ".join(shlex.quote(a) for a in ["moekit", *argv[1:]]),
    }


def result_dict(result: SweepResult, meta: dict) -> dict:
    """The JSON document of one sweep."""
    s = result.spec
    moe = s.moe
    return {
        "schema": SCHEMA,
        **meta,
        "preset": s.preset,
        "scaled_down": s.scaled_down,
        "shape": {
            "num_experts": moe.num_experts,
            "num_shared_experts": moe.num_shared_experts,
            "top_k": moe.top_k,
            "hidden_size": moe.hidden_size,
            "intermediate_size": moe.intermediate_size,
            "experts_local": s.e_local,
            "intermediate_local": s.i_local,
            "activation": moe.activation,
            "has_bias": moe.has_bias,
        },
        "parallel": {
            "tp_size": s.parallel.tp_size,
            "ep_size": s.parallel.ep_size,
            "moe_tp_size": s.parallel.moe_tp_size,
            "rank": 0,
        },
        "dtype": moe.dtype,
        "quantization": s.quantization,
        "routing": {"kind": s.routing, "zipf_s": s.zipf_s if s.routing == "zipf" else None,
                    "seed": s.seed},
        "timed": TIMED,
        "batch_sizes": list(s.batch_sizes),
        "ceilings": dataclasses.asdict(result.ceilings),
        "backends": sorted({r.backend for r in result.records}, key=list(s.backends).index),
        "skipped": result.skipped,
        "auto_choice": {str(t): b for t, b in result.auto_choice.items()},
        "winners": {str(t): r.backend for t, r in winners(result.records).items()},
        "seconds": round(result.seconds, 2),
        "notes": result.notes,
        "records": [dataclasses.asdict(r) for r in result.records],
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "x"


def run_name(doc: dict) -> str:
    """File stem of a result: time, device, preset, layout, dtype, format, routing."""
    stamp = doc["timestamp"].replace("-", "").replace(":", "")
    par = doc["parallel"]
    routing = doc["routing"]["kind"]
    if routing == "zipf":
        routing += f"{doc['routing']['zipf_s']:g}"
    preset = model_label(doc["preset"]) + ("-cpusmall" if doc.get("scaled_down") else "")
    parts = [doc["device"]["name"], preset, f"tp{par['tp_size']}ep{par['ep_size']}",
             doc["dtype"], doc["quantization"], routing]
    return "_".join([stamp, *(_slug(p) for p in parts)])


def save(doc: dict, out_dir: str | os.PathLike, *, plot: bool = True) -> tuple[Path, Path | None]:
    """Write `<name>.json` (and `<name>.png` if `plot`) into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = run_name(doc)
    n = 1
    while (out / f"{stem}.json").exists():
        n += 1
        stem = f"{run_name(doc)}-{n}"
    png = None
    if plot:
        png = out / f"{stem}.png"
        doc["plot"] = png.name
        plot_png(doc, png)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path, png


def title(doc: dict) -> str:
    par = doc["parallel"]
    routing = doc["routing"]["kind"]
    if routing == "zipf":
        routing += f" s={doc['routing']['zipf_s']:g}"
    preset = model_label(doc["preset"]) + (" (CPU scale-down)" if doc.get("scaled_down") else "")
    return (f"{preset} · tp{par['tp_size']} ep{par['ep_size']} · {doc['dtype']} · "
            f"{doc['quantization']} · {routing} routing")


def plot_png(doc: dict, path: str | os.PathLike) -> None:
    """time / floor against T (log x) per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    by_backend: dict[str, list[tuple[int, float]]] = {}
    for r in doc["records"]:
        if r["time_over_floor"] is not None and r["T"] > 0:
            by_backend.setdefault(r["backend"], []).append((r["T"], r["time_over_floor"]))
    for backend, pts in by_backend.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ticks = [t for t in doc["batch_sizes"] if t > 0]
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("tokens per call (T)")
    ax.set_ylabel("time / roofline floor")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title(doc)}\n{doc['device']['name']}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if by_backend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------- BENCHMARKS.md


def _key(doc: dict) -> tuple:
    par = doc["parallel"]
    return (doc["device"]["name"], doc["preset"], bool(doc.get("scaled_down")),
            par["tp_size"], par["ep_size"], doc["dtype"], doc["quantization"],
            doc["routing"]["kind"], doc["routing"].get("zipf_s"))


def load_results(results_dir: str | os.PathLike) -> list[tuple[Path, dict]]:
    """Every readable result JSON (schema SCHEMA) in results_dir."""
    found = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA and "records" in doc:
            found.append((path, doc))
    return found


def newest_per_key(results: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    best: dict[tuple, tuple[Path, dict]] = {}
    for path, doc in results:
        k = _key(doc)
        newer = k not in best or (doc["timestamp"], path.name) > (
            best[k][1]["timestamp"], best[k][0].name
        )
        if newer:
            best[k] = (path, doc)
    from moekit.presets import PRESETS

    order = list(PRESETS)

    def sort_key(item):
        doc = item[1]
        return (doc["device"]["type"] != "cuda", doc["device"]["name"],
                order.index(doc["preset"]) if doc["preset"] in order else len(order),
                doc["preset"], *[str(v) for v in _key(doc)[2:]])

    return sorted(best.values(), key=sort_key)


def _cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["ms"] is None:
        return "failed" if not (r.get("error") or "").startswith("skipped") else "skipped"
    ratio = f" ({r['time_over_floor']:.2f}x)" if r["time_over_floor"] is not None else ""
    flag = " ⚠" if r.get("suspicious") else ""
    return f"{r['ms']:.4g}{ratio}{flag}"


def table_markdown(doc: dict) -> list[str]:
    """One result as a markdown table: T rows, a column per backend: ms (time / floor), the
    winner and what `auto` picks."""
    backends = doc["backends"]
    by = {(r["backend"], r["T"]): r for r in doc["records"]}
    lines = [
        "| T | " + " | ".join(backends) + " | winner | auto picks |",
        "|---:|" + "---|" * (len(backends) + 2),
    ]
    for T in doc["batch_sizes"]:
        cells = [_cell(by.get((b, T))) for b in backends]
        auto = doc["auto_choice"].get(str(T), "")
        auto = auto if not auto.startswith("error") else "(none)"
        winner = doc["winners"].get(str(T), "")
        lines.append(f"| {T} | " + " | ".join(cells) + f" | {winner} | {auto} |")
    return lines


def render_benchmarks_md(results: list[tuple[Path, dict]], root: Path) -> str:
    """BENCHMARKS.md from the newest result per key."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `moekit bench` from the newest result per (device, preset, parallel layout, "
        "dtype, weight format, routing) in `benchmarks/results/`. Do not edit by hand: run "
        "`moekit bench` to add or refresh a result.",
        "",
        f"Timed: {TIMED}. Each cell: milliseconds per call (time / roofline floor); floor = "
        "max(bytes / copy bandwidth, FLOPs / matmul rate), both ceilings measured in the same "
        "run; bytes = weights of the local experts the routing touches + activations in and out; "
        "FLOPs = 2 x local (token, expert) pairs x 3 x H x I_local. CUDA-graph replay where the "
        "runner is graph safe. Each time is the mean over its point's input sets (x and "
        f"routing; on a GPU at least {MIN_ROUTINGS} routings up to T = {MULTI_ROUTING_MAX_T}, "
        f"at least {MIN_SKEWED_ROUTINGS} draws of a Zipf routing at every T, "
        f"and enough sets for a replay to touch {L2_ROTATION_FACTOR} L2 caches' worth of bytes, "
        f"at most {MAX_INPUT_SETS}; older results took one set wherever one was that large; each "
        "point's JSON records its input_sets). ⚠ = output differs from the `torch` reference "
        "runner by more than the dtype's bound.",
        "",
    ]
    if not results:
        lines += ["No results yet.", ""]
    device = None
    for path, doc in results:
        if doc["device"]["name"] != device:
            device = doc["device"]["name"]
            cap = doc["device"].get("capability")
            cap = f" (sm_{cap[0]}{cap[1]})" if cap else ""
            lines += [f"## {device}{cap}", ""]
        shape, c = doc["shape"], doc["ceilings"]
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        commit = _commit_of(doc)
        lib = doc["libraries"]
        versions = ", ".join(f"{k} {lib[k]}" for k in ("torch", "triton") if k in lib)
        lines += [
            f"### {title(doc)}",
            "",
            f"E_local={shape['experts_local']}, K={shape['top_k']}, H={shape['hidden_size']}, "
            f"I_local={shape['intermediate_local']}, {shape['activation']}"
            f"{', biases' if shape['has_bias'] else ''} · ceilings: copy "
            f"{c['copy_bytes_per_s'] / 1e12:.3g} TB/s, matmul "
            f"{c['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s ({c['dtype']}) · {doc['timestamp']} · "
            f"{commit} · {versions} · [json]({rel.as_posix()})"
            + (f" · [plot]({(rel.parent / doc['plot']).as_posix()})" if doc.get("plot") else ""),
            "",
            *table_markdown(doc),
            "",
        ]
        if doc.get("skipped"):
            why = "; ".join(f"`{b}`: {reason}" for b, reason in doc["skipped"].items())
            lines += ["Not run: " + why, ""]
    return "\n".join(lines)


EP_SCHEMA = "moekit.bench_ep/1"


def _newest_first(results_dir: Path):
    """(path, document) of each JSON object file in results_dir, newest first (names start
    with a UTC timestamp); unreadable files and other JSON are skipped."""
    for path in sorted(results_dir.glob("*.json"), reverse=True):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            yield path, doc


def _commit_of(doc: dict) -> str:
    """'commit abc1234' of a result document, with ' (dirty)' for a tree with uncommitted
    changes."""
    commit = doc.get("commit") or "unknown"
    dirty = " (dirty)" if doc.get("dirty") else ""
    return f"commit {str(commit)[:10]}{dirty}"


def render_ep_md(results_dir: Path, root: Path) -> str:
    """The expert-parallel section: every `python -m moekit.bench_ep` JSON in results_dir."""
    from moekit.bench_ep import summary  # imports torch.distributed; only needed here

    lines = []
    for path, doc in _newest_first(results_dir):
        if doc.get("schema") != EP_SCHEMA:
            continue
        if not lines:
            lines += ["## Expert parallelism (`python -m moekit.bench_ep` under torchrun)", "",
                      "Newest run first. Each run comes from `scripts/gpu_ep.sh` on the GPU "
                      "machine (`OUT=/tmp/out bash scripts/gpu_ep.sh`), which calls "
                      "`python -m torch.distributed.run --standalone --nproc-per-node <GPUs> "
                      "-m moekit.bench_ep <arguments>`; the arguments of each run are under "
                      "its link. `--normal-chunks` names the settings timed side by side: "
                      "`default` (the dispatcher's defaults: the p2p transport on one host "
                      "since commit 470363b, the NCCL path before), "
                      "`nccl` / `p2p` (the transport), 1..4 (NCCL calls), /none /plan /pack "
                      "(what the NCCL path replays from CUDA graphs).", ""]
        rel = path.relative_to(root) if path.is_relative_to(root) else path
        lines += [f"[{rel.as_posix()}]({rel.as_posix()}) · {doc['timestamp']} · "
                  f"{_commit_of(doc)} · fp8 dispatch: {doc['args'].get('fp8')}", "",
                  f"arguments: `{doc.get('command', '').removeprefix('moekit').strip()}`", "",
                  "```",
                  summary(doc), "```", ""]
    return "\n".join(lines)


def render_script_md(results_dir: Path, root: Path) -> str:
    """Sections for the GPU scripts' JSON, the newest run of each kind per device (older runs
    stay in results_dir): scripts/gpu_triton_kernel.py, `triton_kernel` against `triton` (per
    Triton version too); target tables ({"summary": [{what, value, target, met}], "targets"},
    per script: "script" and "title" name them, else scripts/gpu_triton_quant.py's quantized
    `triton` against bf16)."""
    newest: dict[tuple, tuple[str, dict]] = {}
    for path, doc in _newest_first(results_dir):
        rel = (path.relative_to(root) if path.is_relative_to(root) else path).as_posix()
        link = f"[{rel}]({rel}) · {_commit_of(doc)}"
        points = doc.get("points")  # a list of dicts here; other probes store other shapes
        if isinstance(points, list) and points and "triton_kernel_ms" in points[0]:
            newest.setdefault(("kernel", doc.get("device"), doc.get("triton")), (link, doc))
        elif isinstance(doc.get("summary"), list) and "targets" in doc:
            script = doc.get("script", "scripts/gpu_triton_quant.py")
            newest.setdefault(("targets", doc.get("device"), script), (link, doc))
    lines = []
    for (kind, device, detail), (link, doc) in newest.items():
        if kind == "kernel":
            lines += [f"## `triton_kernel` against `triton` ({device}, Triton {detail}, "
                      "scripts/gpu_triton_kernel.py)", "", f"{link} · time / floor", "",
                      "| shape | T | triton | triton_kernel | speed-up of triton_kernel |",
                      "|---|---:|---|---|---|"]
            lines += [f"| {p['model']} | {p['T']} | {p['triton_over_floor']:.2f}x | "
                      f"{p['triton_kernel_over_floor']:.2f}x | {p['speedup']:.2f} |"
                      for p in doc["points"]]
        else:
            title = doc.get("title", "Quantized `triton` against bf16 `triton`")
            lines += [f"## {title} ({device}, {detail})", "", link, "",
                      "| what | measured | target | met |", "|---|---:|---|---|"]
            lines += [f"| {r['what']} | {r['value']} | {r['target']} | "
                      f"{'yes' if r['met'] else 'no'} |" for r in doc["summary"]]
        lines.append("")
    return "\n".join(lines)


def update_benchmarks_md(root: Path) -> Path:
    """Regenerate root/BENCHMARKS.md from root/benchmarks/results/."""
    results = newest_per_key(load_results(root / RESULTS_DIR))
    path = root / BENCHMARKS_MD
    sections = (
        render_benchmarks_md(results, root),
        render_script_md(root / RESULTS_DIR, root),
        render_ep_md(root / RESULTS_DIR, root),
    )
    path.write_text("\n".join(sections))
    return path
