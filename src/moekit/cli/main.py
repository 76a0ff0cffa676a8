"""The `moekit` command: `env`, `bench`, `tune`, `eplb`. Thin: parse arguments, call the library.

Exit codes: 0 success, 1 the command ran but failed (e.g. every benchmark point failed),
2 bad usage or configuration (unknown preset, backend, bad value; the message says which).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moekit.config import ConfigError

USAGE_ERROR = 2


def _tune_module():
    """moekit.cli.tune if this build has it, else (None, why)."""
    try:
        return importlib.import_module("moekit.cli.tune"), None
    except ModuleNotFoundError as err:
        if err.name == "moekit.cli.tune":
            return None, "tuning is not available in this build (no moekit.cli.tune)"
        return None, f"tuning is not available: importing moekit.cli.tune failed: {err}"
    except Exception as err:  # noqa: BLE001 - a broken tune module must not break env/bench
        return None, f"tuning is not available: importing moekit.cli.tune failed: {err}"


def _add_tune(subparsers) -> None:
    module, why = _tune_module()
    if module is not None:
        module.add_parser(subparsers)
        return
    p = subparsers.add_parser("tune", help="tune kernel configs (not available in this build)")

    def unavailable(args) -> int:
        print(f"moekit tune: {why}", file=sys.stderr)
        return USAGE_ERROR

    p.set_defaults(func=unavailable, accepts_any_arguments=True)


def build_parser() -> argparse.ArgumentParser:
    from moekit import __version__
    from moekit.cli import bench, env, eplb

    parser = argparse.ArgumentParser(
        prog="moekit",
        description="Mixture-of-Experts layers for LLM inference: inspect the environment, "
        "benchmark the runner backends, tune kernels, balance the expert placement.",
    )
    parser.add_argument("--version", action="version", version=f"moekit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env.add_parser(sub)
    bench.add_parser(sub)
    _add_tune(sub)
    eplb.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_any_arguments", False):
        parser.parse_args(argv)  # reports the unknown arguments and exits with 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE_ERROR
    try:
        return int(args.func(args) or 0)
    except ConfigError as err:
        message = err.args[0] if err.args else str(err)
        print(f"moekit {args.command}: error: {message}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
