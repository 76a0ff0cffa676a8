"""The `triton` runner: fused MoE expert FFNs in Triton kernels of our own.

Standard format: pairs are sorted by expert into blocks (`moekit.runners._align`, shared with
the cutlass and deep_gemm runners), a grouped GEMM computes
the gate/up projection with the activation fused (`gate_up`), a second one the down projection
times the routing weight (`down`), and the K rows of each token are summed (a small kernel, or
atomics in the down GEMM, as the config says). Masked format: the same GEMMs on the fixed
[E, C, H] layout, unweighted. Block sizes come from tuned JSON tables (`configs.py`).

Quantized weights (see `ops.WeightQuant`): fp8_w8a8 (block-wise [128, 128] / per-channel /
per-tensor weight scales with token-group / token / per-tensor activations, dynamic or static:
one calibrated scale per expert) and int8_w8a8 on the fp8 / int8 tensor cores; int8_w8a16,
int4_w4a16, mxfp4 and nvfp4 dequantized in the weight-tile load before a bf16/fp16 dot.

Importing this module needs no Triton (the runner then reports itself unavailable); the kernels
are imported on first use. On CPU it runs in the Triton interpreter when TRITON_INTERPRET=1 is
set before import (float32 / float16: bfloat16 is wrong in the interpreter).
"""

from __future__ import annotations

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.runners._triton_base import TritonRunnerBase, triton_devices
from moekit.runners.base import RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import (
    MASKED,
    STANDARD,
    DispatchOutput,
    MaskedDispatchOutput,
    MaskedRunnerOutput,
    RunnerOutput,
    StandardRunnerOutput,
)

FP8_MIN_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada / Hopper and newer
# Kept equal to ops.SUPPORTED_FORMATS (ops imports Triton; this module must not).
WEIGHT_FORMATS = (
    "unquantized", "fp8_w8a8", "int8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4", "nvfp4",
)  # fmt: skip


@register
class TritonRunner(TritonRunnerBase):
    """Fused MoE in Triton: both dispatch formats, every activation, biases, CUDA graphs."""

    name = "triton"
    caps = RunnerCaps(
        formats=frozenset({STANDARD, MASKED}),
        weight_formats=frozenset(WEIGHT_FORMATS),
        activations=frozenset(ACTIVATIONS),
        devices=triton_devices(),
        cuda_graph=True,
    )

    def check(self, dispatch_out, weights, act):
        super().check(dispatch_out, weights, act)
        x = dispatch_out.x
        if weights.format == "fp8_w8a8" and x.is_cuda:
            from moekit.runners._tables import device_key

            cap = device_key(x.device)[1]
            if cap < FP8_MIN_CAPABILITY:
                raise RunnerError(
                    f"runner 'triton' with fp8_w8a8 needs fp8 tensor cores (compute "
                    f"capability >= 8.9), found {cap}"
                )

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        self.check(dispatch_out, weights, act)
        from moekit.runners.triton import ops

        try:
            if isinstance(dispatch_out, MaskedDispatchOutput):
                out = ops.fused_moe_masked(dispatch_out.x, dispatch_out.counts, weights, act)
                return MaskedRunnerOutput(out)
            out = ops.fused_moe(dispatch_out.x, dispatch_out.topk, weights, act,
                                local_share=dispatch_out.local_share)
            return StandardRunnerOutput(out)
        except ValueError as err:
            raise RunnerError(str(err)) from err


__all__ = ["TritonRunner"]
