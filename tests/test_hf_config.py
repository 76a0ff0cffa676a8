"""`--model` as a Hugging Face config.json (`moekit.hf_config`, `moekit.presets.model_config`):
the MoE fields of the presets' own model configs give the presets back; other families, nested
configs, what is left out, and the errors."""

from __future__ import annotations

import json
import logging
from dataclasses import replace

import pytest

from moekit.config import ConfigError, MoEConfig
from moekit.hf_config import from_hf_config, read_hf_config
from moekit.presets import PRESETS, model_config
from moekit.quant import MXFP4, Fp8W8A8
from moekit.tune import shape_for

# The MoE fields of the models' published config.json files (other fields left out).
HF_CONFIGS = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "hidden_act": "silu", "decoder_sparse_step": 1,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "hidden_act": "silu",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    },
    "kimi-k2": {  # Kimi-K2-Thinking: int4 experts in groups of 32
        "model_type": "kimi_k2", "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.827,
        "hidden_act": "silu",
        "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                "config_groups": {"group_0": {"weights": {
                                    "num_bits": 4, "type": "int", "strategy": "group",
                                    "group_size": 32, "symmetric": True}}}},
    },
    "gpt-oss-120b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
        "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
        "swiglu_limit": 7.0, "hidden_act": "silu", "quantization_config": {"quant_method": "mxfp4"},
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_the_presets_own_configs_give_the_presets(name):
    assert from_hf_config(HF_CONFIGS[name]).config == PRESETS[name]


def test_kimi_k2_declares_its_int4_experts():
    spec = from_hf_config(HF_CONFIGS["kimi-k2"]).quantization.spec
    assert (spec.name, spec.group_size, spec.symmetric) == ("int4_w4a16", 32, True)


def test_notes_name_what_is_left_out():
    notes = from_hf_config(HF_CONFIGS["deepseek-v3"]).notes
    assert any("shared experts left out (1, intermediate size 2048)" in n for n in notes)
    assert not any("quantization" in n for n in notes)  # read, not left out
    declared = from_hf_config(HF_CONFIGS["deepseek-v3"]).quantization
    assert declared.spec == Fp8W8A8("block", activation_scheme="token_group")
    assert from_hf_config(HF_CONFIGS["gpt-oss-120b"]).quantization.spec == MXFP4()
    assert from_hf_config(HF_CONFIGS["qwen3-30b-a3b"]).quantization is None
    unread = {**HF_CONFIGS["mixtral-8x7b"], "quantization_config": {"quant_method": "bnb"}}
    hf = from_hf_config(unread)
    assert hf.quantization is None
    assert any("quant_method 'bnb'" in n and "unquantized" in n for n in hf.notes)
    qwen2 = {"model_type": "qwen2_moe", "hidden_size": 2048, "moe_intermediate_size": 1408,
             "shared_expert_intermediate_size": 5632, "num_experts": 60,
             "num_experts_per_tok": 4, "norm_topk_prob": False}
    hf = from_hf_config(qwen2)
    assert not hf.config.renormalize and hf.config.scoring_func == "softmax"
    assert any("intermediate size 5632, with a sigmoid gate" in n for n in hf.notes)
    assert from_hf_config(HF_CONFIGS["mixtral-8x7b"]).notes == ()
    phi = {"model_type": "phimoe", "hidden_size": 4096, "intermediate_size": 6400,
           "num_local_experts": 16, "num_experts_per_tok": 2}
    assert any("model_type 'phimoe' is not one moekit knows" in n
               for n in from_hf_config(phi).notes)


def test_other_families():
    # DeepSeek-V2-Lite: greedy top-k (its n_group is not a routing constraint), softmax
    lite = {"model_type": "deepseek_v2", "hidden_size": 2048, "moe_intermediate_size": 1408,
            "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
            "norm_topk_prob": False, "routed_scaling_factor": 1.0}
    c = from_hf_config(lite).config
    assert (c.num_experts, c.top_k, c.intermediate_size) == (64, 6, 1408)
    assert c.num_expert_group is None and not c.use_correction_bias and not c.renormalize
    # DeepSeek-V2: groups picked by their best expert (no correction bias)
    v2 = dict(lite, n_routed_experts=160, num_experts_per_tok=6, n_group=8, topk_group=3,
              topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    c = from_hf_config(v2).config
    assert (c.num_expert_group, c.topk_group, c.routed_scaling_factor) == (8, 3, 16.0)
    assert not c.use_correction_bias
    # GLM-4.5-Air: sigmoid scores with a correction bias though the config does not say so
    glm = {"model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
           "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
           "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
           "routed_scaling_factor": 1.0}
    c = from_hf_config(glm).config
    assert c.scoring_func == "sigmoid" and c.use_correction_bias and c.num_expert_group is None
    # Llama 4 Scout, nested in a multimodal config: sigmoid, not renormalized, one shared expert
    scout = {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1}}
    hf = from_hf_config(scout)
    assert (hf.config.num_experts, hf.config.top_k, hf.config.intermediate_size) == (16, 1, 8192)
    assert hf.config.scoring_func == "sigmoid" and not hf.config.renormalize
    assert any("input by its router score" in n for n in hf.notes)
    assert any("shared experts left out (1" in n for n in hf.notes)


@pytest.mark.parametrize(
    "change, message",
    [({"num_local_experts": None}, "no number of routed experts"),
     ({"num_experts_per_tok": [2, 2]}, "num_experts_per_tok = [2, 2]: moekit needs one integer"),
     ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh': moekit runs"),
     ({"num_experts_per_tok": 9}, "--top-k (9) must be at most --num-experts (8)"),
     ({"scoring_func": "sqrtsoftplus"}, "scoring_func 'sqrtsoftplus': allowed softmax, sigmoid")],
)
def test_errors_name_the_file_and_field(change, message):
    doc = {k: v for k, v in {**HF_CONFIGS["mixtral-8x7b"], **change}.items() if v is not None}
    with pytest.raises(ConfigError, match="my/config.json") as err:
        from_hf_config(doc, "my/config.json")
    assert message in str(err.value)


def test_model_config_reads_a_file_or_directory(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIGS["deepseek-v3"]))
    with caplog.at_level(logging.WARNING, logger="moekit"):
        for model in (str(tmp_path), str(tmp_path / "config.json")):
            cfg = model_config(model, dtype="float16", weight_format="fp8_w8a8")
            assert cfg == replace(PRESETS["deepseek-v3"], dtype="float16",
                                  weight_format="fp8_w8a8")
    assert "shared experts left out" in caplog.text
    assert MoEConfig.from_hf(tmp_path) == PRESETS["deepseek-v3"]
    assert model_config("mixtral-8x7b") == PRESETS["mixtral-8x7b"]
    with pytest.raises(ConfigError, match="neither a preset .* nor a path"):
        model_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON object"):
        read_hf_config(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="cannot read a Hugging Face config.json"):
        read_hf_config(tmp_path / "broken.json")


def test_tune_shape_of_a_config_file(tmp_path):
    """`moekit tune --model path` tunes the same per-rank shape as the preset."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["deepseek-v3"]))
    mine, theirs = shape_for(str(path), 8, 8), shape_for("deepseek-v3", 8, 8)
    assert replace(mine, label=theirs.label) == theirs
