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


def option(name: str, default: str) -> str:
    """The value after `name` on the command line, else `default` (the probes' flags)."""
    import sys

    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default
