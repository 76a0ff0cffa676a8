"""A checkpoint's quantization_config as a weight format (`moekit.quant.checkpoint`): each
method's mapping and errors, what the layer's load takes from it (GPTQ v2 zero points, an fp8
activation scheme the tensors cannot show) and the mismatches it catches; ModelOpt's
hf_quant_config.json; `--quantization` defaulting to the checkpoint's format."""

import json

import pytest
import torch

from moekit import MoE
from moekit.cli.main import main
from moekit.config import ConfigError
from moekit.hf_config import read_hf_config
from moekit.presets import model_and_format
from moekit.quant.checkpoint import checkpoint_format
from moekit.quant.spec import format_text
from tests.test_loading_quant import _fp8, config, quantized_sd, weights
from tests.test_quant_loaders import ct_packed_checkpoint, gptq_checkpoint

CT_FP8_DYNAMIC = {  # RedHat-style "FP8-dynamic": per-channel weights, per-token activations
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True}}},
}  # fmt: skip


def _ct(weights=None, acts=None):
    group = CT_FP8_DYNAMIC["config_groups"]["group_0"]
    new = {**group, "weights": {**group["weights"], **(weights or {})}}
    new["input_activations"] = None if acts is False else {**group["input_activations"],
                                                           **(acts or {})}  # fmt: skip
    return {**CT_FP8_DYNAMIC, "config_groups": {"group_0": new}}


CT_W4A16 = {  # llm-compressor W4A16 / Kimi-K2's int4 experts
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                    "symmetric": True, "dynamic": False, "actorder": None}}},
}  # fmt: skip


def _ct4(**weights):
    group = CT_W4A16["config_groups"]["group_0"]
    new = {**group, "weights": {**group["weights"], **weights}}
    return {**CT_W4A16, "config_groups": {"group_0": new}}


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}


@pytest.mark.parametrize("qc, text, offset", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
      "weight_block_size": [128, 128]}, "fp8_w8a8", 1),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     "fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor", 1),
    ({"quant_method": "fp8"}, "fp8_w8a8:weight_scale=tensor", 1),
    (GPTQ, "int4_w4a16:group_size=32,scale_dtype=float16", 1),
    ({**GPTQ, "group_size": 128, "checkpoint_format": "gptq_v2"},
     "int4_w4a16:scale_dtype=float16", 0),
    ({**GPTQ, "sym": False}, "int4_w4a16:group_size=32,symmetric=false,scale_dtype=float16", 1),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
      "version": "GEMM"},
     "int4_w4a16:group_size=64,symmetric=false,scale_dtype=float16", 1),
    ({"quant_method": "mxfp4"}, "mxfp4", 1),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "nvfp4", 1),
    ({"quant_method": "modelopt", "quant_algo": "FP8"},
     "fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor", 1),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
     "fp8_w8a8:weight_scale=channel", 1),
    (CT_FP8_DYNAMIC, "fp8_w8a8:weight_scale=channel", 1),
    (_ct(acts={"strategy": "tensor", "dynamic": False}),
     "fp8_w8a8:weight_scale=channel,activation_scheme=static_tensor", 1),
    (_ct({"strategy": "block", "block_structure": [128, 128]},
         {"strategy": "group", "group_size": 128}), "fp8_w8a8", 1),
    (_ct({"type": "int"}), "int8_w8a8", 1),
    (_ct({"type": "int"}, False), "int8_w8a16", 1),
    (CT_W4A16, "int4_w4a16:group_size=32", 1),
    (_ct4(group_size=128, symmetric=False, actorder="weight"), "int4_w4a16:symmetric=false", 1),
])  # fmt: skip
def test_each_method_maps_to_a_format(qc, text, offset):
    got = checkpoint_format(qc)
    assert format_text(got.spec) == text and got.gptq_zero_offset == offset


@pytest.mark.parametrize("qc, needle", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes': moekit reads fp8, gptq"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt = 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"quant_method": "fp8", "activation_scheme": "mixed"}, "allowed dynamic, static"),
    ({**GPTQ, "bits": 8}, "bits = 8: moekit reads 4"),
    ({**GPTQ, "group_size": -1}, "group_size = -1: moekit reads 32, 64, 128"),
    ({**GPTQ, "desc_act": True}, "desc_act = true (act-order"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format = 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemm packing"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_algo = 'W4A8_AWQ'"),
    ({**CT_FP8_DYNAMIC, "config_groups": {}}, "with 0 config groups"),
    (_ct({"num_bits": 4, "type": "float"}), "4-bit int weights from compressed-tensors"),
    (_ct({"num_bits": 4, "type": "int"}), "with input_activations set: moekit reads pack-"),
    ({**CT_W4A16, "format": "marlin-24"}, "format 'marlin-24'"),
    (_ct4(strategy="channel"), "strategy 'channel': moekit reads strategy group"),
    (_ct4(group_size=16), "group_size = 16: moekit reads 32, 64, 128"),
    (_ct4(actorder="group"), "actorder = 'group'"),
    (_ct({"type": "int", "symmetric": False}, False), "int8 weights read symmetric"),
    (_ct(acts=False), "weight-only fp8"),
    (_ct(acts={"strategy": "group", "group_size": 64}), "group 128, or static tensor"),
    (_ct({"strategy": "group"}), "fp8 weight strategy 'group'"),
    (_ct({"type": "int", "strategy": "tensor"}), "int8 weights read symmetric per channel"),
])  # fmt: skip
def test_what_is_not_read_is_a_clear_error(qc, needle):
    with pytest.raises(ConfigError, match="quantization_config") as err:
        checkpoint_format(qc)
    assert needle in str(err.value)


def _gptq_sd(w, zero_offset):
    def write(w_NK):
        (qweight, qzeros, scales, g_idx), _ = gptq_checkpoint(w_NK, 32, sym=True,
                                                              zero_offset=zero_offset)
        return {".qweight": qweight, ".qzeros": qzeros, ".scales": scales, ".g_idx": g_idx}
    return quantized_sd(write, w)


def test_gptq_v2_zero_points_load_through_the_config():
    """A v2 checkpoint (zero points stored without v1's offset) loads with its config to the
    same experts as the v1 checkpoint of the same weights; read as v1 it would load with zero
    points off by one, which the declared symmetric format catches."""
    w = weights()
    v1 = MoE(config())
    v1.load_hf_state_dict(_gptq_sd(w, 1), quantization_config=GPTQ)
    v2 = MoE(config())
    v2.load_hf_state_dict(_gptq_sd(w, 0),
                          quantization_config={**GPTQ, "checkpoint_format": "gptq_v2"})
    assert v2.quant_spec == checkpoint_format(GPTQ).spec  # group 32, symmetric, float16 scales
    a, b = (m.expert_weights.dequantized(torch.float32) for m in (v1, v2))
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
    with pytest.raises(ValueError, match="is it a GPTQ v2 checkpoint"):
        MoE(config()).load_hf_state_dict(_gptq_sd(w, 0), quantization_config=GPTQ)


def test_the_config_gives_the_fp8_activation_scheme_and_must_match():
    w = weights()
    channel = quantized_sd(_fp8("channel", shape=lambda s: s[:, None]), w)
    layer = MoE(config())
    layer.load_hf_state_dict(channel, quantization_config=_ct(acts={"strategy": "tensor"}))
    assert layer.quant_spec.activation_scheme == "dynamic_tensor"  # the tensors alone: token
    layer.load_hf_state_dict(channel, quantization_config=CT_FP8_DYNAMIC)
    assert layer.quant_spec.activation_scheme == "token"
    static = {"quant_method": "fp8", "activation_scheme": "static"}
    with pytest.raises(ValueError, match=r"load as fp8_w8a8\(weight_scale=channel.*declares "
                                         r"fp8_w8a8\(weight_scale=tensor"):  # fmt: skip
        MoE(config()).load_hf_state_dict(channel, quantization_config=static)
    plain = quantized_sd(lambda t: {".weight": t}, w)
    with pytest.raises(ValueError, match="the experts under 'experts.' load as unquantized"):
        MoE(config()).load_hf_state_dict(plain, quantization_config=static)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_int4_experts_load_through_the_config(sym):
    """Kimi-K2 / llm-compressor W4A16 experts (pack-quantized) load exactly, in the declared
    group size and symmetry."""
    w, expect = weights(), {}

    def write(w_NK):
        t, expect[len(expect)] = ct_packed_checkpoint(w_NK, 4, 32, sym)
        return t
    layer = MoE(config())
    layer.load_hf_state_dict(quantized_sd(write, w),
                             quantization_config=_ct4(symmetric=sym))  # fmt: skip
    assert layer.quant_spec.group_size == 32 and layer.quant_spec.symmetric == sym
    got = layer.expert_weights.dequantized(torch.float32)
    E = len(expect) // 3  # written expert by expert: gate, up, down
    w13 = torch.stack([torch.cat([expect[3 * e], expect[3 * e + 1]]) for e in range(E)])
    w2 = torch.stack([expect[3 * e + 2] for e in range(E)])
    assert torch.equal(got.w13, w13) and torch.equal(got.w2, w2)
    with pytest.raises(ValueError, match=r"declares int4_w4a16\(group_size=128"):
        MoE(config()).load_hf_state_dict(quantized_sd(write, w),
                                         quantization_config=_ct4(group_size=128))


@pytest.mark.parametrize("packed", [False, True], ids=["int-quantized", "pack-quantized"])
def test_int8_weight_only_experts_load_as_declared(packed):
    """A W8A16 checkpoint's int8 weights cannot say they run weight-only; its config does (they
    loaded as int8_w8a8 and failed the declared format before)."""
    def write(w_NK):
        if packed:
            return ct_packed_checkpoint(w_NK, 8)[0]
        s = w_NK.abs().amax(1, keepdim=True) / 127
        return {".weight": torch.round(w_NK / s).to(torch.int8), ".weight_scale": s}
    sd = quantized_sd(write, weights())
    for acts, name in ((False, "int8_w8a16"), (None, "int8_w8a8")):
        layer = MoE(config())
        layer.load_hf_state_dict(sd, quantization_config=_ct({"type": "int"}, acts))
        assert layer.quant_spec.name == name


def _model_dir(tmp_path, quant=None, hf_quant=None):
    model = tmp_path / "m"
    model.mkdir(exist_ok=True)
    doc = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
    if quant:
        doc["quantization_config"] = quant
    (model / "config.json").write_text(json.dumps(doc))
    if hf_quant:
        (model / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return model


def test_modelopt_hf_quant_config_beside_the_config(tmp_path):
    model = _model_dir(tmp_path, hf_quant={"producer": {"name": "modelopt"},
                                           "quantization": {"quant_algo": "NVFP4",
                                                            "group_size": 16}})  # fmt: skip
    assert read_hf_config(model).quantization.spec.name == "nvfp4"
    assert read_hf_config(model / "config.json").quantization.source.endswith(
        "config.json: quantization_config")


def test_quantization_defaults_to_the_checkpoints(tmp_path, capsys):
    """Without --quantization a config.json's declared format runs; a given one wins; presets
    and configs without one run unquantized."""
    model = _model_dir(tmp_path, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    cfg, spec = model_and_format(str(model), None)
    assert cfg.weight_format == "fp8_w8a8" and format_text(spec) == "fp8_w8a8"
    assert model_and_format(str(model), "unquantized")[1] is None
    assert model_and_format("qwen3-30b-a3b", None)[1] is None
    out_dir = tmp_path / "res"
    assert main(["bench", "--device", "cpu", "--batch-sizes", "1", "--backends", "torch",
                 "--model", str(model), "--out-dir", str(out_dir), "--no-plot"]) == 0
    (path,) = out_dir.glob("*.json")
    assert json.loads(path.read_text())["quantization"] == "fp8_w8a8"
    assert main(["env", "--explain", "--model", str(model)]) == 0
    assert "fp8_w8a8" in capsys.readouterr().out
