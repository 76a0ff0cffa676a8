"""The `w4a16` runner: moekit's own CUDA kernels for 4-bit weight-only experts (int4_w4a16,
mxfp4, nvfp4) at decode batch sizes, with bf16 activations.

At decode an expert sees a handful of tokens, so a layer call is a stream of 4-bit weights; the
`triton` runner's kernels spend several instructions per weight turning codes into products on
the CUDA cores (benchmarks/triton_notes.md, session 21). These kernels (csrc/w4a16.cu) load each
lane's MMA fragments of a weight layout permuted once (`pack.py`), turn the codes into bf16 with
a few bit operations and one or two bf16 products (int4 with groups of 64 or more: q - z, and
the scale multiplies the float32 sums), and multiply on the tensor cores. Two
launches per call, no alignment kernel:
  gate_up: groups the pairs by expert in shared memory, h [P, I] = act(x @ w13[e].T + b13[e]),
           and zeroes the output;
  down:    out [T, H] += weight * (h @ w2[e].T + b2[e]), bf16 atomics; on sm_90+ it may start
           while gate_up finishes (a programmatic dependent launch, `jit.down_overlaps`).
Each GEMM runs by a `jit.Plan`: its chunks stream through a shared-memory ring or directly into
registers, and it spreads over blocks one of a few ways; the plan is measured for the presets'
shapes on the H100 and H200 (`plans.py`), else chosen by a cost model (`jit.plan`).

Limits (said at selection): standard format; bfloat16 activations; at most 128 (token, expert)
pairs per call (`jit.MAX_PAIRS`: decode batches; `auto` picks another runner above); H and I
multiples of 64; a CUDA GPU of compute capability 8.0+ and nvcc (the kernels are built on first
use, about 12 s per weight format, then cached). The permuted copy of the weights (the same size
as the stored ones) is made on the first call with a set of weights (outside CUDA-graph
capture) and kept while they are; written in place (an EPLB move), they are permuted again
into the same copy, so CUDA graphs captured with it stay valid (`runners._shared.DerivedCopies`).
"""

from __future__ import annotations

import weakref

import torch

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform, sm_count
from moekit.runners._shared import DerivedCopies
from moekit.runners._tables import table_key
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.runners.w4a16 import jit, plans
from moekit.runners.w4a16.pack import PackedExperts, pack_experts
from moekit.stages import STANDARD

WEIGHT_FORMATS = ("int4_w4a16", "mxfp4", "nvfp4")
SHAPE_ALIGN = 64  # H and I: whole 64-column chunks of the packed layout
MIN_CAPABILITY = (8, 0)  # bf16 m16n8k16 MMA, bf16 atomics


def shape_problem(hidden: int | None, intermediate: int | None) -> str | None:
    bad = [f"{n}={v}" for n, v in (("H", hidden), ("I", intermediate))
           if v is not None and v % SHAPE_ALIGN]  # fmt: skip
    if bad:
        return (f"runner 'w4a16' needs H and I (per rank) to be multiples of {SHAPE_ALIGN}, got "
                + ", ".join(bad))  # fmt: skip
    return None


def pairs_problem(num_tokens: int, top_k: int | None) -> str | None:
    pairs = num_tokens * (top_k or 1)
    if pairs > jit.MAX_PAIRS:
        return (f"runner 'w4a16' runs decode batches of at most {jit.MAX_PAIRS} (token, expert) "
                f"pairs; T={num_tokens} x K={top_k} is {pairs}")  # fmt: skip
    return None


def _weight_tensors(w: ExpertWeights) -> tuple:
    return (w.w13, w.w2, w.b13, w.b2, w.w13_scale, w.w2_scale, w.w13_zero, w.w2_zero,
            w.w13_global_scale, w.w2_global_scale)  # fmt: skip


def _pack(w: ExpertWeights, interleaved: bool) -> PackedExperts:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RunnerError(
            "runner 'w4a16' permutes a new set of weights on its first call with them; make "
            "one call outside CUDA-graph capture first (a warm-up)"
        )
    return pack_experts(w, interleaved)


@register
class W4A16Runner(Runner):
    """4-bit weight-only experts on the tensor cores at decode batch sizes (CUDA, nvcc)."""

    name = "w4a16"
    caps = RunnerCaps(
        formats=frozenset({STANDARD}),
        weight_formats=frozenset(WEIGHT_FORMATS),
        activations=frozenset(ACTIVATIONS),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16"}),
        bias=True,
        cuda_graph=True,
    )

    # why kernels cannot be built here (None: they can); a class attribute so tests can inject it
    toolchain_problem = staticmethod(jit.problem)

    def __init__(self) -> None:
        self._packed: DerivedCopies[PackedExperts] = DerivedCopies()  # one layer's weights
        # (gate_up plan, down plan, overlap) per call shape, for the packed weights
        # `_launches_for`: decided once, not on every forward
        self._launches: dict[tuple, tuple[jit.Plan, jit.Plan, bool]] = {}
        self._launches_for = lambda: None  # a weak reference: an old copy is freed, not kept

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        if not platform.is_cuda:
            return Availability(False, "needs a CUDA GPU (compute capability 8.0+); no CUDA GPU")
        if platform.capability is None or platform.capability < MIN_CAPABILITY:
            return Availability(
                False, f"needs compute capability 8.0+ (bf16 tensor cores); this GPU is "
                f"SM{platform.sm()}"
            )  # fmt: skip
        problem = cls.toolchain_problem()
        if problem is not None:
            return Availability(False, problem)
        return Availability(True, "moekit's 4-bit decode kernels, built with nvcc")

    @classmethod
    def workload_problem(cls, work, platform=None) -> str | None:
        """Batch and shape limits beyond the caps (used by moekit.select)."""
        return pairs_problem(work.num_tokens, work.top_k) or shape_problem(
            work.hidden_size, work.intermediate_size
        )

    def packed(self, w: ExpertWeights, interleaved: bool) -> PackedExperts:
        """The weights in the kernels' layout, permuted on the first call with them (again, into
        the same tensors, after they were written in place)."""
        p = self._packed.get(_weight_tensors(w), interleaved, lambda: _pack(w, interleaved))
        if p is not self._launches_for():
            self._launches, self._launches_for = {}, weakref.ref(p)
        return p

    def refresh(self, weights: ExpertWeights, act: ActivationSpec) -> None:
        self._packed.refresh(_weight_tensors(weights),
                             lambda interleaved: _pack(weights, interleaved))  # fmt: skip

    def run_standard(self, x_TH, topk, w: ExpertWeights, act: ActivationSpec,
                     local_share: float = 1.0) -> torch.Tensor:  # fmt: skip
        """x [T, H] bf16, topk ids / weights [T, K] -> out [T, H] bf16. local_share: the
        expected share of the pairs that are local (sizes the launches only)."""
        T, H = x_TH.shape
        K = topk.top_k
        problem = pairs_problem(T, K) or shape_problem(w.hidden_size, w.intermediate_size)
        if problem:
            raise RunnerError(problem)
        if H != w.hidden_size:
            raise RunnerError(f"runner 'w4a16': x has hidden size {H}, weights {w.hidden_size}")
        if T == 0 or K == 0:
            return x_TH.new_zeros(T, H)
        p = self.packed(w, act.interleaved)
        if x_TH.stride(-1) != 1 or x_TH.stride(0) != H or x_TH.data_ptr() % 16:
            x_TH = x_TH.contiguous()
        ids = topk.ids.to(torch.int32).contiguous().view(-1)
        weights = topk.weights.float().contiguous().view(-1)
        I, dev = w.intermediate_size, x_TH.device
        gate_up, down, overlap = self.launches(T, K, w, act, local_share, p, dev)
        h = torch.empty(T * K, I, dtype=x_TH.dtype, device=dev)
        out = torch.empty(T, H, dtype=x_TH.dtype, device=dev)
        with torch.cuda.device(dev):
            jit.launch(jit.GATE_UP, p.w13, x_TH, ids, weights, p.b13, h, K, I, gate_up, act.name,
                       act.alpha, act.limit, zero_out=out)  # fmt: skip
            jit.launch(jit.DOWN, p.w2, h, ids, weights, p.b2, out, K, H, down, overlap=overlap)
        return out

    def launches(self, T: int, K: int, w: ExpertWeights, act: ActivationSpec, local_share: float,
                 p: PackedExperts,
                 dev: torch.device) -> tuple[jit.Plan, jit.Plan, bool]:  # fmt: skip
        """(gate_up plan, down plan, whether down overlaps gate_up: `jit.down_overlaps`) for a
        call of T tokens on the packed weights p, decided on the first such call."""
        key = (T, K, local_share, act, dev)
        found = self._launches.get(key)
        if found is None:
            gate_up, down = self.choose_plans(T, K, w, act, local_share, p, dev)
            overlap = jit.down_overlaps(p.w13, p.w2, act.name, p.b13 is not None, gate_up, down,
                                        T * K, K, dev)  # fmt: skip
            found = self._launches[key] = (gate_up, down, overlap)
        return found

    @staticmethod
    def choose_plans(T: int, K: int, w: ExpertWeights, act: ActivationSpec,
                     local_share: float, p: PackedExperts,
                     dev: torch.device) -> tuple[jit.Plan, jit.Plan]:  # fmt: skip
        """(gate_up, down) plans: measured for this shape, format and GPU (`plans.py`) when a
        table has a batch size near T, else from the cost model."""
        name = plans.table_name_for(w, K, act, torch.cuda.get_device_name(dev))
        measured = plans.plans_for(name, table_key(T, local_share))
        if measured is not None:
            return measured
        E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
        pairs, sms = T * K * local_share, sm_count(dev)
        return (
            jit.plan(jit.GATE_UP, pairs, E, I, H, sms,
                     jit.occupancy(p.w13, jit.GATE_UP, act.name, p.b13 is not None, dev)),
            jit.plan(jit.DOWN, pairs, E, H, I, sms,
                     jit.occupancy(p.w2, jit.DOWN, act.name, p.b2 is not None, dev)),
        )  # fmt: skip


__all__ = ["W4A16Runner"]
