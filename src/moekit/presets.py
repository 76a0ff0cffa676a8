"""Model presets: the MoE block of well-known models (global shapes), as plain data."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from moekit.config import ConfigError, MoEConfig
from moekit.log import log_once
from moekit.quant.spec import QuantSpec, format_name, format_text, make_spec

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
    "kimi-k2": MoEConfig(  # DeepSeek-V3's design with 384 experts in one group
        num_experts=384,
        top_k=8,
        hidden_size=7168,
        intermediate_size=2048,
        scoring_func="sigmoid",
        use_correction_bias=True,
        routed_scaling_factor=2.827,
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


def model_config(model: str, **overrides) -> MoEConfig:
    """The MoE block `--model` names: a preset, or a Hugging Face config.json (the file, or a
    directory holding one; `moekit.hf_config`), with MoEConfig fields overridden. What the
    config holds that MoEConfig cannot is logged once."""
    if model in PRESETS:
        return preset(model, **overrides)
    if not Path(model).exists():
        raise ConfigError(f"--model: {model!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                          "path to a Hugging Face config.json or its directory")  # fmt: skip
    from moekit.hf_config import load_hf_config

    return replace(load_hf_config(model).config, **overrides)


QUANTIZATION_DEFAULT = ("default: the format a config.json's checkpoint declares (its "
                        "quantization_config), else unquantized")


def model_and_format(model: str, quantization: str | QuantSpec | None,
                     **overrides) -> tuple[MoEConfig, QuantSpec | None]:  # fmt: skip
    """`--model` and `--quantization` together: the MoE block (`model_config`, its
    weight_format the spec's name) and the weight format's spec (None: unquantized). Without
    --quantization (None) a config.json's checkpoint gives the format it declares (its
    quantization_config; logged once), anything else runs unquantized."""
    if model in PRESETS or not Path(model).exists():  # (model_config names a bad --model)
        spec = make_spec(quantization)
        return model_config(model, weight_format=format_name(spec), **overrides), spec
    from moekit.hf_config import load_hf_config

    hf = load_hf_config(model)  # read once: the MoE block and the declared format
    if quantization is None and hf.quantization is not None:
        quantization = hf.quantization.spec
        log_once(logging.INFO, f"--model {model}: the checkpoint's weight format, "
                 f"--quantization {format_text(quantization)}")  # fmt: skip
    spec = make_spec(quantization)
    return replace(hf.config, weight_format=format_name(spec), **overrides), spec


def model_label(model: str) -> str:
    """A short name for `--model`: the preset, or the name of the directory holding the
    config.json (e.g. 'GLM-4.5-Air' for /models/GLM-4.5-Air/config.json), else the file's."""
    if model in PRESETS:
        return model
    path = Path(model)
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem if path.suffix == ".json" else path.name or model


def preset(name: str, **overrides) -> MoEConfig:
    """The preset `name`, with any MoEConfig field overridden (dtype='float16', ...)."""
    if name not in PRESETS:
        raise ConfigError(f"--model: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
