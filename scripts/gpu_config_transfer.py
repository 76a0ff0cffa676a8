"""Configs for shapes without a tuned table: the nearest tuned shape against the heuristic.

    PYTHONPATH=src python3 scripts/gpu_config_transfer.py [--jobs 'J1;J2'] [--batches 1,4,...]
        [--out NAME]

A job is `preset tp ep format` (e.g. 'deepseek-v3 8 8 fp8_w8a8'). Per job and batch size T,
the layer (MoE.forward_topk, `triton` runner, CUDA-graph replay, the bench's input sets) runs
with the configs of:
  table     what the runner looks up as shipped (the shape's own table where there is one)
  old       what it looked up before `configs.transferred` for a shape without a table of its
            own: the heuristic `default_config` (unquantized), or the unquantized config of the
            shape adapted to the format (`adapt_config`)
  nearest   `configs.transferred` with the shape's own tables (this format, this device) left
            out: the nearest other tuned shape on this device (leave one out)
  other-gpu the tables of another device of the same compute capability only (--other,
            default 'NVIDIA H200'): the same shape tuned there, as a device without tables
            of its own would take them
timed in turns (`time_ms_interleaved`); each variant's output is checked against `table`'s
on the first input set. Writes $OUT/NAME.json (default config_transfer.json).
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, triton_layer_points, write_probe

from moekit.bench import time_ms_interleaved
from moekit.runners._tables import quant_tag
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton import ops
from moekit.sweep import layer_over_sets

JOBS = ("qwen3-30b-a3b 1 1 unquantized;mixtral-8x7b 2 1 unquantized;"
        "deepseek-v3 8 8 unquantized;gpt-oss-120b 1 1 unquantized;"
        "qwen3-30b-a3b 1 1 fp8_w8a8;deepseek-v3 8 8 fp8_w8a8;"
        "qwen3-235b-a22b 1 1 unquantized")  # fmt: skip
BATCHES = "1,4,16,64,256,1024,4096,16384"


def resolvers(w, device_name: str, other: str) -> dict:
    """variant -> context in which `ops.configs_for` resolves as that variant says."""
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
    own = {(E, *tcfg.gemm_shape(g, H, I)) for g in tcfg.GEMMS}
    fmt = quant_tag(w.spec)
    real_find = tcfg.find_table.__wrapped__
    shapes = tcfg.tuned_shapes()

    def is_own(key, quant=fmt):
        return (key.num_experts, key.n, key.k) in own and key.quant == quant

    def patched(find, shapes_, transfer=True):
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(tcfg, "find_table", find))
        stack.enter_context(mock.patch.object(tcfg, "tuned_shapes", lambda: shapes_))
        if not transfer:
            stack.enter_context(mock.patch.object(tcfg, "transferred", lambda *a: None))
        return stack

    # this format's own tables on this device are hidden; the unquantized ones stay
    def hide_own(key, num_tokens=None):
        return None if is_own(key) and key.device == device_name else real_find(key, num_tokens)

    def only_other(key, num_tokens=None):
        return None

    return {
        "table": contextlib.nullcontext,
        "old": lambda: patched(hide_own, shapes, transfer=False),
        "nearest": lambda: patched(hide_own, tuple(
            s for s in shapes if s.key.device == device_name and not is_own(s.key))),
        "other-gpu": lambda: patched(only_other, tuple(s for s in shapes if s.key.device == other)),
    }


def main() -> None:
    jobs = [j.split() for j in option("--jobs", JOBS).split(";")]
    batches = [int(b) for b in option("--batches", BATCHES).split(",")]
    other = option("--other", "NVIDIA H200")
    out_name = option("--out", "config_transfer.json")
    real_configs_for = ops.configs_for
    device_name = torch.cuda.get_device_name()
    res = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for point, _, module, sets in triton_layer_points(jobs, batches):
        picked: dict[str, dict] = {}

        def resolved(name, ctx, picked=picked):
            """ops.configs_for as variant `name` resolves it (caches cleared around)."""

            def configs_for(num_tokens, top_k, w, dtype, device):
                tcfg.clear_cache()
                with ctx():
                    cfgs = real_configs_for(num_tokens, top_k, w, dtype, device)
                tcfg.clear_cache()
                picked[name] = {"gate_up": cfgs[0].code(), "down": cfgs[1].code()}
                return cfgs

            return lambda: mock.patch.object(ops, "configs_for", configs_for)

        variants = resolvers(module.expert_weights, device_name, other)
        fns = {n: layer_over_sets(module, sets, resolved(n, c)) for n, c in variants.items()}
        x, topk = sets[0]
        outs = {}
        for n, c in variants.items():  # each variant once, eagerly, on the first set
            with torch.no_grad(), resolved(n, c)():
                outs[n] = module.forward_topk(x, topk).float()
        ref = outs["table"]
        scale = ref.abs().max().clamp_min(1e-6)
        err = {n: round(((o - ref).abs().max() / scale).item(), 5) for n, o in outs.items()}
        ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
        us = {n: round(v * 1e3 / len(sets), 2) for n, v in ms.items()}
        res["points"][point] = {"us": us, "configs": picked, "max_rel_err_vs_table": err}
        print(point, us, err, flush=True)
        write_probe(out_name, res)
    write_probe(out_name, res)


if __name__ == "__main__":
    main()
