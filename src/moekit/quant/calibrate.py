"""Calibrate the static per-tensor activation scales of the 'static_tensor' activation scheme
(fp8_w8a8): one scale per expert for the input of each GEMM, from sample activations.

    a13, a2 = calibrate_static_scales(layer.expert_weights, layer.act, x_TH, topk)
    layer.quantize_weights_("fp8_w8a8", weight_scale="tensor",
                            activation_scheme="static_tensor", a13_scale=a13, a2_scale=a2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant.act_quant import tensor_scale
from moekit.quant.spec import FP8_DTYPE

if TYPE_CHECKING:
    from moekit.router import TopKOutput

# Rows of x per first-GEMM product: bounds the float32 [rows, 2I] intermediate of one expert.
CHUNK_ROWS = 8192


def _check(weights: ExpertWeights, x_TH: torch.Tensor, topk: TopKOutput | None) -> None:
    H = weights.hidden_size
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2 or x_TH.shape[1] != H:
        got = list(x_TH.shape) if isinstance(x_TH, torch.Tensor) else type(x_TH).__name__
        raise ValueError(f"calibrate_static_scales: x must be [T, H] with H = {H}, got {got}")
    if not x_TH.is_floating_point():
        raise ValueError(f"calibrate_static_scales: x must be a float tensor, got {x_TH.dtype}")
    if x_TH.shape[0] == 0:
        raise ValueError(
            "calibrate_static_scales: x has no tokens (T = 0): nothing to calibrate; pass "
            "sample activations [T >= 1, H]"
        )
    if topk is not None:
        ids, T = topk.ids, x_TH.shape[0]
        if ids.dim() != 2 or ids.shape[0] != T or ids.is_floating_point():
            raise ValueError(
                f"calibrate_static_scales: topk.ids must be integer [T, K] with T = {T} (the "
                f"tokens of x), got {ids.dtype} {list(ids.shape)}"
            )


def _routed_rows(ids_TK: torch.Tensor, E: int) -> list[torch.Tensor]:
    """Per expert e < E: the token indices t with ids[t, k] == e for some k (a token routed
    twice to e may appear twice); ids outside [0, E) are ignored."""
    ids = ids_TK.long()
    valid = (ids >= 0) & (ids < E)
    tokens = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[valid]
    experts = ids[valid]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=E).tolist()
    return list(torch.split(tokens[order], counts))


@torch.no_grad()
def calibrate_static_scales(
    weights: ExpertWeights,
    act: ActivationSpec,
    x_TH: torch.Tensor,
    topk: TopKOutput | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert static activation scales from sample activations x [T, H] (any float dtype):
    (a13_scale [E], a2_scale [E]) float32 on the weights' device, for
    `quantize_experts(..., a13_scale=, a2_scale=)` / `MoE.quantize_weights_`.

    a13_scale[e] = amax |x_e| / 448 and a2_scale[e] = amax |activate(x_e @ w13[e].T + b13[e])|
    / 448 (the inputs of expert e's two GEMMs; fp8 e4m3 max 448), where x_e are the tokens
    expert e sees: with `topk` (ids [T, K], int) the tokens routed to e (ids == e in any slot;
    ids outside [0, E), i.e. -1 masked or not local, are ignored), and an expert no token
    reaches is calibrated on all T tokens; without `topk` every expert sees all T tokens.
    An all-zero input gives the `act_quant.tensor_scale` floor eps / 448 (eps = 1e-10).
    Quantized weights are dequantized first (to recalibrate a quantized layer). Float32 math,
    one expert at a time, in blocks of CHUNK_ROWS rows (no [E, T, 2I] tensor)."""
    _check(weights, x_TH, topk)
    from moekit.runners.torch import activate  # the reference activation (runners sit above)

    w = weights.dequantized(torch.float32)
    E, dev = w.num_experts, w.w13.device
    x = x_TH.to(dev)
    amax_T = x.abs().amax(dim=1).float()  # [T]: each token's amax, shared by all experts
    routed = _routed_rows(topk.ids.to(dev), E) if topk is not None else [None] * E
    a13 = torch.empty(E, dtype=torch.float32, device=dev)
    a2 = torch.empty(E, dtype=torch.float32, device=dev)
    for e, rows in enumerate(routed):
        if rows is not None and rows.numel() == 0:
            rows = None  # no token reaches expert e: calibrate it on all tokens
        xe = x if rows is None else x[rows]
        a13[e] = tensor_scale(amax_T if rows is None else amax_T[rows], FP8_DTYPE)[0]
        w13 = w.w13[e].float()
        b13 = w.b13[e].float() if w.b13 is not None else None
        amax_h = torch.zeros((), dtype=torch.float32, device=dev)
        for i in range(0, xe.shape[0], CHUNK_ROWS):
            h13 = xe[i : i + CHUNK_ROWS].float() @ w13.T
            if b13 is not None:
                h13 = h13 + b13
            h = activate(h13, act)
            if h.numel():
                amax_h = torch.maximum(amax_h, h.abs().amax())
        a2[e] = tensor_scale(amax_h, FP8_DTYPE)[0]
    return a13, a2


def random_experts_scales(weights: ExpertWeights, spec, act: ActivationSpec) -> dict:
    """The static activation scales that randomly drawn experts of `spec` take when quantized:
    `standard_normal_scales` where the spec's activations are static, else none ({})."""
    return standard_normal_scales(weights, act) if spec.act_scheme == "static_tensor" else {}


def standard_normal_scales(weights: ExpertWeights, act: ActivationSpec,
                           num_tokens: int = 256) -> dict[str, torch.Tensor]:  # fmt: skip
    """{'a13_scale', 'a2_scale'} [E] calibrated on x ~ N(0, 1) (seed 0, `num_tokens` tokens,
    every expert on every token): the static scales of randomly drawn experts (benchmarks,
    tuning), whose inputs are standard normal."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, weights.hidden_size, generator=g)
    a13, a2 = calibrate_static_scales(weights, act, x)
    return dict(a13_scale=a13, a2_scale=a2)
