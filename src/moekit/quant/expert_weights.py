"""Quantize a whole `ExpertWeights` (w13 and w2 of every expert) to a weight format: what
`MoE.quantize_weights_` and the CLI's `--quantization` call."""

from __future__ import annotations

import torch

from moekit.experts import ExpertWeights
from moekit.quant.quantize import QuantizedTensor, quantize
from moekit.quant.spec import QuantSpec, make_spec


def from_quantized(
    w13: QuantizedTensor,
    w2: QuantizedTensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    *,
    a13_scale: torch.Tensor | None = None,
    a2_scale: torch.Tensor | None = None,
) -> ExpertWeights:
    """ExpertWeights from the quantized w13 [E, 2I, H] and w2 [E, H, I] (same spec)."""
    if w13.spec != w2.spec:
        raise ValueError(f"w13 is {w13.spec.describe()} but w2 is {w2.spec.describe()}")
    return ExpertWeights(
        w13.data,
        w2.data,
        b13,
        b2,
        w13.spec.name,
        w13_scale=w13.scale,
        w2_scale=w2.scale,
        w13_zero=w13.zero,
        w2_zero=w2.zero,
        w13_global_scale=w13.global_scale,
        w2_global_scale=w2.global_scale,
        a13_scale=a13_scale,
        a2_scale=a2_scale,
        spec=w13.spec,
    )


def _act_scale(name: str, s, E: int, device) -> torch.Tensor | None:
    if s is None:
        return None
    try:
        t = torch.as_tensor(s, dtype=torch.float32, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"{name} must be a number or a tensor [E], got {type(s).__name__}"
        ) from None
    if t.numel() == 1:
        t = t.reshape(1).expand(E).contiguous()
    if tuple(t.shape) != (E,):
        raise ValueError(f"{name} must be one value or [E] = [{E}], got {list(t.shape)}")
    if not (torch.isfinite(t) & (t > 0)).all():  # a host read, once per quantization
        raise ValueError(f"{name}: activation scales must be finite and > 0, got {t.tolist()[:8]}")
    return t


def quantize_experts(
    weights: ExpertWeights,
    fmt: str | QuantSpec,
    *,
    a13_scale: torch.Tensor | float | None = None,
    a2_scale: torch.Tensor | float | None = None,
    **params,
) -> ExpertWeights:
    """Quantize unquantized `weights` to `fmt` (a name with optional spec parameters, or a
    QuantSpec); 'unquantized' returns them unchanged. a13_scale / a2_scale: calibrated
    activation scales (one value or [E]) for the 'static_tensor' activation scheme."""
    spec = make_spec(fmt, **params)
    if weights.is_quantized:
        raise ValueError(f"quantize_experts: the weights are already {weights.spec.describe()}")
    if spec is None:
        return weights
    E, dev = weights.num_experts, weights.w13.device
    I, H = weights.intermediate_size, weights.hidden_size
    spec.check_k(2 * I, H, "w13")
    spec.check_k(H, I, "w2")
    return from_quantized(
        quantize(weights.w13, spec),
        quantize(weights.w2, spec),
        weights.b13,
        weights.b2,
        a13_scale=_act_scale("a13_scale", a13_scale, E, dev),
        a2_scale=_act_scale("a2_scale", a2_scale, E, dev),
    )
