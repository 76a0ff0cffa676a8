"""Measured tables as data, the pieces every runner's tables share: file-name parts (the device
slug, the weight-format tag), batch-size keys and the nearest-key lookup, and the order in which
the two Triton runners try tables tuned with other Triton versions.

A batch-size key counts tokens whose every pair is local: an EP rank that sees T tokens with a
share s of their pairs local looks up T * s (`table_key`; keys below 1 come from such ranks).
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import torch


def device_slug(device_name: str) -> str:
    """A device name as it appears in table file names (NVIDIA_H100_80GB_HBM3)."""
    return re.sub(r"[^A-Za-z0-9.]+", "_", device_name).strip("_")


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


MIN_KEY = 2.0**-10  # the smallest batch-size key (tokens' worth of local pairs) there is


def nearest_batch(batch_sizes, num_tokens: float, reach: float | None = None):
    """The batch size nearest to num_tokens in log2 distance (ties: the smaller); None when it
    is more than a factor `reach` away (no limit when reach is None). Every runner's measured
    tables are looked up this way. Sizes and num_tokens may be below 1 (tokens' worth
    of local pairs on an EP rank: `table_key`)."""
    t = math.log2(max(num_tokens, MIN_KEY))
    best = min(batch_sizes, key=lambda b: (abs(math.log2(b) - t), b))
    if reach is not None and abs(math.log2(best) - t) > math.log2(reach):
        return None
    return best


def table_key(num_tokens: int, local_share: float = 1.0) -> int | float:
    """The batch-size key of T tokens of which a share `local_share` of the pairs is local:
    T * local_share, an int when whole ('4', '0.125' in the files)."""
    v = num_tokens * local_share
    return int(v) if float(v).is_integer() else float(v)


def parse_key(text: str) -> int | float:
    """A batch-size key as written in a table file; ValueError unless at least MIN_KEY."""
    v = float(text)
    if not v >= MIN_KEY:
        raise ValueError(f"batch-size key {text!r} is not a number >= {MIN_KEY}")
    return table_key(v)


def quant_tag(spec) -> str:
    """The weight-format part of a table key: 'unquantized' (spec None), e.g.
    'fp8_w8a8-block128x128-token_group', 'fp8_w8a8-channel-token', 'int8_w8a8',
    'int4_w4a16-g128-sym', 'mxfp4'."""
    if spec is None:
        return "unquantized"
    name = spec.name
    if name == "fp8_w8a8":
        ws = spec.weight_scale
        if ws == "block":
            ws += "x".join(map(str, spec.block_shape))
        return f"{name}-{ws}-{spec.act_scheme}"
    if name == "int4_w4a16":
        return f"{name}-g{spec.group_size}-{'sym' if spec.symmetric else 'asym'}"
    return name


def table_triton_version(path: Path | str) -> str:
    """The Triton version a table file was tuned with (its name's `triton=` field)."""
    return Path(path).name.rsplit(",triton=", 1)[-1].removesuffix(".json")


def version_tuple(version: str) -> tuple[int, ...]:
    """A version string as comparable numbers ('3.9.0+git1' -> (3, 9, 0, 0); parts that are
    not numbers count 0)."""
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", version))


def _version_key(path: Path) -> tuple:
    return version_tuple(table_triton_version(path))


def version_candidates(directories, name: str, version: str) -> list[Path]:
    """Files that may hold the table `name` (tuned with Triton `version`), best first: `name`
    in each of `directories` in turn, then the same table tuned with other Triton versions,
    newest first (directories in the same order). Both Triton runners look their tables up
    this way."""
    other = name.replace(f",triton={version}.json", ",triton=*.json")
    paths = [directory / name for directory in directories]
    for directory in directories:
        paths += sorted(directory.glob(other), key=_version_key, reverse=True)
    return paths


def version_note(path: Path | str, running: str) -> str:
    """'' when table `path` was tuned with the running Triton version, else a note saying it
    was not (appended to the log line naming the table)."""
    tuned_with = table_triton_version(path)
    if tuned_with == running:
        return ""
    return (f" (tuned with Triton {tuned_with}, running {running}: `moekit tune` makes a table "
            "for this version)")  # fmt: skip


@functools.cache
def device_key(device) -> tuple[str, tuple[int, int] | None]:
    """(name, compute capability) of `device` as the config tables name it; ('cpu', None) off
    CUDA. Once per device: the runners' forward asks on every call."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu", None
    return torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
