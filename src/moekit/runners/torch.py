"""The reference runner `torch`: plain PyTorch, exact for every activation and bias option.

Every faster runner is tested against it. Matmuls run in the input dtype (fp32 accumulation),
the activation in float32, and the sum over the top-k experts in float32, as a fused kernel
does. `moe_reference_fp64` is the independent float64 twin used by the tests.

Quantized weight formats: the weights are dequantized first (`ExpertWeights.dequantized`), then
the same math. Weight-only formats dequantize to the activation dtype, as a w4a16 / w8a16 kernel
does before its bf16/fp16 MMA. The w8a8 formats compute what a w8a8 kernel computes up to its
accumulation order: the inputs of both GEMMs are quantized and dequantized with the format's
activation scheme (`ActQuant`), and the GEMMs run in float32 on the float32 dequantized weights
and activations (an fp8 x fp8 or int8 x int8 product is exact in float32); the first GEMM's
output and the activated intermediate are rounded to the activation dtype, like the kernels'
intermediate buffers. x [T, H] is quantized before the first GEMM, the intermediate [T*K, I]
before the second; 'dynamic_tensor' takes one scale over all of x and one over all valid
intermediate rows, 'static_tensor' the expert's a13_scale / a2_scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit.config import ACTIVATIONS, WEIGHT_FORMATS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant.act_quant import fake_quantize_act, tensor_scale
from moekit.quant.spec import QuantSpec
from moekit.router import TopKOutput
from moekit.runners.base import Runner, RunnerCaps
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


def activate(h13: torch.Tensor, act: ActivationSpec) -> torch.Tensor:
    """[..., 2I] gate/up pre-activations -> [..., I], in h13's dtype."""
    if act.interleaved:
        gate, up = h13[..., 0::2], h13[..., 1::2]
    else:
        gate, up = h13.chunk(2, dim=-1)
    if act.name == "silu":
        return F.silu(gate) * up
    if act.name == "gelu":
        return F.gelu(gate) * up
    if act.name == "swiglu_oai":
        gate = gate.clamp(max=act.limit)
        up = up.clamp(min=-act.limit, max=act.limit)
        return gate * torch.sigmoid(act.alpha * gate) * (up + 1)
    raise ValueError(f"activation: unknown {act.name!r}; allowed: {', '.join(ACTIVATIONS)}")


def expert_up(
    x_NH: torch.Tensor,
    w13_2IH: torch.Tensor,
    b13_2I: torch.Tensor | None,
    act: ActivationSpec,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """First GEMM + activation: [..., N, H] -> [..., N, I] in `dtype` (default x's dtype); the
    GEMM's output is rounded to `dtype` before the bias and the activation."""
    dtype = dtype or x_NH.dtype
    h = torch.matmul(x_NH, w13_2IH.transpose(-1, -2)).to(dtype).float()
    if b13_2I is not None:
        h = h + b13_2I.float().unsqueeze(-2)
    return activate(h, act).to(dtype)


def expert_down(a_NI: torch.Tensor, w2_HI: torch.Tensor, b2_H: torch.Tensor | None) -> torch.Tensor:
    """Second GEMM: [..., N, I] -> [..., N, H] float32."""
    y = torch.matmul(a_NI, w2_HI.transpose(-1, -2)).float()
    if b2_H is not None:
        y = y + b2_H.float().unsqueeze(-2)
    return y


def expert_ffn(
    x_NH: torch.Tensor,
    w13_2IH: torch.Tensor,
    w2_HI: torch.Tensor,
    b13_2I: torch.Tensor | None,
    b2_H: torch.Tensor | None,
    act: ActivationSpec,
) -> torch.Tensor:
    """One expert on N rows (or a batch of experts with leading dims): returns [..., N, H]
    float32, with the intermediate rounded to x's dtype between the two GEMMs."""
    return expert_down(expert_up(x_NH, w13_2IH, b13_2I, act), w2_HI, b2_H)


@dataclass(frozen=True)
class ActQuant:
    """How a w8a8 kernel quantizes its GEMM inputs (gemm 1: x, gemm 2: the intermediate), as
    dequantize(quantize(.)) in the input dtype. a13_scale / a2_scale [E]: static scales."""

    spec: QuantSpec
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, w: ExpertWeights) -> "ActQuant | None":
        """None for unquantized and weight-only formats."""
        if not w.is_quantized or w.spec.weight_only:
            return None
        return cls(w.spec, w.a13_scale, w.a2_scale)

    def call_scale(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The per-call 'dynamic_tensor' scale over `rows` (all of this GEMM's input rows)."""
        if self.spec.act_scheme != "dynamic_tensor":
            return None
        return tensor_scale(rows, self.spec.act_dtype)

    def apply(
        self, x: torch.Tensor, gemm: int, expert: int | None, call_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] of one expert (`expert`) or of all experts ([E, C, K], expert None) ->
        the float32 values the kernel multiplies."""
        scale = call_scale
        if self.spec.act_scheme == "static_tensor":
            static = self.a13_scale if gemm == 1 else self.a2_scale
            scale = static[expert] if expert is not None else static.view(-1, 1, 1)
        group = self.spec.act_group_size or 128
        return fake_quantize_act(
            x,
            self.spec.act_scheme,
            self.spec.act_dtype,
            scale=scale,
            group_size=group,
            out_dtype=torch.float32,
        )


def _bias(b: torch.Tensor | None, e) -> torch.Tensor | None:
    return None if b is None else b[e]


def run_standard(
    x_TH: torch.Tensor,
    topk: TopKOutput,
    w: ExpertWeights,
    act: ActivationSpec,
    aq: ActQuant | None = None,
) -> torch.Tensor:
    """out [T, H] in x's dtype = sum_k weight_k * expert_{id_k}(x); ids of -1 contribute 0.
    w unquantized; `aq` fake-quantizes the GEMM inputs (w8a8 formats; w is then float32)."""
    T, H = x_TH.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    flat_ids = topk.ids.reshape(-1).long()
    valid = (flat_ids >= 0) & (flat_ids < w.num_experts)
    order = torch.argsort(torch.where(valid, flat_ids, w.num_experts), stable=True)
    counts = torch.bincount(flat_ids[valid], minlength=w.num_experts).tolist()  # one host sync
    flat_weights = topk.weights.reshape(-1)
    s1 = aq.call_scale(x_TH) if aq else None
    work, start = [], 0  # (expert, pairs, tokens, intermediate) per expert with rows
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // topk.top_k
        x = x_TH[tokens] if aq is None else aq.apply(x_TH[tokens], 1, e, s1)
        a = expert_up(x, w.w13[e], _bias(w.b13, e), act, x_TH.dtype)
        work.append((e, pairs, tokens, a))
    s2 = aq.call_scale(torch.cat([a for *_, a in work])) if aq and work else None
    for e, pairs, tokens, a in work:
        if aq is not None:
            a = aq.apply(a, 2, e, s2)
        y = expert_down(a, w.w2[e], _bias(w.b2, e))
        out.index_add_(0, tokens, y * flat_weights[pairs].unsqueeze(-1))
    return out.to(x_TH.dtype)


def run_masked(
    x_ECH: torch.Tensor,
    counts_E: torch.Tensor,
    w: ExpertWeights,
    act: ActivationSpec,
    aq: ActQuant | None = None,
) -> torch.Tensor:
    """out [E, C, H] in x's dtype: each expert on its rows; rows at or past counts are zero."""
    C = x_ECH.shape[1]
    valid = torch.arange(C, device=x_ECH.device).unsqueeze(0) < counts_E.unsqueeze(1)
    if aq is None:
        y = expert_ffn(x_ECH, w.w13, w.w2, w.b13, w.b2, act)
    else:
        x = aq.apply(x_ECH, 1, None, aq.call_scale(x_ECH[valid]))
        a = expert_up(x, w.w13, w.b13, act, x_ECH.dtype)
        y = expert_down(aq.apply(a, 2, None, aq.call_scale(a[valid])), w.w2, w.b2)
    # where, not a product: padding rows may hold garbage (NaN * 0 is NaN)
    return torch.where(valid.unsqueeze(-1), y, 0.0).to(x_ECH.dtype)


@register
class TorchRunner(Runner):
    """Reference runner: PyTorch ops, any device, every activation, biases, both formats, every
    weight format (dequantized first; w8a8 activations fake-quantized, see the module doc)."""

    name = "torch"
    caps = RunnerCaps(
        formats=frozenset({STANDARD, MASKED}),
        weight_formats=frozenset(WEIGHT_FORMATS),
        activations=frozenset(ACTIVATIONS),
        devices=frozenset({"cpu", "cuda"}),
        cuda_graph=False,  # the standard path reads expert counts on the host
    )

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        self.check(dispatch_out, weights, act)
        aq = ActQuant.of(weights)  # w8a8: float32 GEMMs on fake-quantized inputs
        weights = weights.dequantized(torch.float32 if aq else dispatch_out.x.dtype)
        if isinstance(dispatch_out, MaskedDispatchOutput):
            x, counts = dispatch_out.x, dispatch_out.counts
            return MaskedRunnerOutput(run_masked(x, counts, weights, act, aq))
        return StandardRunnerOutput(
            run_standard(dispatch_out.x, dispatch_out.topk, weights, act, aq)
        )


def moe_reference_fp64(
    x_TH: torch.Tensor, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec
) -> torch.Tensor:
    """Float64 MoE output [T, H], computed densely (every expert on every token, then gathered):
    a different code path from `run_standard`, for tests. Ids of -1 contribute 0. Quantized
    weights are dequantized in float64; activations are not quantized (this is the reference
    without the w8a8 activation loss)."""
    f64 = torch.float64
    w = w.dequantized(f64)
    x = x_TH.to(f64)
    h = torch.einsum("th,eih->eti", x, w.w13.to(f64))
    if w.b13 is not None:
        h = h + w.b13.to(f64).unsqueeze(1)
    a = activate(h, act)
    y = torch.einsum("eti,ehi->eth", a, w.w2.to(f64))
    if w.b2 is not None:
        y = y + w.b2.to(f64).unsqueeze(1)
    T, K = topk.ids.shape
    ids = topk.ids.long()
    valid = ids >= 0
    picked = y[ids.clamp(min=0), torch.arange(T, device=x.device).unsqueeze(1)]  # [T, K, H]
    weights = torch.where(valid, topk.weights.to(f64), torch.zeros((), dtype=f64))
    return (picked * weights.unsqueeze(-1)).sum(dim=1)
