"""The MoE block of a Hugging Face `config.json` as a `MoEConfig`, so that `--model` can name a
model that is not a preset (`moekit.presets.model_config`).

Read as plain JSON (no transformers import): the routed experts' shape and routing of the common
MoE families (Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V2/V3, Kimi-K2, GLM-4.5, gpt-oss, OLMoE,
Llama 4; multimodal configs through their `text_config`). What `MoEConfig` cannot hold is listed
in `HFMoE.notes` rather than dropped silently: shared experts (left out, as in the presets: the
routed experts are what the runners run), a shared expert's gate. The checkpoint's
`quantization_config` (or ModelOpt's hf_quant_config.json beside it) is read into
`HFMoE.quantization` (`moekit.quant.checkpoint`); one moekit does not read becomes a note.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from moekit.config import ConfigError, MoEConfig
from moekit.log import log_once
from moekit.quant.checkpoint import CheckpointFormat, checkpoint_format

# Keys of each field, first present wins (order matters: DeepSeek's `intermediate_size` is the
# dense MLP's, its experts' is `moe_intermediate_size`).
EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "moe_k")
INTERMEDIATE_KEYS = ("moe_intermediate_size", "intermediate_size")
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}
# Families whose router takes the top-k of sigmoid scores with a per-expert correction bias
# (DeepSeek's "noaux_tc") whether or not the config says so: transformers' DeepseekV3Config has
# no topk_method or scoring_func, so a config it writes (save_pretrained) names neither.
SIGMOID_BIASED = ("deepseek_v3", "kimi_k2", "glm4_moe", "glm4v_moe")
# Families that renormalize the top-k weights without a `norm_topk_prob` key (a softmax over the
# selected logits is the renormalized softmax).
RENORMALIZED = ("mixtral", "gpt_oss")
# model_type values whose routing this module reads as the model computes it; for any other the
# generic fields are read and a note says so.
KNOWN_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "deepseek_v2", "deepseek_v3",
                  "kimi_k2", "glm4_moe", "glm4v_moe", "gpt_oss", "olmoe", "llama4", "llama4_text")


@dataclass(frozen=True)
class HFMoE:
    """config: the MoE block (global sizes, routed experts only, unquantized); notes: what it
    leaves out; quantization: the weight format the checkpoint declares, or None."""

    config: MoEConfig
    notes: tuple[str, ...]
    quantization: CheckpointFormat | None = None


def _first(cfg: dict, keys: tuple[str, ...], what: str, source: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{source}: {key} = {value!r}: moekit needs one integer "
                                  f"{what} for every MoE layer")  # fmt: skip
            return value
    raise ConfigError(f"{source}: no {what} (looked for {', '.join(keys)}): not a MoE model "
                      "config, or a family moekit does not read")  # fmt: skip


def _moe_section(cfg: dict) -> dict:
    """The dict holding the MoE fields: the config itself or its `text_config`."""
    if not any(k in cfg for k in EXPERTS_KEYS) and isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"]
    return cfg


def from_hf_config(doc: dict, source: str = "config.json") -> HFMoE:
    """The MoE block of a parsed Hugging Face config (see the module docstring); ConfigError
    naming the file and field when it cannot be represented."""
    cfg = _moe_section(doc)
    family = str(cfg.get("model_type", doc.get("model_type", "")))
    llama4 = family.startswith("llama4")  # sigmoid of the chosen logits, one shared expert
    notes: list[str] = []
    num_experts = _first(cfg, EXPERTS_KEYS, "number of routed experts", source)
    top_k = _first(cfg, TOP_K_KEYS, "experts per token", source)
    hidden = _first(cfg, ("hidden_size",), "hidden size", source)
    intermediate = _first(cfg, INTERMEDIATE_KEYS, "expert intermediate size", source)
    kw: dict = {}
    if family == "gpt_oss":
        kw.update(activation="swiglu_oai", swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                  interleaved=True, has_bias=True)  # fmt: skip
    else:
        act = str(cfg.get("hidden_act", "silu"))
        if act not in HF_ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act {act!r}: moekit runs "
                              f"{', '.join(sorted(HF_ACTIVATIONS))} (GLU experts)")  # fmt: skip
        kw["activation"] = HF_ACTIVATIONS[act]
    method = cfg.get("topk_method")
    biased = method == "noaux_tc" or family in SIGMOID_BIASED
    scoring = "sigmoid" if biased or llama4 else cfg.get("scoring_func", "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"{source}: scoring_func {scoring!r}: allowed softmax, sigmoid")
    kw["scoring_func"] = scoring
    kw["use_correction_bias"] = biased
    groups, picked = cfg.get("n_group"), cfg.get("topk_group")
    if groups and groups > 1 and picked and method != "greedy":
        kw.update(num_expert_group=int(groups), topk_group=int(picked))
    if llama4:
        kw["renormalize"] = False
        notes.append("Llama 4 scales each expert's input by its router score; moekit weights "
                     "the expert's output (the same cost, not the same values)")
    else:
        kw["renormalize"] = bool(cfg.get("norm_topk_prob", family in RENORMALIZED))
    kw["routed_scaling_factor"] = float(cfg.get("routed_scaling_factor") or 1.0)
    gated_size = cfg.get("shared_expert_intermediate_size")  # Qwen's gated shared expert
    shared = 1 if llama4 or gated_size else int(cfg.get("n_shared_experts") or 0)
    if shared:
        size = gated_size or shared * intermediate
        gate = ", with a sigmoid gate" if gated_size else ""
        notes.append(f"shared experts left out ({shared}, intermediate size {size}{gate}): the "
                     "layer runs the routed experts, as with the presets")  # fmt: skip
    if family not in KNOWN_FAMILIES:
        notes.append(f"model_type {family or '(none)'!r} is not one moekit knows: its routing "
                     "was read from the generic fields (scoring_func, norm_topk_prob, n_group, "
                     "topk_group, topk_method, routed_scaling_factor); check them against the "
                     "model's router")  # fmt: skip
    quantization = None
    quant = cfg.get("quantization_config") or doc.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        try:
            quantization = checkpoint_format(quant, f"{source}: quantization_config")
        except ConfigError as err:
            notes.append(f"checkpoint quantization not read ({err}); without --quantization "
                         "the experts run unquantized")  # fmt: skip
    try:
        config = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=hidden,
                           intermediate_size=intermediate, **kw)  # fmt: skip
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
    return HFMoE(config, tuple(notes), quantization)


def _with_modelopt(doc: dict, path: Path) -> dict:
    """doc with the `quantization` of ModelOpt's hf_quant_config.json beside it (when the
    config.json has no quantization_config) as its quantization_config."""
    side = path.parent / "hf_quant_config.json"
    if doc.get("quantization_config") or not side.is_file():
        return doc
    try:
        quant = json.loads(side.read_text()).get("quantization")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{side}: cannot read ModelOpt's quantization: {err}") from err
    if not isinstance(quant, dict):
        return doc
    return {**doc, "quantization_config": {"quant_method": "modelopt", **quant}}


def read_hf_config(path: str | Path) -> HFMoE:
    """`from_hf_config` of a config.json file, or of the config.json in a directory."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {path}: cannot read a Hugging Face config.json: {err}") from err
    if not isinstance(doc, dict):
        raise ConfigError(f"--model {path}: a config.json holds a JSON object")
    return from_hf_config(_with_modelopt(doc, path), str(path))


def load_hf_config(path: str | Path) -> HFMoE:
    """`read_hf_config`, each note logged once."""
    hf = read_hf_config(path)
    for note in hf.notes:
        log_once(logging.WARNING, f"{path}: {note}")
    return hf
