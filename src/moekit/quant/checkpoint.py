"""A checkpoint's declared quantization as a moekit weight format: the `quantization_config` of
a Hugging Face config.json, or the `quantization` section of ModelOpt's hf_quant_config.json.

Read (anything else is a ConfigError that says what is not read, and why):
  quant_method 'fp8'          e4m3; `weight_block_size` [128, 128] block-wise weights with
                              per-token-group activations (DeepSeek-V3), else per-tensor weights;
                              activation_scheme 'dynamic' or 'static' (calibrated input_scale)
  'gptq'                      bits 4, group_size 32 / 64 / 128, sym, no desc_act;
                              checkpoint_format 'gptq_v2' stores zero points without v1's
                              offset of 1 (`gptq_zero_offset` 0)
  'awq'                       bits 4, group_size 32 / 64 / 128, zero_point, version 'gemm'
  'mxfp4'                     gpt-oss's blocks / scales
  'modelopt'                  quant_algo FP8 (per tensor, static), FP8_PER_CHANNEL_PER_TOKEN,
                              NVFP4 (run weight-only: Hopper has no fp4 tensor cores)
  'compressed-tensors'        one config group: 8-bit float weights (strategy tensor, channel
                              or block [128, 128]) or symmetric int weights (channel), with the
                              activations its input_activations give (dynamic token / tensor /
                              group 128, static tensor; int: dynamic token, or none for
                              weight-only); or 4-bit int weights, format pack-quantized,
                              strategy group 32 / 64 / 128, symmetric or not, weight-only, no
                              group act-order (Kimi-K2's int4 experts, llm-compressor's W4A16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from moekit.config import ConfigError
from moekit.quant.spec import INT4_GROUP_SIZES, QuantSpec, make_spec


@dataclass(frozen=True)
class CheckpointFormat:
    """spec: the weight format the checkpoint declares (the format's defaults where it is
    silent; GPTQ / AWQ scales float16); declared: the spec fields that weights loaded from it
    must match (not the scales' dtype, nor an asymmetric int4 that loads symmetric);
    gptq_zero_offset: what GPTQ zero points are stored minus (1 in v1 checkpoints, 0 in v2);
    source: where it was read, for messages."""

    spec: QuantSpec
    declared: Mapping[str, object]
    gptq_zero_offset: int = 1
    source: str = "quantization_config"

    def load_options(self) -> dict:
        """Keywords of `moekit.quant.loaders.load_weight` for this checkpoint's tensors."""
        scheme = self.declared.get("activation_scheme")
        return {"gptq_zero_offset": self.gptq_zero_offset,  # static: from each input_scale
                "fp8_activation_scheme": None if scheme == "static_tensor" else scheme,
                "int8_weight_only": self.spec.name == "int8_w8a16"}

    def check(self, loaded: QuantSpec | None, what: str = "the experts") -> None:
        """ValueError unless weights loaded as `loaded` (None: unquantized) are in the declared
        format (a GPTQ v2 checkpoint read as v1 shows up here as asymmetric zero points)."""
        got = "unquantized" if loaded is None else loaded.describe()
        if loaded is None or loaded.name != self.spec.name or any(
            getattr(loaded, k) != v for k, v in self.declared.items()
        ):
            hint = ""
            if self.spec.name == "int4_w4a16" and self.declared.get("symmetric") and (
                loaded is not None and loaded.name == self.spec.name
            ):
                hint = (" (symmetric zero points read as asymmetric: is it a GPTQ v2 "
                        "checkpoint? its checkpoint_format says gptq_v2)")  # fmt: skip
            raise ValueError(f"{what} load as {got}, but {self.source} declares "
                             f"{self.spec.describe()}{hint}")  # fmt: skip


def _int(qc: Mapping, key: str, allowed: tuple, source: str, default=None) -> int:
    value = qc.get(key, default)
    if value not in allowed:
        raise ConfigError(f"{source}: {key} = {value!r}: moekit reads "
                          f"{', '.join(map(repr, allowed))}")  # fmt: skip
    return value


def _fp8(qc: Mapping, source: str) -> tuple[str, dict]:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{source}: fmt = {qc['fmt']!r}: moekit reads fp8 e4m3 weights")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{source}: activation_scheme = {scheme!r}: allowed dynamic, static")
    block = qc.get("weight_block_size")
    if block is None:
        act = "static_tensor" if scheme == "static" else "dynamic_tensor"
        return "fp8_w8a8", {"weight_scale": "tensor", "activation_scheme": act}
    if list(block) != [128, 128] or scheme != "dynamic":
        raise ConfigError(f"{source}: weight_block_size {list(block)} with {scheme} activations: "
                          "moekit reads block-wise fp8 as [128, 128] blocks with dynamic "
                          "activations")  # fmt: skip
    return "fp8_w8a8", {"weight_scale": "block", "activation_scheme": "token_group"}


def _gptq(qc: Mapping, source: str) -> tuple[str, dict, int]:
    _int(qc, "bits", (4,), source)
    group = _int(qc, "group_size", INT4_GROUP_SIZES, source)
    if qc.get("desc_act"):
        raise ConfigError(f"{source}: desc_act = true (act-order, a g_idx permutation of K): "
                          "moekit reads GPTQ checkpoints without act-order")  # fmt: skip
    form = qc.get("checkpoint_format", "gptq")
    if form not in ("gptq", "gptq_v2"):
        raise ConfigError(f"{source}: checkpoint_format = {form!r}: allowed gptq, gptq_v2")
    params = {"group_size": group, "symmetric": bool(qc.get("sym", True)),
              "scale_dtype": torch.float16}  # fmt: skip
    return "int4_w4a16", params, 0 if form == "gptq_v2" else 1


def _awq(qc: Mapping, source: str) -> tuple[str, dict]:
    _int(qc, "bits", (4,), source, qc.get("w_bit"))
    group = _int(qc, "group_size", INT4_GROUP_SIZES, source, qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"{source}: version = {version!r}: moekit reads AWQ's gemm packing")
    if not qc.get("zero_point", True):
        raise ConfigError(f"{source}: zero_point = false: moekit reads AWQ with zero points")
    return "int4_w4a16", {"group_size": group, "symmetric": False, "scale_dtype": torch.float16}


MODELOPT_ALGOS = {
    "FP8": {"weight_scale": "tensor", "activation_scheme": "static_tensor"},
    "FP8_PER_CHANNEL_PER_TOKEN": {"weight_scale": "channel", "activation_scheme": "token"},
}


def _modelopt(qc: Mapping, source: str) -> tuple[str, dict]:
    algo = str(qc.get("quant_algo", "")).upper()
    if algo == "NVFP4":
        return "nvfp4", {}
    if algo in MODELOPT_ALGOS:
        return "fp8_w8a8", dict(MODELOPT_ALGOS[algo])
    raise ConfigError(f"{source}: quant_algo = {qc.get('quant_algo')!r}: moekit reads "
                      f"{', '.join([*MODELOPT_ALGOS, 'NVFP4'])}")  # fmt: skip


CT_ACTIVATIONS = {  # (strategy, dynamic) of input_activations -> activation_scheme
    ("token", True): "token",
    ("tensor", True): "dynamic_tensor",
    ("tensor", False): "static_tensor",
    ("group", True): "token_group",
}


def _ct_int4(w: Mapping, a: Mapping | None, form: str | None, where: str) -> tuple[str, dict]:
    """A compressed-tensors group of 4-bit int weights -> int4_w4a16."""
    if form not in ("pack-quantized", None) or a is not None:
        raise ConfigError(f"{where}: 4-bit int weights in format {form!r} with input_activations "
                          f"{'set' if a is not None else 'none'}: moekit reads pack-quantized "
                          "4-bit weights without activation quantization (W4A16)")  # fmt: skip
    if w.get("strategy") != "group":
        raise ConfigError(f"{where}: 4-bit weights with strategy {w.get('strategy')!r}: moekit "
                          "reads strategy group")  # fmt: skip
    group = _int(w, "group_size", INT4_GROUP_SIZES, where)
    if w.get("actorder") in ("group", "dynamic"):
        raise ConfigError(f"{where}: actorder = {w['actorder']!r} (a weight_g_idx permutation "
                          "of K): moekit reads 4-bit weights without group act-order")  # fmt: skip
    return "int4_w4a16", {"group_size": group, "symmetric": bool(w.get("symmetric", True))}


def _compressed_tensors(qc: Mapping, source: str) -> tuple[str, dict]:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{source}: compressed-tensors with {len(groups)} config groups: "
                          "moekit reads one (every expert weight in one scheme)")  # fmt: skip
    (name, group), = groups.items()
    where = f"{source}: config_groups.{name}"
    w, a = group.get("weights") or {}, group.get("input_activations")
    if (w.get("num_bits"), w.get("type")) == (4, "int"):
        return _ct_int4(w, a, group.get("format", qc.get("format")), where)
    if w.get("num_bits") != 8 or w.get("type") not in ("float", "int"):
        raise ConfigError(f"{where}: weights of {w.get('num_bits')} bits, type {w.get('type')!r}: "
                          "moekit reads 8-bit float or int, and 4-bit int weights from "
                          "compressed-tensors")  # fmt: skip
    strategy = w.get("strategy")
    if a is not None:
        act = (a.get("strategy"), bool(a.get("dynamic")))
        if act not in CT_ACTIVATIONS or a.get("num_bits") != 8 or (
            act[0] == "group" and a.get("group_size") != 128
        ):
            raise ConfigError(f"{where}: input_activations {a.get('num_bits')} bits, strategy "
                              f"{act[0]!r}, dynamic {act[1]}: moekit reads dynamic token, tensor "
                              "or group 128, or static tensor")  # fmt: skip
    if w["type"] == "int":
        if strategy != "channel" or not w.get("symmetric", True) or (
            a is not None and act != ("token", True)
        ):
            raise ConfigError(f"{where}: int8 weights read symmetric per channel, with dynamic "
                              "per-token int8 activations or none")  # fmt: skip
        return ("int8_w8a16" if a is None else "int8_w8a8"), {}
    if a is None:
        raise ConfigError(f"{where}: fp8 weights without input_activations (weight-only fp8): "
                          "moekit runs fp8 weights with fp8 activations")  # fmt: skip
    if strategy not in ("tensor", "channel", "block") or (
        strategy == "block" and list(w.get("block_structure") or ()) != [128, 128]
    ):
        raise ConfigError(f"{where}: fp8 weight strategy {strategy!r}: moekit reads tensor, "
                          "channel or block [128, 128]")  # fmt: skip
    return "fp8_w8a8", {"weight_scale": strategy, "activation_scheme": CT_ACTIVATIONS[act]}


def checkpoint_format(qc: Mapping, source: str = "quantization_config") -> CheckpointFormat:
    """The weight format a checkpoint's quantization config declares (module docstring);
    ConfigError naming the field when moekit does not read it."""
    method = str(qc.get("quant_method", "")).lower()
    offset = 1
    if method == "fp8":
        name, params = _fp8(qc, source)
    elif method == "gptq":
        name, params, offset = _gptq(qc, source)
    elif method == "awq":
        name, params = _awq(qc, source)
    elif method == "mxfp4":
        name, params = "mxfp4", {}
    elif method == "modelopt":
        name, params = _modelopt(qc, source)
    elif method == "compressed-tensors":
        name, params = _compressed_tensors(qc, source)
    else:
        raise ConfigError(f"{source}: quant_method {qc.get('quant_method')!r}: moekit reads fp8, "
                          "gptq, awq, mxfp4, modelopt and compressed-tensors")  # fmt: skip
    # what loads must match: not the scales' dtype, nor asymmetric int4 (a checkpoint whose
    # zero points are all 8 loads symmetric)
    declared = {k: v for k, v in params.items()
                if k != "scale_dtype" and (k, v) != ("symmetric", False)}  # fmt: skip
    return CheckpointFormat(make_spec(name, **params), declared, offset, source)
