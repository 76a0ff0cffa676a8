"""The sort of the (token, k) pairs by expert, before the GEMMs: `triton`'s alignment
(`_align.ALIGN_TUNING`) and `triton_kernel`'s routing (`routing.ROUTING`), each as tuned by a
variant, timed alone and through the layer, in turns.

    PYTHONPATH=src python3 scripts/gpu_probe_routing.py alone [--shapes 'E,K;...']
        [--batches 1,...] [--out NAME]
    PYTHONPATH=src python3 scripts/gpu_probe_routing.py layer [--jobs 'J1;J2'] [--batches ...]
        [--out NAME]

A variant is `name:align_field=v,...|routing_field=v,...` (fields of `AlignTuning` and
`RoutingTuning`; '-' keeps a tuning as shipped); the first of --variants is the baseline.
`alone`: for each shape (local experts E, top-k K) and T, random ids (5% masked), the CUDA-graph
replay of 20 calls of `align_block_size` (block_m 64) and of `route` (block_m 128) under each
variant, us per call. `layer`: a job is `preset tp ep format backend`; `moekit bench`'s layer
and input sets with both tunings of each variant patched in. Writes $OUT/NAME.json.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import replace
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, triton_layer_points, write_probe

from moekit.bench import time_ms_interleaved
from moekit.runners import _align
from moekit.runners.triton_kernel import routing
from moekit.sweep import layer_over_sets

# the tunings before session 48 (one-program scan between the chunk kernels), then as shipped
VARIANTS = ("before:fused_max_chunks=0,single_max=256|min_chunk=1024,max_chunk=1024,"
            "max_chunks=1048576,fused_max_chunks=0;shipped:-|-")  # fmt: skip
CALLS = 20


def parse(spec: str) -> dict[str, tuple]:
    """'name:a=1,b=2|c=3;...' -> {name: (AlignTuning, RoutingTuning)}."""

    def edits(part: str) -> dict:
        return {} if part == "-" else {k: int(v) for k, v in (f.split("=") for f in part.split(","))}

    out = {}
    for item in spec.split(";"):
        name, rest = item.split(":")
        a, r = rest.split("|")
        out[name] = (replace(_align.ALIGN_TUNING, **edits(a)), replace(routing.ROUTING, **edits(r)))
    return out


def patched(tunings: tuple):
    a, r = tunings

    @contextlib.contextmanager
    def ctx():
        with mock.patch.object(_align, "ALIGN_TUNING", a), mock.patch.object(routing, "ROUTING", r):
            yield

    return ctx


def alone(variants: dict, shapes: list[tuple[int, int]], batches: list[int], save) -> dict:
    points = {}
    for E, K in shapes:
        for T in batches:
            ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices.to(torch.int32)
            ids[torch.rand(T, K, device="cuda") < 0.05] = -1
            fns = {}
            for name, tun in variants.items():
                def align(tun=tun):
                    for _ in range(CALLS):
                        _align.align_block_size(ids, E, 64, tun[0])

                def route(tun=tun):
                    with patched(tun)():
                        for _ in range(CALLS):
                            routing.route(ids, E, 128)

                fns[f"align {name}"], fns[f"route {name}"] = align, route
            ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            us = {n: round(v * 1e3 / CALLS, 2) for n, v in ms.items()}
            points[f"E={E} K={K} T={T} P={T * K}"] = us
            print(f"E={E} K={K} T={T}", us, flush=True)
            save(points)
    return points


def layer(variants: dict, jobs: list[list[str]], batches: list[int], save) -> dict:
    points = {}
    first = next(iter(variants))
    by_backend: dict[str, list] = {}
    for job in jobs:
        by_backend.setdefault(job[4], []).append(job[:4])
    for backend, js in by_backend.items():
        for point, _, module, sets in triton_layer_points(js, batches, backend=backend):
            fns = {n: layer_over_sets(module, sets, patched(t)) for n, t in variants.items()}
            ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            us = {n: round(v * 1e3 / len(sets), 2) for n, v in ms.items()}
            gain = {n: round(us[first] / v, 4) for n, v in us.items()}
            points[f"{point} {backend}"] = {"us": us, "gain_over_first": gain}
            print(point, backend, us, gain, flush=True)
            save(points)
    return points


def main() -> None:
    mode = sys.argv[1]
    variants = parse(option("--variants", VARIANTS))
    res: dict = {"command": " ".join(["python", *sys.argv]),
                 "variants": {n: [str(t) for t in v] for n, v in variants.items()}}  # fmt: skip
    name = option("--out", f"routing_{mode}") + ".json"

    def save(points: dict) -> None:  # after every point, so that a timeout keeps what was timed
        write_probe(name, {**res, "points": points})

    if mode == "alone":
        shapes = [tuple(int(v) for v in s.split(","))
                  for s in option("--shapes", "128,8;8,2;32,8;128,4").split(";")]  # fmt: skip
        batches = [int(b) for b in option("--batches", "16,64,256,1024,4096,16384").split(",")]
        alone(variants, shapes, batches, save)
    else:
        jobs = [j.split() for j in option("--jobs", "qwen3-30b-a3b 1 1 unquantized auto").split(";")]
        batches = [int(b) for b in option("--batches", "64,256,1024,4096,16384").split(",")]
        layer(variants, jobs, batches, save)


if __name__ == "__main__":
    main()
