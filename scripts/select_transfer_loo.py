"""Left-one-out check of `auto` on shapes without a selection table (CPU only, no GPU).

Every shipped selection table holds the measured time of every backend at each batch size. For
each table and point, the shape's own tables are hidden and `moekit.select_table.lookup` picks a
point of another shape (`nearest_shape`), as `auto` does for an untuned model; the backend it
ranks first among those measured at the hidden point is compared, by the hidden point's own
times, with the fastest there and with what the default preference order (`moekit.select`,
used before when no table matched) would have run.

Scenarios:
  shape   the shape's tables are hidden on every device (a model nobody tuned);
  device  every table of the device is hidden (a GPU nobody tuned; the other GPU's tables of the
          same compute capability remain).

Usage:  PYTHONPATH=src python3 scripts/select_transfer_loo.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
from moekit import select, select_table
from moekit.config import ParallelConfig, RunnerConfig
from moekit.hardware import Platform
from moekit.presets import preset
from moekit.quant import make_spec


def geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def shape_of(t: select_table.SelectionTable) -> tuple:
    k = t.key
    return (k.format, k.weight_spec, k.dtype, k.activation, k.has_bias, k.num_experts,
            k.hidden_size, k.intermediate_size, k.top_k)  # fmt: skip


def evaluate(tables: list, scenario: str) -> list[dict]:
    rows = []
    for t in tables:
        if scenario == "shape":
            visible = [u for u in tables if shape_of(u) != shape_of(t)]
        else:
            visible = [u for u in tables if u.key.device_name != t.key.device_name]
        plat = Platform("cuda", t.key.device_name, (9, 0), 1,
                        {k: v for k, v in t.libraries.items() if v is not None})  # fmt: skip
        meta = t.meta
        par = ParallelConfig(tp_size=meta["tp_size"], ep_size=meta["ep_size"])
        fmt = t.key.weight_format
        moe = preset(meta["preset"], weight_format=fmt)
        spec = None if fmt == "unquantized" else make_spec(fmt)  # the layer's workload has it
        for p in t.points:
            work = select.workload_for(moe, p.num_tokens, parallel=par, weight_spec=spec)
            measured = set(p.ms)
            fastest = p.ranking[0]
            order, _ = select._preference(work, RunnerConfig())
            default = next(b for b in order if b in measured)
            match = select_table.lookup(visible, work, plat, measured)
            chosen = None
            if match.table is not None:
                chosen = next((b for b in match.point.ranking if b in measured), None)
            rows.append({
                "table": t.source.rsplit("/", 1)[-1], "preset": meta["preset"],
                "device": t.key.device_name, "weight_format": t.key.weight_format,
                "libraries": t.libraries, "T": p.num_tokens, "fastest": fastest,
                "default": default, "default_over_fastest": p.ms[default] / p.ms[fastest],
                "transfer": chosen,
                "transfer_over_fastest": p.ms[chosen] / p.ms[fastest] if chosen else None,
                "from": match.table.source.rsplit("/", 1)[-1] if match.table else None,
                "note": match.note,
            })
    return rows


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["transfer"] is not None]
    d = [r["default_over_fastest"] for r in ok]
    n = [r["transfer_over_fastest"] for r in ok]
    return {
        "points": len(rows), "transferred": len(ok),
        "default_geomean": geomean(d), "transfer_geomean": geomean(n),
        "default_worst": max(d, default=None), "transfer_worst": max(n, default=None),
        "default_within_5pct": sum(x <= 1.05 for x in d),
        "transfer_within_5pct": sum(x <= 1.05 for x in n),
        "transfer_faster_than_default": sum(a < b - 1e-12 for a, b in zip(n, d, strict=True)),
        "transfer_slower_than_default": sum(a > b + 1e-12 for a, b in zip(n, d, strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write every point and the summaries here (JSON)")
    args = ap.parse_args()
    tables = select_table.load_dir(select_table.shipped_dir())
    doc = {"tables": len(tables), "weights": select_table.REGIME_WEIGHTS,
           "other_device": select_table.OTHER_DEVICE,
           "other_activation": select_table.OTHER_ACTIVATION, "scenarios": {}}  # fmt: skip
    for scenario in ("shape", "device"):
        rows = evaluate(tables, scenario)
        s = summary(rows)
        doc["scenarios"][scenario] = {"summary": s, "points": rows}
        print(f"{scenario}: {s['transferred']} of {s['points']} points transferred; chosen / "
              f"fastest, geomean: default {s['default_geomean']:.4f} (worst "
              f"{s['default_worst']:.3f}), transfer {s['transfer_geomean']:.4f} (worst "
              f"{s['transfer_worst']:.3f}); within 5% of the fastest: default "
              f"{s['default_within_5pct']}, transfer {s['transfer_within_5pct']}; transfer "
              f"faster than default at {s['transfer_faster_than_default']}, slower at "
              f"{s['transfer_slower_than_default']}")
        worse = [r for r in rows if r["transfer"]
                 and r["transfer_over_fastest"] > r["default_over_fastest"] + 1e-12]
        worse.sort(key=lambda r: r["default_over_fastest"] - r["transfer_over_fastest"])
        for r in worse[:8]:
            print(f"  slower: {r['preset']} {r['device']} {r['weight_format']} "
                  f"triton {r['libraries'].get('triton')} deep_gemm "
                  f"{r['libraries'].get('sgl-deep-gemm')} T={r['T']}: {r['transfer']} "
                  f"{r['transfer_over_fastest']:.3f} vs default {r['default']} "
                  f"{r['default_over_fastest']:.3f} (from {r['from']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
