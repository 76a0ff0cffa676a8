"""Per-kernel GPU time in torch.profiler chrome traces: `python scripts/trace_kernels.py
TRACE.json [...]` prints, per trace, each kernel / memcpy name with its count and mean and
total microseconds (sorted by total), so that the phases of a call can be read off."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def kernel_times(path: str) -> list[tuple[str, int, float, float]]:
    """[(name, count, mean us, total us)] of the GPU events in one chrome trace."""
    events = json.load(open(path)).get("traceEvents", [])
    acc: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            acc[e["name"][:90]].append(float(e.get("dur", 0.0)))
    rows = [(n, len(v), sum(v) / len(v), sum(v)) for n, v in acc.items()]
    return sorted(rows, key=lambda r: -r[3])


def main(paths: list[str]) -> None:
    for p in paths:
        print(f"--- {p}")
        for name, n, mean, total in kernel_times(p)[:25]:
            print(f"{total:10.1f} us  {n:4d} x {mean:8.1f} us  {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
