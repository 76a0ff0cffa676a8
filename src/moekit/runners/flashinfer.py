"""FlashInfer runners (optional extra `flashinfer-python`).

- `flashinfer_cutlass`: FlashInfer's CUTLASS fused MoE (`flashinfer.fused_moe.cutlass_fused_moe`,
  the TensorRT-LLM MoE kernels) on SM90+, for unquantized bfloat16 / float16 weights with SwiGLU
  (gate/up halves or interleaved rows). Written against the flashinfer-python 0.7.2 API; its
  GPU test (tests/test_layer.py) compares it with the reference wherever flashinfer is
  installed. Tried on the H100 with scripts/gpu_flashinfer_try.sh (flashinfer-python
  0.7.2.post1 and apache-tvm-ffi 0.1.15 carried as wheels, without the dependencies that do not
  fit the transfer limit: nvidia-cutlass-dsl, cuda-tile, nccl4py, nvidia-cudnn-frontend): it
  imports and reports available, T = 0 passes, and the first real call JIT-compiles the SM90
  CUTLASS MoE module with nvcc, which had not finished after 380 s
  (benchmarks/results/20261122T0105Z_H100_flashinfer_try.log): no MoE output of it was
  checked there.
- `flashinfer_trtllm`, `flashinfer_mxfp4`, `flashinfer_cutedsl`: FlashInfer's TensorRT-LLM-gen,
  MXFP4 and CuTe-DSL MoE kernels exist for SM100 (Blackwell data-centre GPUs) only. They are
  registered so that selecting one says why it cannot run, and `auto` never picks them: their
  availability is always False (no CUDA GPU / not SM100 / flashinfer missing / not implemented,
  since no SM100 machine is at hand to write and test them), and `run` raises.
"""

from __future__ import annotations

import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform
from moekit.runners._shared import DerivedCopies
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import MASKED, STANDARD, DispatchOutput, RunnerOutput, StandardRunnerOutput

LIBRARY = "flashinfer-python"
INSTALL_HINT = "pip install flashinfer-python (moekit[flashinfer])"
NOT_IMPLEMENTED_SM100 = (
    "not implemented in this version of moekit: it needs an SM100 (Blackwell) GPU to be written "
    "and tested, and none was at hand"
)


def sm100_availability(platform: Platform) -> Availability:
    """Availability of a FlashInfer backend that exists for SM100 only (see module docstring)."""
    if not platform.is_cuda:
        return Availability(False, "needs SM100 (Blackwell); no CUDA GPU")
    if platform.capability is None or platform.capability[0] != 10:
        return Availability(False, f"needs SM100 (Blackwell); this GPU is SM{platform.sm()}")
    if not platform.has(LIBRARY):
        return Availability(False, f"needs {LIBRARY}, which is not installed ({INSTALL_HINT})")
    return Availability(False, NOT_IMPLEMENTED_SM100)


def sm100_caps(fmt: str, weight_formats: set[str], activations: set[str], bias: bool):
    """What an SM100 FlashInfer backend would take: one dispatch format, bf16 on CUDA, graphs."""
    return RunnerCaps(
        formats=frozenset({fmt}),
        weight_formats=frozenset(weight_formats),
        activations=frozenset(activations),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16"}),
        bias=bias,
        cuda_graph=True,
    )


class _SM100Only(Runner):
    """Base of the SM100-only FlashInfer backends: never available here; `run` raises."""

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        return sm100_availability(platform)

    def run(self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec):
        raise RunnerError(f"runner {self.name!r} is not implemented: {NOT_IMPLEMENTED_SM100}")


@register
class FlashInferTrtllmRunner(_SM100Only):
    """TensorRT-LLM-gen fused MoE (SM100): fp8 block-scale, nvfp4, mxfp4 and bf16 weights."""

    name = "flashinfer_trtllm"
    caps = sm100_caps(
        STANDARD, {"unquantized", "fp8_w8a8", "nvfp4", "mxfp4"}, {"silu", "swiglu_oai"}, bias=True
    )


@register
class FlashInferMxfp4Runner(_SM100Only):
    """MXFP4-weight MoE (gpt-oss) on SM100, bf16 or mxfp8 activations."""

    name = "flashinfer_mxfp4"
    caps = sm100_caps(STANDARD, {"mxfp4"}, {"silu", "swiglu_oai"}, bias=True)


@register
class FlashInferCuteDslRunner(_SM100Only):
    """CuTe-DSL masked grouped GEMM MoE (SM100, nvfp4), for the low-latency all-to-all layout."""

    name = "flashinfer_cutedsl"
    caps = sm100_caps(MASKED, {"nvfp4"}, {"silu"}, bias=False)


def _up_first(w13: torch.Tensor, interleaved: bool) -> torch.Tensor:
    gate, up = (w13[:, 0::2], w13[:, 1::2]) if interleaved else w13.chunk(2, dim=1)
    return torch.cat([up, gate], dim=1).contiguous()


@register
class FlashInferCutlassRunner(Runner):
    """FlashInfer CUTLASS fused MoE (SM90+): unquantized bf16/fp16, SwiGLU, no biases, standard
    format. Masked pairs (id -1 or >= E) are routed to expert 0 with weight 0. Unverified here
    (see the module docstring)."""

    name = "flashinfer_cutlass"
    caps = RunnerCaps(
        formats=frozenset({STANDARD}),
        weight_formats=frozenset({"unquantized"}),
        activations=frozenset({"silu"}),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16", "float16"}),
        bias=False,
        cuda_graph=False,  # its autotuner profiles on the first call of each shape
    )

    def __init__(self) -> None:
        self._w31: DerivedCopies[torch.Tensor] = DerivedCopies()

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        if not platform.is_cuda:
            return Availability(False, "needs a CUDA GPU (SM90+); no CUDA GPU")
        if platform.sm() < 90:
            return Availability(
                False, f"needs SM90+ (Hopper or newer); this GPU is SM{platform.sm()}"
            )
        if not platform.has(LIBRARY):
            return Availability(False, f"needs {LIBRARY}, which is not installed ({INSTALL_HINT})")
        return Availability(True)

    def _up_gate(self, w13: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """w13 [E, 2I, H] (gate rows then up rows, or interleaved gate, up, gate, ...) -> [E, 2I,
        H] up rows first, the order of the TensorRT-LLM SwiGLU epilogue; kept while w13 is."""
        return self._w31.get((w13,), interleaved, lambda: _up_first(w13, interleaved))

    def refresh(self, weights: ExpertWeights, act: ActivationSpec) -> None:
        self._w31.refresh((weights.w13,), lambda interleaved: _up_first(weights.w13, interleaved))

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        self.check(dispatch_out, weights, act)
        from flashinfer.fused_moe import cutlass_fused_moe
        from flashinfer.fused_moe.core import ActivationType

        x, topk = dispatch_out.x, dispatch_out.topk
        T, H = x.shape
        if T == 0:
            return StandardRunnerOutput(torch.zeros(0, H, dtype=x.dtype, device=x.device))
        E = weights.num_experts
        valid = (topk.ids >= 0) & (topk.ids < E)
        ids = torch.where(valid, topk.ids, 0).to(torch.int32).contiguous()
        scales = torch.where(valid, topk.weights.float(), 0.0).contiguous()
        out = cutlass_fused_moe(
            input=x.contiguous(),
            token_selected_experts=ids,
            token_final_scales=scales,
            fc1_expert_weights=self._up_gate(weights.w13, act.interleaved),
            fc2_expert_weights=weights.w2.contiguous(),
            output_dtype=x.dtype,
            quant_scales=None,
            activation_type=ActivationType.Swiglu,
        )
        if isinstance(out, (list, tuple)):
            out = out[0]
        return StandardRunnerOutput(out)
