"""Measured `w4a16` plans as data: for one layer shape, weight format and device, the fastest
(gate_up, down) plan pair (ring or direct, and the share of each) at a few batch sizes, timed
on the GPU by `scripts/gpu_w4a16_profile.py tune` as the runner launches the pair (down may
start during gate_up's tail, which timing each GEMM alone does not see; src/moekit/configs/
w4a16/*.json).

The cost model (`jit.plan`) ranks shares well but cannot say when the direct path beats the
ring (benchmarks/w4a16_notes.md, session 24); a measured plan can. `plans_for` takes the
batch size nearest the call's (within a factor TABLE_REACH), else None: the model decides.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.log import log_once
from moekit.runners._tables import device_slug, nearest_batch, parse_key, quant_tag
from moekit.runners.w4a16.jit import Plan

TABLE_REACH = 2.0
GEMMS = ("gate_up", "down")


@functools.cache
def table_dir() -> Path:
    """The shipped tables: src/moekit/configs/w4a16/ (resolved once: the runner looks a plan
    up on every call)."""
    return Path(__file__).resolve().parents[2] / "configs" / "w4a16"


def table_name(num_experts: int, top_k: int, hidden: int, intermediate: int, act: str,
               interleaved: bool, quant: str, device: str) -> str:  # fmt: skip
    """e.g. E=128,K=8,H=2048,I=768,act=silu,quant=mxfp4,device=NVIDIA_H100_80GB_HBM3.json
    (quant: `_tables.quant_tag` of the weights)."""
    a = act + ("-interleaved" if interleaved else "")
    return (f"E={num_experts},K={top_k},H={hidden},I={intermediate},act={a},quant={quant},"
            f"device={device_slug(device)}.json")  # fmt: skip


def table_name_for(w: ExpertWeights, top_k: int, act: ActivationSpec, device: str) -> str:
    """`table_name` of a layer's weights (device: the GPU's name)."""
    return table_name(w.num_experts, top_k, w.hidden_size, w.intermediate_size, act.name,
                      act.interleaved, quant_tag(w.spec), device)  # fmt: skip


Table = dict  # {batch-size key: (gate_up Plan, down Plan)}


@functools.cache
def read_table(path: Path) -> Table | None:
    """{batch-size key: (gate_up plan, down plan)} of one file, None if it does not exist;
    errors name the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        table = {parse_key(b): tuple(Plan(**p[g]) for g in GEMMS)
                 for b, p in data["plans"].items()}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"bad w4a16 plan file {path}: {err}") from err
    if not table:
        raise ValueError(f"bad w4a16 plan file {path}: no batch-size keys")
    log_once(logging.INFO, f"w4a16 runner: measured plans from {path.name}")
    return table


def plans_for(name: str, num_tokens: float, directory: Path | None = None
              ) -> tuple[Plan, Plan] | None:  # fmt: skip
    """(gate_up, down) plans of table `name` at the measured batch size nearest `num_tokens`
    (tokens' worth of local pairs: `_tables.table_key`), None without a table or one
    within a factor TABLE_REACH."""
    table = read_table((directory or table_dir()) / name)
    if table is None:
        return None
    best = nearest_batch(table, num_tokens, TABLE_REACH)
    return None if best is None else table[best]


def write_table(path: Path, plans: Table, meta: dict) -> None:
    """Writes {batch-size key: (gate_up, down)} plans with `meta` (what was measured, and
    where)."""
    data = {
        "plans": {str(k): {g: dataclasses.asdict(p) for g, p in zip(GEMMS, v, strict=True)}
                  for k, v in sorted(plans.items())},
        "meta": meta,
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    read_table.cache_clear()
