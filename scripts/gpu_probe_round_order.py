"""Does the order of the rounds bias `moekit.bench.time_ms_interleaved`? (sessions 54-55)

    PYTHONPATH=src python3 scripts/gpu_probe_round_order.py [--jobs "MODEL TP EP FMT T B1,B2,...;..."]
        [--variants "rotation:5,balanced:5"] [--repeats 3] [--out NAME]   # writes $OUT/NAME

For each job: the layer on each listed backend over the same input sets (`moekit bench`'s), all
timed together by `time_ms_interleaved`. A backend listed twice gets a second RunnerCache, so
a second CUDA graph of the same kernels. Each variant ORDER:ROUNDS is timed `--repeats` times,
the variants in turns: ORDER `rotation` is the order of rounds the function used before session
54 ([a, b, c], [b, c, a], ...: a twin always runs right after its original), `balanced` is
`round_orders` (every function after every other equally often); ROUNDS is the function's
`rounds` (5, its default; as many as the samples: one sample a function per round). Prints
each name's time over the first-listed copy of its backend: identical kernels should read 1.00.
"""

from __future__ import annotations

import sys

import torch

from moekit import bench
from moekit.config import RunnerConfig
from moekit.layer import RunnerCache
from moekit.select_tune import sweep_spec
from moekit.sweep import _input_sets, _runners, build_layer, layer_over_sets

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from probe_out import option, write_probe  # noqa: E402

JOBS = ("mixtral-8x7b 2 1 fp8_w8a8 16384 triton_kernel,deep_gemm,deep_gemm;"
        "gpt-oss-120b 1 1 fp8_w8a8 1024 triton,triton_kernel,triton_kernel;"
        "qwen3-30b-a3b 1 1 unquantized 16384 triton,triton_kernel,triton_kernel")  # fmt: skip


def rotation(n: int, rounds: int) -> list[list[int]]:
    """The rounds' orders before session 54: round r starts at function r."""
    return [[(i + r) % n for i in range(n)] for r in range(max(1, rounds))]


ORDERS = {"rotation": rotation, "balanced": bench.round_orders}


def main() -> None:
    repeats = int(option("--repeats", "3"))
    variants = option("--variants", "rotation:5,balanced:5").split(",")
    points = []
    for job in option("--jobs", JOBS).split(";"):
        model, tp, ep, fmt, T, backends = job.split()
        spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), quantization=fmt,
                          batch_sizes=(int(T),), device="cuda", backends=("triton",))  # fmt: skip
        module = build_layer(spec)
        gen = torch.Generator().manual_seed(0)
        sets, _, _ = _input_sets(spec, module, int(T), gen, bench.l2_cache_bytes("cuda"))
        fns, first = {}, {}
        for b in backends.split(","):
            name = b if b not in fns else f"{b}#2"
            cache = RunnerCache(RunnerConfig(b))
            fns[name] = layer_over_sets(module, sets, lambda c=cache, m=module: _runners(m, c))
            first.setdefault(b, name)
            fns[name]()  # first call: compile, select
        runs = {v: [] for v in variants}
        for _ in range(repeats):
            for variant in variants:
                order, rounds = variant.split(":")
                bench.round_orders = ORDERS[order]
                ms = bench.time_ms_interleaved(fns, "cuda", rounds=int(rounds))
                runs[variant].append(ms)
                rel = {n: ms[n] / ms[first[n.split("#")[0]]] for n in fns}
                print(f"{job:70s} {variant:12s} " + "  ".join(
                    f"{n} {ms[n]:.4f} ms ({rel[n]:.3f})" for n in fns), flush=True)  # fmt: skip
        bench.round_orders = ORDERS["balanced"]
        points.append({"job": job, "input_sets": len(sets), "ms": runs})
        del module, fns, sets
        torch.cuda.empty_cache()
    write_probe(option("--out", "round_order.json"), {"points": points, "argv": sys.argv[1:]})


if __name__ == "__main__":
    main()
