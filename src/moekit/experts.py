"""What the expert FFNs are: their weights (`ExpertWeights`) and activation (`ActivationSpec`).

Layout (as the common engines and transformers v5): w13 [E, 2I, H] with gate rows first, then up
rows (or alternating rows when `interleaved`); w2 [E, H, I]. Optional biases b13 [E, 2I],
b2 [E, H]. Quantized formats keep the same logical shapes and carry their scales beside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.config import MoEConfig


@dataclass(frozen=True)
class ActivationSpec:
    """name: 'silu' | 'gelu' | 'swiglu_oai'; alpha/limit are used by swiglu_oai only."""

    name: str = "silu"
    interleaved: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def from_config(cls, config: MoEConfig) -> "ActivationSpec":
        return cls(config.activation, config.interleaved, config.swiglu_alpha, config.swiglu_limit)


@dataclass
class ExpertWeights:
    """The expert weights one rank holds (E = local expert slots, I = per-rank intermediate).

    w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I] | None, b2 [E, H] | None. `format` names the
    weight format ('unquantized' keeps w13/w2 in the activation dtype); quantized formats set
    the scale tensors.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    format: str = "unquantized"
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        E, two_i, H = self.w13.shape
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

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def has_bias(self) -> bool:
        return self.b13 is not None or self.b2 is not None
