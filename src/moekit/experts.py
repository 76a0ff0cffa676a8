"""What the expert FFNs are: their weights (`ExpertWeights`) and activation (`ActivationSpec`).

Layout (as the common engines and transformers v5): w13 [E, 2I, H] with gate rows first, then up
rows (or alternating rows when `interleaved`); w2 [E, H, I]. Optional biases b13 [E, 2I],
b2 [E, H]. Quantized formats keep the same logical shapes and carry their scales beside (the
tensor layouts per format are in `moekit.quant.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moekit.config import ACTIVATIONS, ConfigError, MoEConfig, check_choice

if TYPE_CHECKING:
    from moekit.quant.quantize import QuantizedTensor
    from moekit.quant.spec import QuantSpec

# The tensors a quantized ExpertWeights carries besides w13 / w2 / b13 / b2.
QUANT_TENSORS = (
    "w13_scale",
    "w2_scale",
    "w13_zero",
    "w2_zero",
    "w13_global_scale",
    "w2_global_scale",
    "a13_scale",
    "a2_scale",
)


@dataclass(frozen=True)
class ActivationSpec:
    """name: 'silu' | 'gelu' | 'swiglu_oai'; alpha/limit are used by swiglu_oai only."""

    name: str = "silu"
    interleaved: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        check_choice("activation", self.name, ACTIVATIONS)
        if self.name == "swiglu_oai" and not self.limit > 0:
            raise ConfigError(f"--swiglu-limit must be > 0, got {self.limit}")

    @classmethod
    def from_config(cls, config: MoEConfig) -> "ActivationSpec":
        return cls(config.activation, config.interleaved, config.swiglu_alpha, config.swiglu_limit)


@dataclass
class ExpertWeights:
    """The expert weights one rank holds (E = local expert slots, I = per-rank intermediate).

    w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I] | None, b2 [E, H] | None. `format` names the
    weight format ('unquantized' keeps w13/w2 in the activation dtype). For a quantized format
    w13 / w2 hold the stored data (packed 4-bit formats: [E, 2I, H/2] / [E, H, I/2] uint8),
    `spec` its QuantSpec (the format's default spec when None), and the scale tensors:
    w13_scale / w2_scale, w13_zero / w2_zero (int4 asymmetric), w13_global_scale /
    w2_global_scale (nvfp4) and a13_scale / a2_scale [E] float32 (the calibrated activation
    scales of the first / second GEMM, for the 'static_tensor' activation scheme only).
    `dequantized()` gives the unquantized twin (the reference path).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    format: str = "unquantized"
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_zero: torch.Tensor | None = None
    w2_zero: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None
    a13_scale: torch.Tensor | None = None
    a2_scale: torch.Tensor | None = None
    spec: "QuantSpec | None" = None

    def __post_init__(self) -> None:
        if self.w13.dim() != 3 or self.w13.shape[1] % 2:
            raise ValueError(
                f"w13 must be [E, 2I, H] (gate and up rows), got {list(self.w13.shape)}"
            )
        if self.format == "unquantized":
            if self.spec is not None or any(getattr(self, n) is not None for n in QUANT_TENSORS):
                raise ValueError(
                    "format 'unquantized' takes no spec or scale tensors; name the weight "
                    "format (e.g. format='fp8_w8a8') of quantized weights"
                )
        else:
            self._check_quantized()
        E, two_i, H = self.num_experts, 2 * self.intermediate_size, self.hidden_size
        if self.format == "unquantized":
            if self.w2.shape != (E, H, two_i // 2):
                raise ValueError(
                    f"w2 must be [E, H, I] = [{E}, {H}, {two_i // 2}] to match w13 "
                    f"{list(self.w13.shape)}, got {list(self.w2.shape)}"
                )
        if self.b13 is not None and self.b13.shape != (E, two_i):
            raise ValueError(f"b13 must be [E, 2I] = [{E}, {two_i}], got {list(self.b13.shape)}")
        if self.b2 is not None and self.b2.shape != (E, H):
            raise ValueError(f"b2 must be [E, H] = [{E}, {H}], got {list(self.b2.shape)}")

    def _check_quantized(self) -> None:
        from moekit.quant.spec import make_spec

        spec = self.spec if self.spec is not None else make_spec(self.format)
        if spec.name != self.format:
            raise ValueError(f"format {self.format!r} does not match spec {spec.describe()}")
        self.spec = spec
        E, two_i, H = self.w13.shape[0], self.w13.shape[1], self.w13.shape[2] * spec.pack_factor
        I = two_i // 2
        spec.check_tensors(
            (E,), two_i, H, self.w13, self.w13_scale, self.w13_zero, self.w13_global_scale, "w13"
        )
        if self.w2.dim() != 3 or self.w2.shape[0] != E:
            raise ValueError(f"w2 must be [E, H, I (packed)] with E = {E}, got {list(self.w2.shape)}")
        spec.check_tensors(
            (E,), H, I, self.w2, self.w2_scale, self.w2_zero, self.w2_global_scale, "w2"
        )
        static = spec.act_scheme == "static_tensor"
        for name in ("a13_scale", "a2_scale"):
            t = getattr(self, name)
            if static and t is None:
                raise ValueError(
                    f"{name}: activation scheme 'static_tensor' needs calibrated activation "
                    f"scales [E] = [{E}] float32"
                )
            if not static and t is not None:
                raise ValueError(
                    f"{name}: only the 'static_tensor' activation scheme takes activation "
                    f"scales; {spec.describe()} computes them"
                )
            if t is not None and (tuple(t.shape) != (E,) or t.dtype != torch.float32):
                raise ValueError(f"{name} must be [E] = [{E}] float32, got {t.dtype} {list(t.shape)}")

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        pack = self.spec.pack_factor if self.spec is not None else 1
        return self.w13.shape[2] * pack

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def has_bias(self) -> bool:
        return self.b13 is not None or self.b2 is not None

    @property
    def is_quantized(self) -> bool:
        return self.format != "unquantized"

    def quantized_tensor(self, which: str) -> "QuantizedTensor":
        """w13 or w2 of a quantized ExpertWeights as a QuantizedTensor (logical shape)."""
        from moekit.quant.quantize import QuantizedTensor

        if not self.is_quantized:
            raise ValueError("quantized_tensor: these weights are unquantized")
        if which not in ("w13", "w2"):
            raise ValueError(f"quantized_tensor: which must be 'w13' or 'w2', got {which!r}")
        E, I, H = self.num_experts, self.intermediate_size, self.hidden_size
        shape = (E, 2 * I, H) if which == "w13" else (E, H, I)
        return QuantizedTensor(
            getattr(self, which),
            getattr(self, which + "_scale"),
            self.spec,
            shape,
            getattr(self, which + "_zero"),
            getattr(self, which + "_global_scale"),
        )

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> "ExpertWeights":
        """The unquantized twin: w13 / w2 dequantized to `dtype` (biases kept as they are).
        Unquantized weights are returned unchanged."""
        if not self.is_quantized:
            return self
        from moekit.quant.quantize import dequantize

        return ExpertWeights(
            dequantize(self.quantized_tensor("w13"), dtype),
            dequantize(self.quantized_tensor("w2"), dtype),
            self.b13,
            self.b2,
        )
