"""Timing and the roofline floor, shared by `moekit bench`, `moekit tune` and benchmarks/.

Floor of one MoE call = max(bytes / copy bandwidth, FLOPs / matmul rate), both ceilings measured
on the same device in the same run (`measure_ceilings`). Bytes = weights of the experts actually
touched + activations in and out; FLOPs = 2 * (routed pairs) * 3 * H * I.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

# How many input sets (x, routing) one timed point rotates over (`routings_for`): enough that
# the bytes one replay touches exceed L2_ROTATION_FACTOR L2 caches, at most MAX_INPUT_SETS.
L2_ROTATION_FACTOR = 4
MAX_INPUT_SETS = 16
# On a GPU, points of at most MULTI_ROUTING_MAX_T tokens rotate over at least MIN_ROUTINGS input
# sets (routings) whatever their bytes: there a routing gives an expert few pairs, and which
# experts one draw touches and how full their blocks are moves the time a lot (deepseek-v3 EP8
# on the H100, one routing at a time: 46-121 us at T = 4 in fp8; bf16 / fp8 at T = 16 1.83 on
# one draw, 1.66 on another, and at T = 4 over 8 draws 1.75 on one set of them, 1.63 on another;
# benchmarks/select_notes.md, session 50).
MULTI_ROUTING_MAX_T = 256
MIN_ROUTINGS = 16
# A skewed (Zipf) routing rotates over at least MIN_SKEWED_ROUTINGS draws at every T: which
# experts a draw makes hot, and on an EP rank whether they are local, moves the time at large T
# too (deepseek-v3 EP8 T = 1024 on the H100, one draw each: `triton` 1.245 and 1.009 ms;
# benchmarks/select_notes.md, session 52).
MIN_SKEWED_ROUTINGS = 4


@dataclass(frozen=True)
class Ceilings:
    """Measured device ceilings: copy bandwidth (bytes read + written per second) and dense
    matmul rate (FLOP/s) in `dtype`."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float
    dtype: str


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def floor_s(self, ceilings: Ceilings) -> float:
        return max(self.bytes / ceilings.copy_bytes_per_s, self.flops / ceilings.matmul_flops_per_s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_graph(fn: Callable[[], object], device) -> "torch.cuda.CUDAGraph":
    """fn captured in a CUDA graph, after one warm-up call on a side stream (compiles kernels,
    allocates workspaces outside the capture)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_ms(
    fn: Callable[[], object],
    device: torch.device | str,
    *,
    cuda_graph: bool = True,
    warmup: int = 5,
    samples: int = 25,
    min_sample_ms: float = 1.0,
) -> float:
    """Median time of one `fn()` call in milliseconds.

    CUDA: after warm-up, `fn` is captured in a CUDA graph (if `cuda_graph`) and replayed; each
    sample times enough replays to last about `min_sample_ms` with CUDA events. CPU: wall clock.
    To time over inputs larger than L2, let `fn` run over several input sets and divide.
    """
    return time_ms_interleaved({"fn": fn}, device, cuda_graph=cuda_graph, rounds=1,
                               warmup=warmup, samples=samples,
                               min_sample_ms=min_sample_ms)["fn"]  # fmt: skip


def round_orders(n: int, rounds: int) -> list[list[int]]:
    """The order of n functions in each round of `time_ms_interleaved`: rows of a Williams
    design (a Latin square, with its mirror for odd n), in which every function runs right
    after every other one equally often. A plain rotation would not do that: in [a, b, c] then
    [b, c, a] then [c, a, b], c follows b in every round but the one it opens. `rounds` is
    rounded to whole designs (n rows for even n, 2n for odd n) where it exceeds 1; with
    rounds 1, the first row."""
    base = [0] + [(i + 1) // 2 if i % 2 else n - i // 2 for i in range(1, n)]
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    if rounds <= 1:
        return rows[:1]
    return rows * max(1, round(rounds / len(rows)))


def time_ms_interleaved(
    fns: Mapping[str, Callable[[], object]],
    device: torch.device | str,
    *,
    cuda_graph: bool | Mapping[str, bool] = True,
    rounds: int | None = None,
    warmup: int = 5,
    samples: int = 25,
    min_sample_ms: float = 1.0,
) -> dict[str, float]:
    """Median time of one call of each `fns[name]` in milliseconds, as `time_ms`, with the
    samples taken in turns: about `rounds` rounds (default: as many as `samples`, one sample of
    each function a round), each a share of every function's samples, in the orders of
    `round_orders`, so that what ran just before a kernel (the GPU's clocks and power state, the
    caches) and when in the timing it ran weigh on every function alike: on the H100 the same
    deep_gemm call timed 9% faster right after a `triton` call than after itself
    (benchmarks/deep_gemm_notes.md). `cuda_graph`: one flag, or one per name."""
    device = torch.device(device)
    names = list(fns)
    graph = cuda_graph if isinstance(cuda_graph, Mapping) else dict.fromkeys(names, cuda_graph)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    _sync(device)
    rounds = samples if rounds is None else rounds
    orders = [[names[i] for i in row] for row in round_orders(len(names), rounds)]
    per_round = max(1, round(samples / len(orders)))
    sample = _cpu_sampler(fns) if device.type != "cuda" else _cuda_sampler(
        fns, device, graph, min_sample_ms)  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in orders:
        for name in order:
            for _ in range(per_round):
                times[name].append(sample(name))
    return {name: statistics.median(t) for name, t in times.items()}


def _cpu_sampler(fns: Mapping[str, Callable[[], object]]) -> Callable[[str], float]:
    """name -> milliseconds of one call, by the host clock."""

    def sample(name: str) -> float:
        t0 = time.perf_counter()
        fns[name]()
        return (time.perf_counter() - t0) * 1e3

    return sample


def _cuda_sampler(fns: Mapping[str, Callable[[], object]], device: torch.device,
                  graph: Mapping[str, bool], min_sample_ms: float) -> Callable[[str], float]:
    """name -> milliseconds of one call, by CUDA events around enough back-to-back calls
    (CUDA-graph replays where `graph[name]`) to take about `min_sample_ms`."""
    runs = {name: capture_graph(fn, device).replay if graph[name] else fn
            for name, fn in fns.items()}  # fmt: skip
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(run: Callable[[], object], reps: int) -> float:
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    reps = {name: max(1, int(min_sample_ms / max(timed(run, 1), 1e-3)))
            for name, run in runs.items()}  # fmt: skip
    return lambda name: timed(runs[name], reps[name])


def best_ms(fn: Callable[[], object], device: torch.device | str) -> float:
    """A ceiling's time: the fastest of three medians (`time_ms`, samples of at least 2 ms) on
    a GPU, one median on CPU. A ceiling is the best the device does; one short median read
    17% low once on the H100 (copy 2.45 TB/s, against 2.87-2.98 in the other jobs of that run)."""
    device = torch.device(device)
    if device.type != "cuda":
        return time_ms(fn, device, cuda_graph=False, samples=10)
    return min(time_ms(fn, device, cuda_graph=False, warmup=10, samples=10, min_sample_ms=2.0)
               for _ in range(3))  # fmt: skip


def routings_for(T: int, set_bytes: float, l2_bytes: int, skewed: bool = False) -> int:
    """How many input sets (routings) to time a point of T tokens on, each touching about
    `set_bytes`: enough that one replay's bytes exceed L2_ROTATION_FACTOR L2 caches, at least
    MIN_ROUTINGS for 0 < T <= MULTI_ROUTING_MAX_T, at least MIN_SKEWED_ROUTINGS for a `skewed`
    routing with T > 0, at most MAX_INPUT_SETS; one where `l2_bytes` is 0 (CPU: nothing to
    rotate past). `moekit bench` and `moekit tune` both count so."""
    if not l2_bytes:
        return 1
    n = math.ceil(L2_ROTATION_FACTOR * l2_bytes / set_bytes) if set_bytes > 0 else 1
    if 0 < T <= MULTI_ROUTING_MAX_T:
        n = max(n, MIN_ROUTINGS)
    if skewed and T > 0:
        n = max(n, MIN_SKEWED_ROUTINGS)
    return min(MAX_INPUT_SETS, n)


def l2_cache_bytes(device: torch.device | str) -> int:
    """The L2 cache size of the current CUDA device; 0 for any other device (nothing to rotate
    past)."""
    if torch.device(device).type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 << 20))


def measure_ceilings(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """Copy bandwidth and dense matmul rate of `device`, measured now (about a second on GPU)."""
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    n_bytes = (1 << 30) if on_gpu else (64 << 20)
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = best_ms(lambda: dst.copy_(src), device)
    n = 8192 if on_gpu else 512
    a = torch.randn(n, n, device=device, dtype=dtype if on_gpu else torch.float32)
    b = torch.randn(n, n, device=device, dtype=a.dtype)
    mm_ms = best_ms(lambda: a @ b, device)
    return Ceilings(
        copy_bytes_per_s=2 * n_bytes / (copy_ms * 1e-3),
        matmul_flops_per_s=2 * n**3 / (mm_ms * 1e-3),
        dtype=str(a.dtype).removeprefix("torch."),
    )


def moe_cost(
    topk_ids_TK: torch.Tensor,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    act_bytes: float = 2,
    weight_bytes_per_expert: float | None = None,
) -> Cost:
    """Cost of one MoE call on one rank for routing `topk_ids_TK` (ids of -1 or >= num_experts
    are not computed here). Weight bytes default to 3 * H * I * act_bytes per touched expert."""
    ids = topk_ids_TK.reshape(-1)
    local = ids[(ids >= 0) & (ids < num_experts)]
    pairs = local.numel()
    touched = torch.unique(local).numel()
    H, I = hidden_size, intermediate_size
    per_expert = weight_bytes_per_expert if weight_bytes_per_expert is not None else 3 * H * I * act_bytes
    T = topk_ids_TK.shape[0]
    return Cost(
        flops=2.0 * pairs * 3 * H * I,
        bytes=touched * per_expert + 2 * T * H * act_bytes,
    )



# Weight formats whose GEMMs run on 8-bit tensor cores: their floor uses that matmul rate.
EIGHT_BIT_MATMUL = {"fp8_w8a8": "float8_e4m3fn", "int8_w8a8": "int8"}


def measure_matmul_rate(device: torch.device | str, kind: str, n: int = 8192) -> float | None:
    """Dense [n, n] x [n, n] matmul rate (FLOP/s) on 8-bit tensor cores of a CUDA device:
    kind 'float8_e4m3fn' (torch._scaled_mm, bf16 out) or 'int8' (torch._int_mm, int32 out).
    None where this torch / GPU cannot run it."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        if kind == "float8_e4m3fn":
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)

            def fn():
                return torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)

        elif kind == "int8":
            a8 = a.clamp(-127, 127).to(torch.int8)
            b8 = b.clamp(-127, 127).to(torch.int8)

            def fn():
                return torch._int_mm(a8, b8.t())

        else:
            raise ValueError(f"kind: unknown {kind!r}; allowed: float8_e4m3fn, int8")
        ms = best_ms(fn, device)
    except (RuntimeError, TypeError, AttributeError):
        return None
    return 2 * n**3 / (ms * 1e-3)


def ceilings_for_format(
    device: torch.device | str, dtype: torch.dtype, weight_format: str = "unquantized"
) -> Ceilings:
    """`measure_ceilings`, with the matmul rate of the 8-bit tensor cores for the w8a8 formats
    (where it can be measured; else the `dtype` rate, and `Ceilings.dtype` says which)."""
    ceilings = measure_ceilings(device, dtype)
    kind = EIGHT_BIT_MATMUL.get(weight_format)
    rate = measure_matmul_rate(device, kind) if kind else None
    if rate is None:
        return ceilings
    return Ceilings(ceilings.copy_bytes_per_s, rate, kind)
