"""The `triton_kernel` runner: a persistent Triton MoE aimed at large batches.

Design (not a re-tuned `triton`): the (token, k) pairs are counting-sorted by expert on device
with no padded alignment buffer (`routing.py`: per-expert offsets, and the work tiles
enumerated from the per-expert counts, their number kept on device); two grouped GEMMs over
(tile, column block) work items, by default persistent (grid = SMs, each program loops over
items; a config can instead launch one program per possible item): gate_up gathers the tokens'
rows of x in its operand load and applies the activation in its epilogue (interleaved gate/up
weights are read through two strided TMA views, so no accumulator split is needed); down
applies the routing weight and either adds each row into the output with atomics in its
epilogue (reduce 'atomic': the top-k sum fused, the output zeroed by the gate_up launch) or
stores rows by pair for a deterministic sum kernel (reduce 'sum', bit-reproducible). Configs
are data (`configs.py`): tuned tables per shape / device shipped in
src/moekit/configs/triton_kernel/, a heuristic table elsewhere.

On sm_90 with Triton >= 3.9, large batches run the GEMMs as warp-specialized Gluon kernels
instead (`gluon_ops`: a TMA producer warp, two wgmma warpgroups; MOEKIT_TRITON_KERNEL_ENGINE);
their top-k sum (bf16 and fp8) is the atomic one, into an output their gate_up zeroes on the
way (`gluon_ops.DEFAULT`, `gluon_ops.FP8`).

Supports: the standard dispatch format (not masked), unquantized weights (and, in the Gluon
engine only, fp8_w8a8 with 128 x 128 block scales and per-token-group activations), activations
silu / gelu / swiglu_oai, biases, interleaved gate/up, float16 / bfloat16 (and float32), on CUDA
(compute capability >= 8.0) and CUDA graphs; on CPU only in the Triton interpreter
(TRITON_INTERPRET=1 set before import; float32 / float16, as bfloat16 is wrong there).
Importing this module needs no Triton (the runner then reports itself unavailable).
"""

from __future__ import annotations

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform
from moekit.runners._triton_base import TritonRunnerBase, triton_devices
from moekit.runners.base import RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import STANDARD, DispatchOutput, RunnerOutput, StandardRunnerOutput


@register
class TritonKernelRunner(TritonRunnerBase):
    """Persistent fused MoE in Triton for large batches: standard format, every activation,
    biases, interleaved, CUDA graphs (see the module docstring)."""

    name = "triton_kernel"
    caps = RunnerCaps(
        formats=frozenset({STANDARD}),
        weight_formats=frozenset({"unquantized", "fp8_w8a8"}),
        activations=frozenset(ACTIVATIONS),
        devices=triton_devices(),
        cuda_graph=True,
    )

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        """As every Triton runner; on CUDA the reason also says whether the Gluon engine is on."""
        a = super().availability(platform)
        if a.ok and platform.is_cuda:
            from moekit.runners.triton_kernel import gluon_ops

            status = gluon_ops.engine_status(platform.capability, platform.libraries.get("triton"))
            return Availability(True, status)
        return a

    @classmethod
    def workload_problem(cls, work, platform: Platform | None = None) -> str | None:
        """fp8 weights: 128 x 128 block scales with per-token-group activations, H a multiple
        of 16 and I of 64, run in the Gluon engine (sm_90, Triton >= 3.9; used by moekit.select)."""
        if work.weight_format != "fp8_w8a8":
            return None
        from moekit.runners.triton_kernel import gluon_ops

        problem = None
        if work.weight_spec is not None:
            problem = gluon_ops.fp8_problem(work.weight_spec)
        H, I = work.hidden_size, work.intermediate_size
        if problem is None and ((H is not None and H % 16) or (I is not None and I % 64)):
            problem = f"runs fp8 with H a multiple of 16 and I of 64, got H={H}, I={I}"
        if problem is None and platform is not None:
            problem = gluon_ops.platform_problem(platform.capability,
                                                 platform.libraries.get("triton"))  # fmt: skip
            if problem:
                problem = f"runs fp8 weights in its Gluon engine, which {problem}"
        return f"runner 'triton_kernel' {problem}" if problem else None

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        self.check(dispatch_out, weights, act)
        from moekit.runners.triton_kernel import ops

        try:
            # its tables (T >= 4096, every pair local) are looked up by T: on the H100
            # sweep at 0ce4834, T * local_share (deepseek-v3 EP8 T = 4096 -> 512, no table
            # near) took the heuristic and ran 1.94x the floor against 1.45x by T. The Gluon
            # engine's choice counts the local pairs (its 128-row tiles waste the most there).
            out = ops.fused_moe(dispatch_out.x, dispatch_out.topk, weights, act,
                                local_share=dispatch_out.local_share)  # fmt: skip
            return StandardRunnerOutput(out)
        except ValueError as err:
            raise RunnerError(str(err)) from err


__all__ = ["TritonKernelRunner"]
