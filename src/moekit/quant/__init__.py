"""Quantized expert weight formats: specs, the quantize/dequantize reference, bit packing,
activation quantizers and checkpoint loaders.

    from moekit.quant import FORMATS, quantize, dequantize, quantize_experts
    q = quantize(w_ENK, "int4_w4a16", group_size=64)      # QuantizedTensor
    w = dequantize(q)                                      # float32 [E, N, K]
    experts_q = quantize_experts(layer.expert_weights, "fp8_w8a8")
    a13, a2 = calibrate_static_scales(layer.expert_weights, layer.act, x_TH)  # static_tensor
"""

from moekit.quant.calibrate import calibrate_static_scales
from moekit.quant.expert_weights import from_quantized, quantize_experts
from moekit.quant.quantize import QuantizedTensor, dequantize, quantize
from moekit.quant.spec import (
    FORMATS,
    MXFP4,
    NVFP4,
    SPECS,
    Fp8W8A8,
    Int4W4A16,
    Int8W8A8,
    Int8W8A16,
    QuantSpec,
    format_name,
    make_spec,
)

WeightFormat = QuantSpec  # the name for the spec type

__all__ = [
    "FORMATS",
    "MXFP4",
    "NVFP4",
    "SPECS",
    "Fp8W8A8",
    "Int4W4A16",
    "Int8W8A8",
    "Int8W8A16",
    "QuantSpec",
    "QuantizedTensor",
    "WeightFormat",
    "calibrate_static_scales",
    "dequantize",
    "format_name",
    "from_quantized",
    "make_spec",
    "quantize",
    "quantize_experts",
]
