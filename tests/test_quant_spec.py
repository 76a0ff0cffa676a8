"""Weight format specs: parameters, errors that name the option and the allowed values, and
ExpertWeights validation of quantized tensors."""

import pytest
import torch

from moekit.config import WEIGHT_FORMATS, ConfigError
from moekit.experts import ExpertWeights
from moekit.quant import FORMATS, SPECS, Fp8W8A8, Int4W4A16, make_spec, quantize, quantize_experts
from moekit.quant.spec import format_name, format_text


def test_formats_match_config():
    assert FORMATS == WEIGHT_FORMATS
    assert set(SPECS) == set(WEIGHT_FORMATS) - {"unquantized"}


@pytest.mark.parametrize(
    "fmt, params, needle",
    [
        ("int4_w4a16", dict(group_size=48), "group_size must be one of 32, 64, 128; got 48"),
        ("int4_w4a16", dict(scale_dtype=torch.int8), "scale_dtype must be one of"),
        ("fp8_w8a8", dict(weight_scale="row"), "weight_scale must be one of 'tensor', 'channel', 'block'"),
        ("fp8_w8a8", dict(block_shape=(64, 64)), "block_shape must be one of (128, 128)"),
        ("fp8_w8a8", dict(activation_scheme="token_grp"), "activation_scheme must be one of"),
        ("mxfp4", dict(group_size=16), "unknown parameter(s) ['group_size']; allowed: none"),
        ("int4", {}, "unknown weight format 'int4'; allowed: unquantized, fp8_w8a8"),
    ],
)
def test_bad_parameters(fmt, params, needle):
    with pytest.raises(ConfigError) as err:
        make_spec(fmt, **params)
    assert needle in str(err.value)


def test_experts_group_error_names_the_weight():
    w = ExpertWeights(torch.randn(2, 64, 128), torch.randn(2, 128, 32))
    with pytest.raises(ValueError, match="w2: int4_w4a16 group_size 64 must divide the input dim K = 32"):
        quantize_experts(w, "int4_w4a16", group_size=64)


def test_fp8_default_activation_schemes():
    assert Fp8W8A8("tensor").act_scheme == "dynamic_tensor"
    assert Fp8W8A8("channel").act_scheme == "token"
    assert Fp8W8A8("block").act_scheme == "token_group"
    assert Fp8W8A8("block").act_group_size == 128
    assert Fp8W8A8("tensor", activation_scheme="static_tensor").act_scheme == "static_tensor"
    assert make_spec("int8_w8a8").act_scheme == "token"
    for name in ("int8_w8a16", "int4_w4a16", "mxfp4", "nvfp4"):
        assert make_spec(name).weight_only


def test_specs_are_hashable_and_equal_by_value():
    assert Int4W4A16(64, False) == make_spec("int4_w4a16", group_size=64, symmetric=False)
    assert len({Int4W4A16(64), Int4W4A16(64), Int4W4A16(32)}) == 2


@pytest.mark.parametrize(
    "fmt, K, needle",
    [
        ("int4_w4a16", 96, "group_size 128 must divide the input dim K = 96"),
        ("mxfp4", 48, "mxfp4 group size 32 must divide the input dim K = 48"),
        ("nvfp4", 40, "nvfp4 group size 16 must divide the input dim K = 40"),
    ],
)
def test_group_must_divide_k(fmt, K, needle):
    with pytest.raises(ValueError) as err:
        quantize(torch.randn(2, 8, K), fmt)
    assert needle in str(err.value)


def test_fp8_block_allows_partial_blocks():
    q = quantize(torch.randn(3, 200, 130), "fp8_w8a8")
    assert q.scale.shape == (3, 2, 2)


def _quantized(fmt="int4_w4a16", **params):
    w = ExpertWeights(torch.randn(2, 64, 128), torch.randn(2, 128, 32))
    return quantize_experts(w, fmt, **params)


def test_expert_weights_logical_sizes_of_packed_formats():
    for fmt in ("int4_w4a16", "mxfp4", "nvfp4"):
        q = _quantized(fmt) if fmt != "int4_w4a16" else _quantized(fmt, group_size=32)
        assert q.w13.shape == (2, 64, 64) and q.w2.shape == (2, 128, 16)
        assert (q.num_experts, q.intermediate_size, q.hidden_size) == (2, 32, 128)
        assert q.format == fmt and q.is_quantized
        d = q.dequantized()
        assert d.w13.shape == (2, 64, 128) and d.w2.shape == (2, 128, 32)
        assert d.format == "unquantized" and d.w13.dtype == torch.bfloat16


def _replace(q, **kw):
    fields = {f: getattr(q, f) for f in q.__dataclass_fields__}
    fields.update(kw)
    return ExpertWeights(**fields)


def test_expert_weights_rejects_bad_scale_shapes_and_dtypes():
    q = _quantized("int4_w4a16", group_size=32)
    with pytest.raises(ValueError, match=r"w13_scale: format int4_w4a16\(group_size=32.*needs shape \[2, 64, 4\], got \[2, 64, 2\]"):
        _replace(q, w13_scale=q.w13_scale[..., :2])
    with pytest.raises(ValueError, match=r"w2_scale: .* needs dtype torch.bfloat16, got torch.float32"):
        _replace(q, w2_scale=q.w2_scale.float())
    with pytest.raises(ValueError, match="needs a scale tensor, got None"):
        _replace(q, w2_scale=None)
    with pytest.raises(ValueError, match="has no zero points"):
        _replace(q, w13_zero=torch.zeros(2, 64, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="w13 data: .* needs dtype torch.uint8"):
        _replace(q, w13=q.w13.to(torch.int8))
    with pytest.raises(ValueError, match="does not match spec"):
        _replace(q, format="mxfp4")
    fp8 = _quantized("fp8_w8a8", weight_scale="channel")
    with pytest.raises(ValueError, match=r"w13_scale: .*needs shape \[2, 64\], got \[2, 64, 1\]"):
        _replace(fp8, w13_scale=fp8.w13_scale[..., None])
    nv = _quantized("nvfp4")
    with pytest.raises(ValueError, match="needs a global scale"):
        _replace(nv, w2_global_scale=None)


def test_unquantized_takes_no_scales():
    with pytest.raises(ValueError, match="format 'unquantized' takes no spec or scale tensors"):
        ExpertWeights(torch.randn(2, 16, 8), torch.randn(2, 8, 8), w13_scale=torch.ones(2))


def test_static_activation_scales_required_and_checked():
    static = Fp8W8A8("tensor", activation_scheme="static_tensor")
    with pytest.raises(ValueError, match="a13_scale: activation scheme 'static_tensor' needs"):
        _quantized(static)
    q = _quantized(static, a13_scale=0.01, a2_scale=torch.tensor([0.01, 0.02]))
    assert q.a13_scale.shape == (2,) and q.a2_scale.tolist() == pytest.approx([0.01, 0.02])
    with pytest.raises(ValueError, match="a2_scale must be one value or"):
        _quantized(static, a13_scale=0.01, a2_scale=torch.ones(3))
    with pytest.raises(ValueError, match="only the 'static_tensor' activation scheme takes"):
        _quantized("fp8_w8a8", a13_scale=0.01)


@pytest.mark.parametrize("text, params", [
    ("fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor",
     dict(weight_scale="tensor", activation_scheme="static_tensor")),
    ("fp8_w8a8:weight_scale=channel", dict(weight_scale="channel")),
    ("fp8_w8a8:block_shape=128x128", {}),
    ("int4_w4a16:group_size=32,symmetric=false,scale_dtype=float16",
     dict(group_size=32, symmetric=False, scale_dtype=torch.float16)),
    ("int8_w8a16", {}),
    ("nvfp4:", {}),
])  # fmt: skip
def test_quantization_strings(text, params):
    """--quantization NAME:key=value,...: typed like the spec's fields; format_text writes the
    shortest string that gives the spec back (the fp8 activation default is left out)."""
    name = format_name(text)
    spec = make_spec(text)
    assert spec == make_spec(name, **params)
    assert make_spec(format_text(spec)) == spec
    assert format_text(make_spec(name)) == name
    assert format_text(make_spec("fp8_w8a8:weight_scale=tensor")) == "fp8_w8a8:weight_scale=tensor"
    assert format_text(None) == "unquantized" and make_spec("unquantized") is None


@pytest.mark.parametrize("text, needle", [
    ("fp9:group_size=32", "unknown weight format 'fp9'; allowed: unquantized, fp8_w8a8"),
    ("unquantized:x=1", "unknown weight format 'unquantized'"),
    ("fp8_w8a8:scale=tensor", "'scale=tensor' is not key=value of a fp8_w8a8 parameter; "
                              "allowed: weight_scale, block_shape"),
    ("fp8_w8a8:weight_scale", "'weight_scale' is not key=value"),
    ("fp8_w8a8:weight_scale=row", "weight_scale must be one of 'tensor', 'channel', 'block'"),
    ("fp8_w8a8:block_shape=128", "block_shape must be one of"),
    ("fp8_w8a8:block_shape=a,b", "block_shape='a' is not a tuple (write it as 128x128)"),
    ("int4_w4a16:group_size=g", "group_size='g' is not a int"),
    ("int4_w4a16:symmetric=yes", "symmetric='yes' is not a bool"),
    ("int4_w4a16:scale_dtype=int8", "scale_dtype must be one of"),
    ("int4_w4a16:scale_dtype=bogus", "scale_dtype='bogus' is not a dtype"),
    ("mxfp4:group_size=32", "allowed: none"),
])  # fmt: skip
def test_bad_quantization_strings(text, needle):
    with pytest.raises(ConfigError) as err:
        make_spec(text)
    assert needle in str(err.value)
