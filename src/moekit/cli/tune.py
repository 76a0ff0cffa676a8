"""`moekit tune`: tune the triton runner's kernel configs for one model shape on this GPU.

Thin: parses arguments and calls `moekit.tune.tune`. Exit codes: 0 done (or nothing left to
do), 1 tuning failed, 2 bad arguments (ConfigError, reported by the caller).
"""

from __future__ import annotations

import argparse
import sys

from moekit.config import ConfigError
from moekit.presets import PRESETS, QUANTIZATION_DEFAULT, model_and_format
from moekit.quant.spec import format_text


def add_parser(subparsers) -> argparse.ArgumentParser:
    from moekit.select_table import SKEW_SLACK
    from moekit.tune import BATCH_SIZES

    p = subparsers.add_parser(
        "tune",
        help="tune the triton runner's kernel configs for a model shape on this GPU",
        description="Sweep block sizes / warps / stages of the triton runner's two grouped GEMMs "
        "for each batch size, on this GPU, with CUDA-graph timing; write the JSON tables the "
        "runner looks up. Batch sizes already in the output files are skipped (resume), unless "
        "--force.",
    )
    p.add_argument("--model", required=True, help=f"preset ({', '.join(PRESETS)}) or a Hugging "
                   "Face config.json (file or directory)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    p.add_argument(
        "--batch-sizes",
        default=",".join(map(str, BATCH_SIZES)),
        help="comma-separated token counts (default: %(default)s)",
    )
    p.add_argument(
        "--out-dir",
        help="where the JSON tables go (default: the user config dir, $MOEKIT_CONFIG_DIR/triton; "
        "give src/moekit/configs/triton to update the files shipped with the package)",
    )
    p.add_argument("--force", action="store_true", help="re-tune batch sizes already present")
    p.add_argument("--select", action="store_true", help="instead: time every runner backend "
                   "and write the selection table `auto` uses (moekit.select_tune; --out-dir "
                   "default $MOEKIT_CONFIG_DIR/select)")
    p.add_argument("--skewed", action="store_true", help="with --select: also time every "
                   f"backend on Zipf-skewed routing; among the backends within "
                   f"{(SKEW_SLACK - 1) * 100:.0f}%% of the fastest on uniform routing, auto then "
                   "prefers the one that loses least on either")
    p.add_argument("--zipf-s", type=float, default=1.2,
                   help="Zipf exponent of --skewed (default: %(default)s)")
    p.add_argument("--quantization", help="weight format of the experts: a name (the format's "
                   "default parameters) or NAME:key=value,... (e.g. int4_w4a16:group_size=32); "
                   f"{QUANTIZATION_DEFAULT}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from moekit.cli.bench import parse_batch_sizes

    if args.skewed and not args.select:
        raise ConfigError("--skewed: only with --select (it times the backends for auto)")
    if args.select:
        from moekit.select_tune import run_cli

        return run_cli(args, parse_batch_sizes(args.batch_sizes))
    from moekit.tune import shape_for, tune

    shape = shape_for(args.model, args.tp_size, args.ep_size, args.dtype)
    weight_spec = model_and_format(args.model, args.quantization)[1]
    sizes = list(parse_batch_sizes(args.batch_sizes, minimum=1))
    try:
        report = tune(
            shape,
            sizes,
            out_dir=args.out_dir,
            force=args.force,
            progress=not args.no_progress,
            note=f"moekit tune --model {args.model} --tp-size {args.tp_size} --ep-size "
            f"{args.ep_size} --dtype {args.dtype} --quantization {format_text(weight_spec)}",
            quantization=weight_spec,
        )
    except RuntimeError as err:
        print(f"moekit tune: failed: {err}", file=sys.stderr)
        return 1
    if report.skipped:
        print(f"already tuned (skipped): {', '.join(map(str, report.skipped))}")
    for r in report.results:
        print(
            f"T={r.num_tokens:>6}  layer {r.layer_us:9.1f} us  floor {r.floor_us:9.1f} us  "
            f"{r.ratio:5.2f}x"
        )
    for path in report.paths.values():
        print(f"wrote {path}" if report.results else f"up to date: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (python -m moekit.cli.tune ...)."""
    parser = argparse.ArgumentParser(prog="moekit")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["tune", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"moekit tune: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
