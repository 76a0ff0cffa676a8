"""`moekit env`: the device, library versions, MOEKIT_* variables and every backend's availability;
`--explain` says which runner `auto` picks for a workload and why the others are or are not usable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import sys

import torch

from moekit import envs, hardware
from moekit.config import (
    A2A_BACKENDS,
    RUNNER_BACKENDS,
    ConfigError,
    ParallelConfig,
    RunnerConfig,
    validate,
)
from moekit.dispatch import registry as dispatch_registry
from moekit.presets import PRESETS, QUANTIZATION_DEFAULT, model_and_format
from moekit.router import explain_routing, fused_mode
from moekit.runners import registry as runner_registry
from moekit.select import explain, select_runner, workload_for


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "env",
        help="device, library versions, MOEKIT_* variables, backend availability",
        description="Print the device, library versions, MOEKIT_* environment variables and "
        "every runner / all-to-all backend with available or the reason it is not. With "
        "--explain: which runner `auto` picks for a workload, and why.",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--explain", action="store_true", help="explain the runner choice")
    p.add_argument(
        "--model", default="qwen3-30b-a3b",
        help=f"for --explain: a preset ({', '.join(PRESETS)}) or a Hugging Face config.json",
    )
    p.add_argument("--batch-size", type=int, default=1, help="tokens per call for --explain")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", help="activation dtype for --explain")
    p.add_argument("--quantization", help="weight format for --explain (a name, or "
                   f"NAME:key=value,...); {QUANTIZATION_DEFAULT}")
    p.add_argument("--moe-runner-backend", default="auto", help="requested runner for --explain")
    p.add_argument("--enable-adaptive-moe", action="store_true")
    p.add_argument("--adaptive-moe-batch-threshold", type=int, default=1024)
    p.set_defaults(func=run)
    return p


def _caps(cls) -> dict:
    c = cls.caps
    return {
        "formats": sorted(c.formats),
        "weight_formats": sorted(c.weight_formats),
        "activations": sorted(c.activations),
        "devices": sorted(c.devices),
        "dtypes": sorted(c.dtypes),
        "bias": c.bias,
        "cuda_graph": c.cuda_graph,
    }


def collect(args: argparse.Namespace, plat: hardware.Platform | None = None) -> dict:
    """Everything `moekit env` reports, as plain data."""
    plat = plat or hardware.detect()
    parallel = ParallelConfig(tp_size=args.tp_size, ep_size=args.ep_size)
    registered = runner_registry.registered()
    runners = []
    for name in RUNNER_BACKENDS:
        if name == "auto":
            continue
        a = runner_registry.availability(name, plat)
        runners.append({
            "name": name,
            "available": a.ok,
            "reason": a.reason,
            "caps": _caps(registered[name]) if name in registered else None,
        })
    a2a = []
    for name in A2A_BACKENDS:
        a = dispatch_registry.availability(name, plat, parallel)
        a2a.append({"name": name, "available": a.ok, "reason": a.reason})
    declared = {v.name for v in envs.ALL}
    doc = {
        "device": {
            "type": plat.device,
            "name": plat.device_name,
            "capability": list(plat.capability) if plat.capability else None,
            "num_gpus": plat.num_gpus,
        },
        "python": py_platform.python_version(),
        "cuda": torch.version.cuda,
        "libraries": {"torch": torch.__version__,
                      **{k: v for k, v in sorted(plat.libraries.items()) if k != "torch"}},
        "env": [
            {"name": v.name, "value": v.get(), "set": v.name in os.environ, "default": v.default,
             "help": v.help}
            for v in envs.ALL
        ],
        "unknown_env": sorted(
            k for k in os.environ if k.startswith("MOEKIT_") and k not in declared
        ),
        "parallel": {"tp_size": parallel.tp_size, "ep_size": parallel.ep_size},
        "runners": runners,
        "a2a": a2a,
    }
    if args.explain:
        doc["explain"] = explain_workload(args, plat, parallel)
    return doc


def explain_workload(args, plat: hardware.Platform, parallel: ParallelConfig) -> dict:
    """Which runner `auto` (or the requested backend) picks for the workload of args, and why."""
    if args.batch_size < 0:
        raise ConfigError(f"--batch-size must be >= 0, got {args.batch_size}")
    cfg, weight_spec = model_and_format(args.model, args.quantization, dtype=args.dtype)
    validate(cfg, parallel)
    config = RunnerConfig(
        moe_runner_backend=args.moe_runner_backend,
        enable_adaptive_moe=args.enable_adaptive_moe,
        adaptive_moe_batch_threshold=args.adaptive_moe_batch_threshold,
    )
    # The workload the layer would see on rank 0: per-rank shape and the format's spec.
    work = workload_for(
        cfg,
        args.batch_size,
        parallel=parallel,
        device=plat.device,
        weight_spec=weight_spec,
    )
    try:
        d = select_runner(work, config, plat)
        decision = {"backend": d.backend, "reason": d.reason}
    except ConfigError as err:
        decision = {"backend": None, "reason": str(err)}
    return {
        "model": args.model,
        "workload": {
            "num_tokens": work.num_tokens, "format": work.format,
            "weight_format": work.weight_format, "activation": work.activation,
            "dtype": work.dtype, "device": work.device, "has_bias": work.has_bias,
            "experts_local": work.num_experts,
            "intermediate_local": work.intermediate_size,
            "hidden_size": work.hidden_size, "top_k": work.top_k,
        },
        "requested": args.moe_runner_backend,
        "decision": decision,
        "routing": explain_routing(fused_mode(envs.MOEKIT_FUSED_ROUTER.get()), plat,
                                   cfg.num_experts, work.num_tokens, cfg.top_k),
        "backends": [{"name": n, "status": s} for n, s in explain(work, config, plat)],
    }


def _render(doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 130)
    d = doc["device"]
    cap = f"sm_{d['capability'][0]}{d['capability'][1]}" if d["capability"] else "-"
    dev = Table(title="device", show_header=False, title_justify="left")
    dev.add_row("device", f"{d['type']}: {d['name']}")
    dev.add_row("capability", cap)
    dev.add_row("GPUs", str(d["num_gpus"]))
    dev.add_row("python", doc["python"])
    dev.add_row("CUDA (torch build)", str(doc["cuda"]))
    console.print(dev)

    libs = Table(title="libraries", title_justify="left")
    libs.add_column("library")
    libs.add_column("version")
    for name, version in doc["libraries"].items():
        libs.add_row(name, version or "[dim]not installed[/dim]")
    console.print(libs)

    env = Table(title="MOEKIT_* environment variables", title_justify="left")
    for col in ("variable", "value", "meaning"):
        env.add_column(col)
    for v in doc["env"]:
        value = v["value"] or "(empty)"
        env.add_row(v["name"], value if v["set"] else f"{value} [dim](default)[/dim]", v["help"])
    for name in doc["unknown_env"]:
        unknown = "[yellow]unknown variable: moekit ignores it[/yellow]"
        env.add_row(name, os.environ.get(name, ""), unknown)
    console.print(env)

    for key, what in (("runners", "runner backends (--moe-runner-backend)"),
                      ("a2a", "all-to-all backends (--moe-a2a-backend)")):
        t = Table(title=what, title_justify="left")
        t.add_column("backend")
        t.add_column("status")
        t.add_column("reason / capabilities")
        for b in doc[key]:
            status = "[green]available[/green]" if b["available"] else "[red]unavailable[/red]"
            detail = b["reason"]
            caps = b.get("caps")
            if b["available"] and caps:
                detail = (
                    f"devices {','.join(caps['devices'])} · formats {','.join(caps['formats'])}"
                    f" · weights {','.join(caps['weight_formats'])} · "
                    f"cuda graph {'yes' if caps['cuda_graph'] else 'no'}"
                ) + (f" · {b['reason']}" if b["reason"] else "")
            t.add_row(b["name"], status, detail)
        console.print(t)

    if "explain" in doc:
        ex = doc["explain"]
        w = ex["workload"]
        console.print(
            f"[bold]explain[/bold] {ex['model']}: T={w['num_tokens']}, "
            f"E_local={w['experts_local']}, "
            f"K={w['top_k']}, H={w['hidden_size']}, I_local={w['intermediate_local']}, "
            f"{w['activation']}{' + biases' if w['has_bias'] else ''}, {w['dtype']}, "
            f"{w['weight_format']} weights, {w['format']} format on {w['device']}; "
            f"--moe-runner-backend {ex['requested']}"
        )
        dec = ex["decision"]
        if dec["backend"]:
            console.print(f"picked: [bold green]{dec['backend']}[/bold green] ({dec['reason']})")
        else:
            console.print(f"[red]no runner: {dec['reason']}[/red]")
        console.print(f"routing: {ex['routing']}")
        t = Table(title="each runner for this workload", title_justify="left")
        t.add_column("backend")
        t.add_column("status")
        for b in ex["backends"]:
            s = b["status"]
            style = "green" if s in ("chosen", "usable") else "dim"
            t.add_row(b["name"], f"[{style}]{s}[/{style}]")
        console.print(t)


def run(args: argparse.Namespace) -> int:
    doc = collect(args)
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        _render(doc)
    return 0
