"""Model presets: the MoE block of well-known models (global shapes), as plain data."""

from __future__ import annotations

from dataclasses import replace

from moekit.config import ConfigError, MoEConfig

PRESETS: dict[str, MoEConfig] = {
    "qwen3-30b-a3b": MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768),
    "qwen3-235b-a22b": MoEConfig(
        num_experts=128, top_k=8, hidden_size=4096, intermediate_size=1536
    ),
    "mixtral-8x7b": MoEConfig(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336),
    "deepseek-v3": MoEConfig(
        num_experts=256,
        top_k=8,
        hidden_size=7168,
        intermediate_size=2048,
        scoring_func="sigmoid",
        num_expert_group=8,
        topk_group=4,
        use_correction_bias=True,
        routed_scaling_factor=2.5,
    ),
    "gpt-oss-120b": MoEConfig(
        num_experts=128,
        top_k=4,
        hidden_size=2880,
        intermediate_size=2880,
        activation="swiglu_oai",
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        interleaved=True,
        has_bias=True,
    ),
}


def preset(name: str, **overrides) -> MoEConfig:
    """The preset `name`, with any MoEConfig field overridden (dtype='float16', ...)."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
