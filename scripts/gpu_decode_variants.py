"""Decode-batch variants of the `triton` runner's tuned configs, timed through the layer in turns.

    PYTHONPATH=src python3 scripts/gpu_decode_variants.py [--jobs 'J1;J2'] [--batches 1,4,16,64]
        [--min-gain 1.03] [--variants split|down-split|sweep|row1|pairs|wide] [--tiles 'bn,bk,w,s;...']
        [--pairs 'NAME=GATE_UP,DOWN;...'] [--seed 0] [--out NAME]

A job is `preset tp ep format` (e.g. 'deepseek-v3 8 8 fp8_w8a8'). Per job and batch size T, the
layer (MoE.forward_topk, `triton` runner, CUDA-graph replay, the input sets rotated as `moekit
bench` does) runs with the configs its tables give (`table`) and with these changes of them:
  splitS      (--variants split, the default) gate_up split over K into S shares (S = 2, 4,
              8; `GemmConfig.split_k`)
  down splitS (--variants down-split) the down GEMM split over K into S shares (2, 4; atomic)
  GEMM FIELD  (--variants sweep) one GEMM's config changed in one field (`_neighbours`)
  row1 ...    (--variants row1) both GEMMs with one pair per program (`GemmConfig.block_m`
              1: products summed on the CUDA cores), the table's tiles or those named
              (ROW1_TILES, or --tiles)
  gate_up bn128 [split2] (--variants wide) gate_up at least 128 columns wide (fp8 block-wise:
              h quantized in its epilogue, `ops.h_quant_dtype`), also split over K in 2
  NAME        (--variants pairs) the configs --pairs names, as `moekit tune` logs them
              (`GemmConfig.code`: m128n64k128g8w8s3 = block_m 128, block_n 64, block_k 128,
              group_m 8, 8 warps, 3 stages; then T swap_ab, A atomic reduce, M TMA, K<n>
              split-K); '-' keeps the table's config of that GEMM
timed in turns (`time_ms_interleaved`) on the routings drawn from --seed (per job, batch sizes
in order). Where a variant beats `table` by at least --min-gain,
the table gets an entry for the call's own key (T x local share) with it, in $OUT/cfg/triton
(copies of the shipped tables; meta.decode_variants records the timings). Writes $OUT/NAME.json and
$OUT/NAME_cfg.tgz (NAME: --out, default decode_variants).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

OUT = Path(os.environ.get("OUT", "."))
CFG = OUT / "cfg"
os.environ["MOEKIT_CONFIG_DIR"] = str(CFG)  # before moekit reads it

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import triton_layer_points  # noqa: E402

from moekit.bench import time_ms_interleaved
from moekit.report import metadata
from moekit.runners._tables import quant_tag, table_key, triton_version
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton.configs import GemmConfig
from moekit.runners.triton import ops
from moekit.sweep import layer_over_sets

JOBS = ("deepseek-v3 8 8 unquantized;deepseek-v3 8 8 fp8_w8a8;qwen3-30b-a3b 1 1 fp8_w8a8;"
        "qwen3-30b-a3b 1 1 unquantized")  # fmt: skip


def _option(name: str, default: str) -> str:
    args = sys.argv[1:]
    return args[args.index(name) + 1] if name in args else default


ROW1_TILES = (
    (16, 256, 2, 3),
    (32, 256, 4, 3),
    (64, 128, 4, 3),
    (32, 512, 4, 2),
    (16, 512, 4, 2),
    (16, 1024, 4, 2),
    (16, 256, 4, 4),
)


def variants(kind: str = "split") -> dict:
    """name -> f(gate_up config, down config) -> (gate_up config, down config). kind 'split':
    gate_up split over K; 'down-split': down split over K; 'row1': both GEMMs with one pair per program (block_m 1, products
    on the CUDA cores), with the table's tiles and with the tiles of ROW1_TILES."""
    out = {"table": lambda c1, c2: (c1, c2)}
    if kind == "pairs":
        for item in _option("--pairs", "").split(";"):
            name, codes = item.split("=")
            gu, dn = (None if c == "-" else GemmConfig.from_code(c) for c in codes.split(","))
            out[name] = lambda c1, c2, gu=gu, dn=dn: (gu or c1, dn or c2)
        return out
    if kind == "sweep":
        for gi, gemm in enumerate(("gate_up", "down")):
            for label, edit in _neighbours(gemm):
                def pick(c1, c2, gi=gi, edit=edit):
                    pair = [c1, c2]
                    pair[gi] = edit(pair[gi])
                    return tuple(pair)

                out[f"{gemm} {label}"] = pick
        return out
    if kind == "wide":  # gate_up tiles of whole activation groups: h quantized in its epilogue
        wide = lambda c: replace(c, block_n=max(c.block_n, 128))  # noqa: E731
        out["gate_up bn128"] = lambda c1, c2: (wide(c1), c2)
        out["gate_up bn128 split2"] = lambda c1, c2: (replace(wide(c1), split_k=2), c2)
        return out
    if kind == "split":
        for s in (2, 4, 8):
            out[f"split{s}"] = lambda c1, c2, s=s: (replace(c1, split_k=s), c2)
        return out
    if kind == "down-split":
        for s in (2, 4):
            out[f"down split{s}"] = lambda c1, c2, s=s: (
                c1,
                replace(c2, reduce="atomic", split_k=s),
            )
        return out

    def row1(c, tile=None):
        c = replace(c, block_m=1, swap_ab=False)
        if tile:
            bn, bk, warps, stages = tile
            c = replace(c, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, tma=False)
        return c

    out["row1"] = lambda c1, c2: (row1(c1), row1(c2))
    tiles = ROW1_TILES
    if "--tiles" in sys.argv:  # 'bn,bk,warps,stages;...'
        tiles = [tuple(int(v) for v in t.split(",")) for t in _option("--tiles", "").split(";")]
    for t in tiles:
        out["row1 n{}k{}w{}s{}".format(*t)] = lambda c1, c2, t=t: (row1(c1, t), row1(c2, t))
    return out


def _neighbours(gemm: str):
    """(label, edit) pairs: one GEMM's config changed in one field around the table's (--variants
    sweep): pipeline stages 2-8, block_n halved / doubled, TMA and warps flipped, split over K
    (gate_up; the down GEMM with the atomic reduction)."""
    out = [(f"s{s}", lambda c, s=s: replace(c, num_stages=s)) for s in range(2, 9)]
    out += [("bn/2", lambda c: replace(c, block_n=max(16, c.block_n // 2))),
            ("bn*2", lambda c: replace(c, block_n=c.block_n * 2)),
            ("tma flip", lambda c: replace(c, tma=not c.tma)),
            ("warps flip", lambda c: replace(c, num_warps=8 if c.num_warps == 4 else 4))]  # fmt: skip
    for s in (2, 4):
        if gemm == "gate_up":
            out.append((f"split{s}", lambda c, s=s: replace(c, split_k=s)))
        else:
            out.append((f"split{s}", lambda c, s=s: replace(c, reduce="atomic", split_k=s)))
    return out


def looked_up(gemm: str, w, T_local: float, dtype: torch.dtype):
    """(table path, key for the call) for the call's config of `gemm`: the table it came from
    and the call's own batch-size key T_local (`_tables.table_key`; a new entry when the
    lookup took a neighbouring one, so that batch sizes sharing that neighbour keep theirs).
    None when no table of the weights' own format holds it (heuristic, or adapted from the
    unquantized table)."""
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
    n, k = tcfg.gemm_shape(gemm, H, I)
    key = tcfg.TableKey(gemm, E, n, k, ops._TL_DTYPES[dtype], torch.cuda.get_device_name(),
                        triton_version(), quant_tag(w.spec))  # fmt: skip
    table = tcfg.find_table(key)
    if table is None or T_local > tcfg.TABLE_SPAN_REACH * max(table.configs):
        return None
    return Path(table.source), table_key(T_local)


def main() -> None:
    jobs = [j.split() for j in _option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in _option("--batches", "1,4,16,64").split(",")]
    min_gain = float(_option("--min-gain", "1.03"))
    kind = _option("--variants", "split")
    seed = int(_option("--seed", "0"))
    out_name = _option("--out", "decode_variants")
    (CFG / "triton").mkdir(parents=True, exist_ok=True)
    for f in tcfg.shipped_dir().glob("*.json"):
        shutil.copy(f, CFG / "triton" / f.name)
    tcfg.clear_cache()
    res = {"meta": metadata(command=" ".join(["python", *sys.argv])), "points": {}}
    edits: dict[Path, dict] = {}
    real_configs_for = ops.configs_for
    for name, T, module, sets in triton_layer_points(jobs, batches, seed):
        seen = {}

        def make(change, seen=seen, sets=sets, module=module):
            def configs_for(num_tokens, top_k, w, dtype, device):
                seen["args"] = (num_tokens, top_k, w, dtype, device)
                return change(*real_configs_for(num_tokens, top_k, w, dtype, device))

            return layer_over_sets(
                module, sets, lambda: mock.patch.object(ops, "configs_for", configs_for)
            )

        fns = {n: make(c) for n, c in variants(kind).items()}
        for n in list(fns):  # a variant that does not compile or run is left out, with why
            try:
                fns[n]()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 (probe: report and go on)
                print(name, n, "left out:", type(e).__name__, str(e)[:160], flush=True)
                del fns[n]
        ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
        us = {n: round(v * 1e3 / len(sets), 2) for n, v in ms.items()}
        best = min(us, key=us.get)
        gain = us["table"] / us[best]
        res["points"][name] = {"us": us, "best": best, "gain": round(gain, 4)}
        print(name, us, "->", best, f"{gain:.3f}", flush=True)
        (OUT / f"{out_name}.json").write_text(json.dumps(res, indent=1))
        if best == "table" or gain < min_gain:
            continue
        T_local, _, weights, act_dtype, _ = seen["args"]
        base = real_configs_for(*seen["args"])
        for gemm, cfg, was in zip(("gate_up", "down"), variants(kind)[best](*base), base):
            if cfg == was:
                continue
            where = looked_up(gemm, weights, T_local, act_dtype)
            if where is None:
                res["points"][name]["not_applied"] = f"{gemm}: no table of this format"
                continue
            path, key = where
            e = edits.setdefault(path, {})
            e[key] = (cfg, {"variant": best, "T": T, "us": us})
    for path, changes in edits.items():
        table = tcfg.read_table(path)
        data = json.loads(path.read_text())
        configs = dict(table.configs)
        notes = data["meta"].setdefault("decode_variants", {})
        for key, (cfg, note) in changes.items():
            configs[key] = cfg
            notes[str(key)] = dict(note, commit=res["meta"].get("commit"),
                                   script="scripts/gpu_decode_variants.py")  # fmt: skip
        tcfg.write_table(path, tcfg.TableKey(**data["key"]), configs, data["meta"])
        res.setdefault("edited", []).append(path.name)
    (OUT / f"{out_name}.json").write_text(json.dumps(res, indent=1))
    with tarfile.open(OUT / f"{out_name}_cfg.tgz", "w:gz") as tar:
        for path in edits:
            tar.add(path, arcname=f"triton/{path.name}")


if __name__ == "__main__":
    main()
