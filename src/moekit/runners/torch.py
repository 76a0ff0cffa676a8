"""The reference runner `torch`: plain PyTorch, exact for every activation and bias option.

Every faster runner is tested against it. Matmuls run in the input dtype (fp32 accumulation),
the activation in float32, and the sum over the top-k experts in float32, as a fused kernel
does. `moe_reference_fp64` is the independent float64 twin used by the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
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
    h = torch.matmul(x_NH, w13_2IH.transpose(-1, -2)).float()
    if b13_2I is not None:
        h = h + b13_2I.float().unsqueeze(-2)
    a = activate(h, act).to(x_NH.dtype)
    y = torch.matmul(a, w2_HI.transpose(-1, -2)).float()
    if b2_H is not None:
        y = y + b2_H.float().unsqueeze(-2)
    return y


def _bias(b: torch.Tensor | None, e) -> torch.Tensor | None:
    return None if b is None else b[e]


def run_standard(
    x_TH: torch.Tensor, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec
) -> torch.Tensor:
    """out [T, H] in x's dtype = sum_k weight_k * expert_{id_k}(x); ids of -1 contribute 0."""
    T, H = x_TH.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x_TH.device)
    flat_ids = topk.ids.reshape(-1).long()
    valid = (flat_ids >= 0) & (flat_ids < w.num_experts)
    order = torch.argsort(torch.where(valid, flat_ids, w.num_experts), stable=True)
    counts = torch.bincount(flat_ids[valid], minlength=w.num_experts).tolist()  # one host sync
    flat_weights = topk.weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        tokens = pairs // topk.top_k
        y = expert_ffn(x_TH[tokens], w.w13[e], w.w2[e], _bias(w.b13, e), _bias(w.b2, e), act)
        out.index_add_(0, tokens, y * flat_weights[pairs].unsqueeze(-1))
    return out.to(x_TH.dtype)


def run_masked(
    x_ECH: torch.Tensor, counts_E: torch.Tensor, w: ExpertWeights, act: ActivationSpec
) -> torch.Tensor:
    """out [E, C, H] in x's dtype: each expert on its rows; rows at or past counts are zero."""
    C = x_ECH.shape[1]
    y = expert_ffn(x_ECH, w.w13, w.w2, w.b13, w.b2, act)
    valid = torch.arange(C, device=x_ECH.device).unsqueeze(0) < counts_E.unsqueeze(1)
    return (y * valid.unsqueeze(-1)).to(x_ECH.dtype)


@register
class TorchRunner(Runner):
    """Reference runner: PyTorch ops, any device, every activation, biases, both formats."""

    name = "torch"
    caps = RunnerCaps(
        formats=frozenset({STANDARD, MASKED}),
        weight_formats=frozenset({"unquantized"}),
        activations=frozenset(ACTIVATIONS),
        devices=frozenset({"cpu", "cuda"}),
        cuda_graph=False,  # the standard path reads expert counts on the host
    )

    def run(
        self, dispatch_out: DispatchOutput, weights: ExpertWeights, act: ActivationSpec
    ) -> RunnerOutput:
        self.check(dispatch_out, weights, act)
        if isinstance(dispatch_out, MaskedDispatchOutput):
            return MaskedRunnerOutput(run_masked(dispatch_out.x, dispatch_out.counts, weights, act))
        return StandardRunnerOutput(run_standard(dispatch_out.x, dispatch_out.topk, weights, act))


def moe_reference_fp64(
    x_TH: torch.Tensor, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec
) -> torch.Tensor:
    """Float64 MoE output [T, H], computed densely (every expert on every token, then gathered):
    a different code path from `run_standard`, for tests. Ids of -1 contribute 0."""
    f64 = torch.float64
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
