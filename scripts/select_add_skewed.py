"""Add the times of `moekit bench --routing zipf` results to the selection tables of the same
layers, as their points' skewed times (`select_table.Point.skewed_ms`).

    PYTHONPATH=src python3 scripts/select_add_skewed.py RESULT.json [RESULT.json ...]
        [--tables src/moekit/configs/select]

`moekit tune --select --skewed` measures both routings in one run. This is for tables already
measured on uniform routing: each result goes into the table of its device, preset, parallel
layout, weight format and dtype that was measured with the same library versions. At each of
the table's batch sizes, the backends the result timed correctly (auto excluded) become the
point's skewed times. The table's meta records where they came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from moekit import select_table
from moekit.select_table import LIBRARIES, SelectionTable
from moekit.select_tune import points_from_records, with_skewed
from moekit.sweep import Record


def matches(table: SelectionTable, result: dict) -> bool:
    m, k, par = table.meta, table.key, result["parallel"]
    libs = result.get("libraries", {})
    return (
        k.device_name.lower() == result["device"]["name"].lower()
        and (m.get("preset"), m.get("tp_size"), m.get("ep_size"))
        == (result["preset"], par["tp_size"], par["ep_size"])
        and (k.weight_format, k.dtype) == (result["quantization"], result["dtype"])
        and all(table.libraries.get(lib) == libs.get(lib) for lib in LIBRARIES
                if lib in table.libraries)
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--tables", type=Path, default=select_table.shipped_dir())
    args = p.parse_args(argv)
    tables = select_table.load_dir(args.tables)
    for path in args.results:
        result = json.loads(path.read_text())
        routing = result["routing"]
        if routing["kind"] != "zipf":
            print(f"{path}: routing {routing['kind']}, not zipf", file=sys.stderr)
            return 1
        found = [t for t in tables if matches(t, result)]
        if len(found) != 1:
            print(f"{path}: {len(found)} matching tables in {args.tables}", file=sys.stderr)
            return 1
        measured, _ = points_from_records([Record(**r) for r in result["records"]])
        table, sizes = found[0], {pt.num_tokens for pt in measured}
        points = with_skewed(table.points, measured)
        meta = dict(table.meta, skewed_routing=f"zipf s={routing['zipf_s']:g}",
                    skewed_source=f"{path.name} (commit {result.get('commit')})")
        new = replace(table, points=points, meta=meta)
        select_table.write(new, table.source)  # its own file (one per library set)
        print(f"{Path(table.source).name}: skewed times at "
              f"{sorted(sizes & {pt.num_tokens for pt in points})}; "
              f"first: {new.crossovers()} (before: {table.crossovers()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
