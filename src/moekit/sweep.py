"""The batch-size sweep of `moekit bench`: time one MoE layer over batch sizes and backends.

What is timed: `MoE.forward_topk(x_TH, topk)` on rank 0 of the parallel layout, with the routing
(`TopKOutput`) computed beforehand, so the router is not timed; dispatch (the `none` dispatcher's
id remap), the runner and combine are. Per-rank shapes: E_local = E / ep experts (routing is over
all E experts and ids not on rank 0 are masked to -1), I_local = I / (tp / ep).

Each point (backend, T) gets: the median time (CUDA-graph replay where the runner is graph safe;
the backends of one T timed in alternating rounds, `moekit.bench.time_ms_interleaved`), the
roofline cost of the actual routing on this rank
(`moekit.bench.moe_cost`: FLOPs of the local (token, expert) pairs, bytes of the touched local
experts' weights + activations in and out), and time / floor with ceilings measured in the same
run. Each backend's output is compared with the reference runner `torch` (relative norm error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from moekit import hardware
from moekit.bench import (
    Ceilings,
    Cost,
    ceilings_for_format,
    l2_cache_bytes,
    moe_cost,
    routings_for,
    time_ms_interleaved,
)
from moekit.config import RUNNER_BACKENDS, ConfigError, MoEConfig, ParallelConfig, RunnerConfig
from moekit.experts import ExpertWeights
from moekit.layer import MoE, RunnerCache, workload_of
from moekit.quant.spec import QuantSpec, format_text, make_spec
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.select import Workload, select_runner, why_not

ROUTINGS = ("uniform", "zipf")
TIMED = "MoE.forward_topk: dispatch + experts + combine on rank 0; routing precomputed, not timed"

GPU_BATCH_SIZES = (1, 4, 16, 64, 256, 1024, 4096, 16384)
CPU_BATCH_SIZES = (1, 4, 16, 64, 256)
# The shape a CPU run uses instead of the preset's: H, I per moe-tp rank, at most this many E.
CPU_SHAPE = dict(hidden_size=256, intermediate_size=128, max_experts=16)
# CPU timing is wall clock with few samples, in one round; CUDA uses time_ms_interleaved's
# defaults.
CPU_TIMING = dict(warmup=2, samples=7, rounds=1)
# rel error vs the torch runner above which a point is flagged as suspicious, per dtype.
SUSPICIOUS_REL_ERR = {"float32": 1e-2, "float16": 5e-2, "bfloat16": 5e-2}


class BudgetExceeded(RuntimeError):
    """A point skipped because it would not end within the sweep's time budget."""


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep. `moe` is the (global) shape actually run: the preset's, or its CPU
    scale-down when `scaled_down`. `backends`: runner names to try (may include 'auto')."""

    preset: str
    moe: MoEConfig
    parallel: ParallelConfig
    batch_sizes: tuple[int, ...]
    backends: tuple[str, ...]
    device: str
    routing: str = "uniform"
    zipf_s: float = 1.2
    scaled_down: bool = False
    seed: int = 0
    time_budget_s: float | None = None
    weight_spec: QuantSpec | None = None  # moe.weight_format's spec (None: its default)

    def __post_init__(self) -> None:
        if self.weight_spec is None:
            object.__setattr__(self, "weight_spec", make_spec(self.moe.weight_format))
        elif self.weight_spec.name != self.moe.weight_format:
            raise ConfigError(f"SweepSpec: weight_spec {self.weight_spec.describe()} is not the "
                              f"config's weight format {self.moe.weight_format!r}")  # fmt: skip
        if self.routing not in ROUTINGS:
            raise ConfigError(
                f"--routing: unknown value {self.routing!r}; allowed: {', '.join(ROUTINGS)}"
            )
        if self.routing == "zipf" and not self.zipf_s > 0:
            raise ConfigError(f"--zipf-s must be > 0, got {self.zipf_s}")
        if not self.batch_sizes or any(t < 0 for t in self.batch_sizes):
            raise ConfigError(
                f"--batch-sizes: need one or more integers >= 0, got {list(self.batch_sizes)}"
            )
        for b in self.backends:
            if b not in RUNNER_BACKENDS:
                raise ConfigError(
                    f"--backends: unknown value {b!r}; allowed: all, {', '.join(RUNNER_BACKENDS)}"
                )

    @property
    def quantization(self) -> str:
        """The weight format as --quantization writes it (with its non-default parameters)."""
        return format_text(self.weight_spec)

    @property
    def e_local(self) -> int:
        return self.moe.total_experts // self.parallel.ep_size

    @property
    def i_local(self) -> int:
        return self.moe.intermediate_size // self.parallel.moe_tp_size


@dataclass
class Record:
    """One measured point. Times in ms; flops/bytes of this rank's share; rel_err against the
    `torch` runner on the same inputs; `error` set (and the numbers None) when the point failed
    or was skipped."""

    backend: str
    T: int
    ms: float | None = None
    floor_ms: float | None = None
    time_over_floor: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    flops: float = 0.0
    bytes: float = 0.0
    pairs: int = 0
    touched_experts: int = 0
    max_expert_load: int = 0
    input_sets: int = 1
    cuda_graph: bool = False
    chosen: str | None = None  # for 'auto': the backend it ran
    rel_err: float | None = None
    suspicious: bool = False
    error: str | None = None


@dataclass
class SweepResult:
    spec: SweepSpec
    ceilings: Ceilings
    records: list[Record]
    skipped: dict[str, str]  # backend -> why it was not run
    auto_choice: dict[int, str]  # T -> what `auto` picks for that workload (or the error)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- shapes and routing


def cpu_scaled(moe: MoEConfig, parallel: ParallelConfig) -> MoEConfig:
    """A small version of `moe` that runs in seconds on a CPU: H=256, I=128 * moe_tp, at most 16
    experts (rounded up to a multiple of ep, at least top_k); activation, biases, top-k kept.
    Grouped routing is dropped (the bench's routing is synthetic)."""
    ep, K = parallel.ep_size, moe.top_k
    E = min(moe.num_experts, CPU_SHAPE["max_experts"])
    E = max(E, K)
    E = math.ceil(E / ep) * ep
    return replace(
        moe,
        num_experts=E,
        hidden_size=CPU_SHAPE["hidden_size"],
        intermediate_size=CPU_SHAPE["intermediate_size"] * parallel.moe_tp_size,
        num_expert_group=None,
        topk_group=None,
    )


def make_routing(
    T: int,
    num_experts: int,
    top_k: int,
    *,
    routing: str = "uniform",
    zipf_s: float = 1.2,
    generator: torch.Generator | None = None,
    num_shared: int = 0,
    device: torch.device | str = "cpu",
) -> TopKOutput:
    """Synthetic routing over all `num_experts` experts: each token picks `top_k` distinct experts,
    uniformly ('uniform') or with expert popularity proportional to rank^-zipf_s ('zipf'; the
    popularity order is a random permutation of the experts, so hot experts are spread over
    ranks). Weights: softmax of random normals [T, K]. Fused shared experts are appended with
    ids E, E+1, ... and weight 1. Drawn on the CPU (reproducible), returned on `device`."""
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if routing == "uniform":
        ids = torch.rand(T, num_experts, generator=g).topk(top_k, dim=1).indices
    elif routing == "zipf":
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        popularity = ranks.pow(-zipf_s)[torch.randperm(num_experts, generator=g)]
        if T == 0:
            ids = torch.empty(0, top_k, dtype=torch.long)
        else:
            probs = (popularity / popularity.sum()).float().expand(T, num_experts)
            ids = torch.multinomial(probs, top_k, replacement=False, generator=g)
    else:
        raise ConfigError(f"--routing: unknown value {routing!r}; allowed: {', '.join(ROUTINGS)}")
    weights = torch.softmax(torch.randn(T, top_k, generator=g), dim=1)
    if num_shared:
        shared = torch.arange(num_experts, num_experts + num_shared).expand(T, num_shared)
        ids = torch.cat([ids, shared], dim=1)
        weights = torch.cat([weights, torch.ones(T, num_shared)], dim=1)
    return TopKOutput(
        weights.float().contiguous().to(device), ids.to(torch.int32).contiguous().to(device)
    )


def weight_bytes_per_expert(weights: ExpertWeights) -> float:
    """Bytes one local expert's weights take: every tensor of `weights` with a leading expert
    dimension (w13, w2, biases, scales, ...), divided by the number of local experts."""
    E = weights.w13.shape[0]
    total = 0
    for f in dataclasses.fields(weights):
        t = getattr(weights, f.name)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == E:
            total += t.numel() * t.element_size()
    return total / E


def point_cost(module: MoE, x_TH: torch.Tensor, topk: TopKOutput) -> tuple[Cost, torch.Tensor]:
    """Roofline cost of `module.forward_topk(x_TH, topk)` on this rank, and the local ids [T, K]
    (-1 where the expert is not on this rank): only rank-local (token, expert) pairs and touched
    local experts count."""
    local_ids = module.dispatcher.dispatch(x_TH, topk).topk.ids
    H = module.config.hidden_size
    I_local = module.config.intermediate_size // module.parallel.moe_tp_size
    cost = moe_cost(
        local_ids,
        module.placement.slots_per_rank,
        H,
        I_local,
        act_bytes=x_TH.element_size(),
        weight_bytes_per_expert=weight_bytes_per_expert(module.expert_weights),
    )
    return cost, local_ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 for empty tensors, inf for NaN)."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double(), ref.double()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return err if math.isfinite(err) else float("inf")


# ---------------------------------------------------------------------------- backends


def workload(module: MoE, x_TH: torch.Tensor, topk: TopKOutput) -> Workload:
    """The runner workload of `module.forward_topk(x_TH, topk)`, exactly as the layer computes
    it to pick its runner (so `auto` decisions here are the layer's)."""
    return workload_of(module.dispatcher.dispatch(x_TH, topk), module.expert_weights, module.act)


def split_backends(
    backends: tuple[str, ...], work: Workload, platform: hardware.Platform
) -> tuple[list[str], dict[str, str]]:
    """(backends that can run `work` here, {backend: why not} for the others)."""
    run, skipped = [], {}
    for b in backends:
        if b == "auto":
            try:
                select_runner(work, RunnerConfig("auto"), platform)
            except ConfigError as err:
                skipped[b] = str(err)
                continue
            run.append(b)
            continue
        problem = why_not(b, work, platform)
        if problem is None:
            run.append(b)
        else:
            skipped[b] = problem
    return run, skipped


def all_backends() -> tuple[str, ...]:
    """Every concrete runner backend name (not 'auto'), in the config's order."""
    return tuple(b for b in RUNNER_BACKENDS if b != "auto")


def _graph_safe(backend: str) -> bool:
    return bool(registry.runner_class(backend).caps.cuda_graph)


def _check_quantized(module: MoE) -> None:
    fmt = module.config.weight_format
    w13 = module.expert_weights.w13
    if fmt != "unquantized" and w13.is_floating_point() and w13.element_size() >= 2:
        raise ConfigError(
            f"--quantization {fmt}: this build's MoE layer holds {w13.dtype} weights for it, "
            "not quantized ones; quantized benchmarks need quantized expert weights"
        )


# ---------------------------------------------------------------------------- the sweep


def build_layer(spec: SweepSpec) -> MoE:
    """The MoE layer of rank 0 (tp_rank 0) on spec.device, random weights."""
    module = MoE(spec.moe, spec.parallel, tp_rank=0, device=spec.device,
                 weight_format=spec.weight_spec)  # fmt: skip
    _check_quantized(module)
    return module


def _input_sets(spec, module, T, gen, l2_bytes):
    """[(x_TH, topk), ...], their mean cost and local ids: as many sets as `routings_for` says
    (one where l2_bytes is 0: CPU)."""
    H, dtype, dev = spec.moe.hidden_size, spec.moe.torch_dtype, spec.device

    def one():
        topk = make_routing(
            T,
            spec.moe.num_experts,
            spec.moe.top_k,
            routing=spec.routing,
            zipf_s=spec.zipf_s,
            generator=gen,
            num_shared=spec.moe.num_shared_experts,
            device=dev,
        )
        x = torch.randn(T, H, generator=gen).to(device=dev, dtype=dtype)
        return x, topk

    sets = [one()]
    cost, local_ids = point_cost(module, *sets[0])
    costs, ids = [cost], [local_ids]
    skewed = spec.routing != "uniform"
    for _ in range(routings_for(T, cost.bytes, l2_bytes, skewed) - 1):
        sets.append(one())
        c, i = point_cost(module, *sets[-1])
        costs.append(c)
        ids.append(i)
    mean = Cost(
        flops=sum(c.flops for c in costs) / len(costs),
        bytes=sum(c.bytes for c in costs) / len(costs),
    )
    return sets, mean, ids


def layer_over_sets(module: MoE, sets, around=contextlib.nullcontext) -> Callable[[], None]:
    """One timed call of a sweep point: `module.forward_topk` over every input set (x, topk) of
    `_input_sets`, without autograd, inside the context `around()` makes (a probe's variant,
    e.g. `unittest.mock.patch.object(...)`; entered at each call, so at capture under CUDA
    graphs)."""

    @torch.no_grad()
    def fn():
        with around():
            for x, topk in sets:
                module.forward_topk(x, topk)

    return fn


def _load_stats(ids: list[torch.Tensor], e_local: int) -> tuple[int, int, int]:
    """(local pairs, touched local experts, max tokens on one local expert) of the first set."""
    flat = ids[0].reshape(-1).long()
    flat = flat[(flat >= 0) & (flat < e_local)].cpu()
    if flat.numel() == 0:
        return 0, 0, 0
    counts = torch.bincount(flat, minlength=e_local)
    return int(flat.numel()), int((counts > 0).sum()), int(counts.max())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_sweep(
    spec: SweepSpec,
    *,
    platform: hardware.Platform | None = None,
    ceilings: Ceilings | None = None,
    on_start: Callable[[list[str], dict[str, str]], None] | None = None,
    on_point: Callable[[str, int, Record | None], None] | None = None,
) -> SweepResult:
    """Run the sweep. `on_start(backends to run, {skipped backend: why})` is called once the
    layer is built, before the ceilings are measured; `on_point(backend, T, record)` before
    (record None) and after each point, for progress display. Backends that cannot run the
    workload are skipped with their reason; a point that raises is recorded with its error and
    the sweep goes on. With no runnable backend, nothing is measured (records empty)."""
    started = time.perf_counter()
    platform = platform or hardware.detect()
    module = build_layer(spec)
    gen = torch.Generator().manual_seed(spec.seed)
    probe = make_routing(1, spec.moe.num_experts, spec.moe.top_k, generator=gen,
                         num_shared=spec.moe.num_shared_experts, device=spec.device)
    x_probe = torch.randn(1, spec.moe.hidden_size).to(spec.device, spec.moe.torch_dtype)
    # backends that can run the smallest batch run; a backend limited to smaller batches (a
    # decode runner) is left out of the larger ones, with the reason in `skipped`
    work0 = replace(workload(module, x_probe, probe), num_tokens=min(spec.batch_sizes))
    run, skipped = split_backends(spec.backends, work0, platform)
    caches: dict[str, RunnerCache] = {}
    for b in list(run):
        try:
            caches[b] = RunnerCache(RunnerConfig(b))
        except ConfigError as err:  # the layer's own check of a requested backend
            run.remove(b)
            skipped[b] = str(err)
    if on_start:
        on_start(run, skipped)
    if not run:
        return SweepResult(spec, ceilings or Ceilings(0.0, 0.0, ""), [], skipped, {},
                           time.perf_counter() - started,
                           ["no requested backend can run this workload here"])
    if ceilings is None:
        ceilings = ceilings_for_format(spec.device, spec.moe.torch_dtype, spec.moe.weight_format)
    on_cuda = spec.device == "cuda"
    timing = {} if on_cuda else CPU_TIMING
    calls_per_point = 1 + timing.get("warmup", 5) + timing.get("samples", 25)
    l2 = l2_cache_bytes(spec.device)
    reference = RunnerCache(RunnerConfig("torch"))
    auto = RunnerCache(RunnerConfig("auto"))
    records: list[Record] = []
    auto_choice: dict[int, str] = {}
    tol = SUSPICIOUS_REL_ERR.get(spec.moe.dtype, 5e-2)

    for T in spec.batch_sizes:
        sets, cost, ids = _input_sets(spec, module, T, gen, l2)
        work = workload(module, *sets[0])
        try:
            auto_choice[T] = auto.decide(work).backend
        except ConfigError as err:
            auto_choice[T] = f"error: {err}"
        pairs, touched, max_load = _load_stats(ids, spec.e_local)
        floor_s = cost.floor_s(ceilings)
        module.runners = reference
        with torch.no_grad():
            ref_out = module.forward_topk(*sets[0]).float()
        timed: dict[str, tuple[Record, Callable[[], None], bool]] = {}
        for backend in run:
            problem = None if backend == "auto" else why_not(backend, work, platform)
            if problem is not None:
                skipped.setdefault(backend, f"from T={T}: {problem}")
                continue
            if on_point:
                on_point(backend, T, None)
            rec = Record(
                backend=backend,
                T=T,
                flops=cost.flops,
                bytes=cost.bytes,
                pairs=pairs,
                touched_experts=touched,
                max_expert_load=max_load,
                input_sets=len(sets),
            )
            records.append(rec)
            try:
                fn, graph = _prepare(module, caches[backend], sets, rec, ref_out, spec, started,
                                     work, calls_per_point)  # fmt: skip
                rec.suspicious = rec.rel_err is not None and rec.rel_err > tol
                timed[backend] = (rec, fn, graph)
            except BudgetExceeded as err:
                rec.error = str(err)
            except Exception as err:  # noqa: BLE001 - one failing point must not end the sweep
                rec.error = _error_text(err)
                if on_cuda:
                    torch.cuda.synchronize()
            if on_point and rec.error:
                on_point(backend, T, rec)
        ms = _time_together(timed, spec.device, timing) if timed else {}
        for backend, (rec, _, _) in timed.items():
            if backend in ms:
                _fill(rec, ms[backend] / len(sets), floor_s)
            if on_point:
                on_point(backend, T, rec)
        del sets, ref_out
    module.runners = reference
    return SweepResult(
        spec=spec,
        ceilings=ceilings,
        records=records,
        skipped=skipped,
        auto_choice=auto_choice,
        seconds=time.perf_counter() - started,
    )


def _prepare(module, cache, sets, rec, ref_out, spec, started, work, calls):
    """Check one backend at one T: its decision, correctness against the reference and (with a
    time budget) the cost of timing it. Returns the function to time (one call over every
    input set, on this backend) and whether it may run in a CUDA graph."""
    name = cache.decide(work).backend
    if rec.backend == "auto":
        rec.chosen = name
    graph = spec.device == "cuda" and _graph_safe(name)
    rec.cuda_graph = graph
    module.runners = cache
    with torch.no_grad():
        out = module.forward_topk(*sets[0])  # the first call may compile kernels
        rec.rel_err = rel_err(out.float(), ref_out)
        del out
        if spec.time_budget_s is not None:
            _sync(spec.device)  # a second call estimates the cost (compiles excluded)
            t0 = time.perf_counter()
            module.forward_topk(*sets[0])
            _sync(spec.device)
            once_s = time.perf_counter() - t0
            left = spec.time_budget_s - (time.perf_counter() - started)
            if once_s * calls * len(sets) > left:
                raise BudgetExceeded(
                    f"skipped: about {once_s * calls * len(sets):.1f} s needed, "
                    f"{max(left, 0):.1f} s left of the {spec.time_budget_s:.0f} s time budget"
                )

    return layer_over_sets(module, sets, lambda: _runners(module, cache)), graph


@contextlib.contextmanager
def _runners(module: MoE, cache: RunnerCache):
    """The layer on `cache`'s backend (set at capture under CUDA graphs; each call otherwise)."""
    module.runners = cache
    yield


def _time_together(timed, device, timing) -> dict[str, float]:
    """ms of one call of each prepared backend ({name: (record, fn, graph)}), the backends timed
    in alternating rounds (`time_ms_interleaved`); one at a time when their CUDA graphs do not
    fit in memory together. A backend whose timing fails gets the error in its record."""
    fns = {b: fn for b, (_, fn, _) in timed.items()}
    graphs = {b: g for b, (_, _, g) in timed.items()}
    try:
        return time_ms_interleaved(fns, device, cuda_graph=graphs, **timing)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - find out below which backend fails
        pass
    out = {}
    for b in fns:
        try:
            out.update(time_ms_interleaved({b: fns[b]}, device, cuda_graph=graphs[b], **timing))
        except Exception as err:  # noqa: BLE001 - one failing point must not end the sweep
            timed[b][0].error = "timing: " + _error_text(err)
            if device == "cuda":
                torch.cuda.synchronize()
    return out


def _error_text(err: Exception) -> str:
    """A record's error: the exception's type and the first line of its message."""
    return f"{type(err).__name__}: {err}".splitlines()[0][:300]


def _fill(rec: Record, ms: float, floor_s: float) -> None:
    """The timing of one call (ms) and what follows from it."""
    rec.ms = ms
    s = ms * 1e-3
    rec.floor_ms = floor_s * 1e3
    rec.time_over_floor = ms / rec.floor_ms if rec.floor_ms > 0 else None
    rec.tflops = rec.flops / s / 1e12 if s > 0 else None
    rec.gbps = rec.bytes / s / 1e9 if s > 0 else None


def winners(records: list[Record]) -> dict[int, Record]:
    """The fastest successful record per T; 'auto' is a contender only when it is the only
    backend timed (it runs one of the others)."""
    best: dict[int, Record] = {}
    only_auto = all(r.backend == "auto" for r in records)
    for r in records:
        if r.ms is None or (r.backend == "auto" and not only_auto):
            continue
        if r.T not in best or r.ms < best[r.T].ms:
            best[r.T] = r
    return best
