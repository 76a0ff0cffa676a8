"""Tile size of the token-group activation quantization (`quantize_act`'s kernel) on the GPU:
the kernel alone over row widths and batch sizes, then fp8 layers with each tile, in turns.

    PYTHONPATH=src python3 scripts/gpu_probe_act_quant_tiles.py [--tiles 4096,1024]
        # writes $OUT/act_quant_tiles.json

`ActQuantTiles.max_elems` bounds the values one program quantizes: a row of H values and
groups of 128 takes cdiv(H / 128, max_elems / 128) programs. Part 1 times the kernel on x
[T, H] (bf16 -> fp8 e4m3, groups of 128) at every tile in turns (CUDA graphs) and checks that
q and the scales equal the first tile's. Part 2 times fp8 block-wise layers of the presets
(`moekit bench`'s routing and input sets) with `act_quant.TILES` set to each tile while the
call is captured: the `triton` runner at decode batches (x and h quantized by this kernel)
and `deep_gemm` at large ones (x quantized once before the gather).
"""

from __future__ import annotations

import os
import sys

import torch

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.quant import act_quant
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, build_layer, layer_over_sets

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe  # noqa: E402

WIDTHS = (768, 2048, 2880, 4096, 7168)  # the presets' H and I
KERNEL_T = (1, 4, 16, 64, 1024, 16384)
LAYERS = (  # preset, tp, ep, backend, batch sizes
    ("qwen3-30b-a3b", 1, 1, "triton", (1, 4, 16, 64)),
    ("gpt-oss-120b", 1, 1, "triton", (1, 4, 16, 64)),
    ("mixtral-8x7b", 2, 1, "triton", (1, 16)),
    ("deepseek-v3", 8, 8, "triton", (1, 16)),
    ("gpt-oss-120b", 1, 1, "deep_gemm", (4096, 16384)),
    ("qwen3-30b-a3b", 1, 1, "deep_gemm", (4096, 16384)),
)


def with_tile(fn, tile):
    """fn run with act_quant.TILES = tile (restored after)."""

    def call():
        old, act_quant.TILES = act_quant.TILES, tile
        try:
            return fn()
        finally:
            act_quant.TILES = old

    return call


def kernel_part(tiles) -> list:
    points = []
    for H in WIDTHS:
        for T in KERNEL_T:
            x = (torch.randn(T, H, device="cuda") * 3).bfloat16()

            def quant():
                return act_quant.quantize_act(x, "token_group", torch.float8_e4m3fn,
                                              group_size=128)  # fmt: skip

            outs = [with_tile(quant, t)() for t in tiles]
            same = all(torch.equal(q.float(), outs[0][0].float()) and torch.equal(s, outs[0][1])
                       for q, s in outs[1:])  # fmt: skip
            ms = time_ms_interleaved({str(t.max_elems): with_tile(quant, t) for t in tiles},
                                     "cuda", rounds=4)  # fmt: skip
            point = {"H": H, "T": T, "us": {k: round(v * 1e3, 2) for k, v in ms.items()},
                     "equal": same}  # fmt: skip
            print(point, flush=True)
            points.append(point)
    return points


def layer_part(tiles) -> list:
    points = []
    for model, tp, ep, backend, batches in LAYERS:
        spec = sweep_spec(model, tp_size=tp, ep_size=ep, quantization="fp8_w8a8",
                          batch_sizes=batches, backends=(backend,))  # fmt: skip
        module = build_layer(spec)
        module.runners = RunnerCache(RunnerConfig(backend))
        gen = torch.Generator().manual_seed(spec.seed)
        for T in batches:
            sets, _, _ = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))
            layer = layer_over_sets(module, sets)
            fns = {str(t.max_elems): with_tile(layer, t) for t in tiles}
            for fn in fns.values():
                fn()
            ms = time_ms_interleaved(fns, "cuda", rounds=6, samples=36)
            base = str(tiles[0].max_elems)
            point = {"model": model, "tp": tp, "ep": ep, "backend": backend, "T": T,
                     "sets": len(sets),
                     "us_per_call": {k: round(v * 1e3, 2) for k, v in ms.items()},
                     "ratio_to_first": {k: round(v / ms[base], 4)
                                        for k, v in ms.items()}}  # fmt: skip
            print(point, flush=True)
            points.append(point)
        del module
        torch.cuda.empty_cache()
    return points


def main() -> None:
    tiles = [act_quant.ActQuantTiles(max_elems=int(m))
             for m in option("--tiles", "4096,1024").split(",")]  # fmt: skip
    res = {"tiles": [t.max_elems for t in tiles], "kernel": kernel_part(tiles)}
    res["layers"] = layer_part(tiles)
    write_probe("act_quant_tiles.json", res)


if __name__ == "__main__":
    main()
