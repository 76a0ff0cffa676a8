"""Quantized experts through the torch reference runner and the MoE layer.

The runner's result is checked against an independent float64 computation over (token, expert)
pairs: dequantized weights, and for w8a8 formats the activations quantized with the format's
scheme (the library's activation reference, tested in test_quant_act)."""

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.config import WEIGHT_FORMATS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import Fp8W8A8, Int4W4A16, make_spec, quantize_experts
from moekit.quant.act_quant import fake_quantize_act, tensor_scale
from moekit.quant.calibrate import standard_normal_scales
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.torch import activate, moe_reference_fp64
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput
from tests.helpers import rel_err

SPECS = [
    Fp8W8A8("block"),
    Fp8W8A8("channel"),
    Fp8W8A8("tensor"),
    Fp8W8A8("tensor", activation_scheme="static_tensor"),
    Fp8W8A8("block", activation_scheme="token"),
    make_spec("int8_w8a8"),
    make_spec("int8_w8a16"),
    Int4W4A16(32, True),
    Int4W4A16(64, False),
    make_spec("mxfp4"),
    make_spec("nvfp4"),
]
E, H, I = 5, 256, 128


def _id(spec):
    return spec.describe().replace(" ", "")


def make_weights(spec, bias=False, dtype=torch.float32):
    w = ExpertWeights(
        torch.randn(E, 2 * I, H, dtype=dtype) / H**0.5,
        torch.randn(E, H, I, dtype=dtype) / I**0.5,
        torch.randn(E, 2 * I, dtype=dtype) * 0.1 if bias else None,
        torch.randn(E, H, dtype=dtype) * 0.1 if bias else None,
    )
    static = {}
    if spec.act_scheme == "static_tensor":
        static = dict(a13_scale=torch.rand(E) * 0.01 + 0.005, a2_scale=torch.rand(E) * 0.002 + 0.001)
    return quantize_experts(w, spec, **static)


def topk_for(T, K=2, masked=True):
    ids = torch.rand(T, E).argsort(dim=1)[:, :K].to(torch.int32)
    if masked and T > 2:
        ids[0, 1] = -1
        ids[2] = -1  # a token routed nowhere
    return TopKOutput(torch.rand(T, K), ids)


def pairs_reference(x, topk, q: ExpertWeights, act: ActivationSpec):
    """Float64 over the valid (token, slot) pairs, independent of run_standard's grouping."""
    w = q.dequantized(torch.float64)
    spec = q.spec
    t_idx, k_idx = torch.nonzero(topk.ids >= 0, as_tuple=True)
    e_idx = topk.ids[t_idx, k_idx].long()

    def fq(v, which):
        if spec.weight_only:
            return v.double()
        scale = None
        if spec.act_scheme == "static_tensor":
            scale = (q.a13_scale if which == 1 else q.a2_scale)[e_idx][:, None]
        elif spec.act_scheme == "dynamic_tensor":
            scale = tensor_scale(x if which == 1 else v, spec.act_dtype)
        group = spec.act_group_size or 128
        return fake_quantize_act(
            v, spec.act_scheme, spec.act_dtype, scale=scale, group_size=group,
            out_dtype=torch.float64,
        )

    xp = fq(x[t_idx], 1)
    h = torch.einsum("ph,pih->pi", xp, w.w13[e_idx])
    if w.b13 is not None:
        h = h + w.b13[e_idx].double()
    a = activate(h, act).to(x.dtype)  # the intermediate is rounded to x's dtype, as the runner
    y = torch.einsum("pi,phi->ph", fq(a, 2), w.w2[e_idx])
    if w.b2 is not None:
        y = y + w.b2[e_idx].double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    out.index_add_(0, t_idx, y * topk.weights[t_idx, k_idx].double()[:, None])
    return out


def test_torch_runner_accepts_every_format():
    assert registry.runner_class("torch").caps.weight_formats == frozenset(WEIGHT_FORMATS)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("T", [0, 1, 17])
def test_standard_matches_pairs_reference(spec, T):
    q = make_weights(spec, bias=T == 17)
    act = ActivationSpec("silu")
    x = torch.randn(T, H)
    topk = topk_for(T)
    out = registry.runner_class("torch")().run(StandardDispatchOutput(x, topk), q, act).out
    assert out.shape == (T, H) and out.dtype == torch.float32
    ref = pairs_reference(x, topk, q, act)
    # weight-only: float32 arithmetic; w8a8: an fp8/int8 rounding boundary may flip between the
    # float32 and float64 intermediates, for a value or for a group's scale (then one token's
    # whole row moves: 0.0057 for the block spec on one draw; 150 other draws stayed <= 0.0008)
    assert rel_err(out, ref) < (1e-5 if spec.weight_only else 1e-2)
    if T and not spec.weight_only:  # the activation quantization is really applied
        plain = moe_reference_fp64(x, topk, q, act)
        assert rel_err(out, plain) > 1e-4


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2], SPECS[3], SPECS[5], SPECS[9]], ids=_id)
def test_masked_matches_standard(spec):
    q = make_weights(spec)
    act = ActivationSpec("swiglu_oai")
    C = 4
    counts = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    x = torch.randn(E, C, H)
    x[1, :] = float("nan")  # rows past the counts are never read into valid results
    x[3, 1:] = 1e6
    runner = registry.runner_class("torch")()
    out = runner.run(MaskedDispatchOutput(x, counts), q, act).out
    rows = [(e, c) for e in range(E) for c in range(int(counts[e]))]
    xs = torch.stack([x[e, c] for e, c in rows])
    ids = torch.tensor([[e] for e, _ in rows], dtype=torch.int32)
    std = runner.run(StandardDispatchOutput(xs, TopKOutput(torch.ones(len(rows), 1), ids)), q, act).out
    got = torch.stack([out[e, c] for e, c in rows])
    assert rel_err(got, std) < 1e-6
    for e in range(E):  # padding rows (NaN, huge) give zeros and do not leak into valid rows
        assert (out[e, int(counts[e]) :] == 0).all()


def test_masked_dynamic_tensor_ignores_padding_rows():
    q = make_weights(Fp8W8A8("tensor"))
    counts = torch.tensor([2, 1, 0, 0, 3], dtype=torch.int32)
    x = torch.randn(E, 3, H)
    x[0, 2] = 1e6  # padding
    out = registry.runner_class("torch")().run(MaskedDispatchOutput(x, counts), q, ActivationSpec()).out
    x2 = x.clone()
    x2[0, 2] = 0
    out2 = registry.runner_class("torch")().run(MaskedDispatchOutput(x2, counts), q, ActivationSpec()).out
    assert torch.equal(out[0, :2], out2[0, :2])


@pytest.mark.parametrize("fmt", [f for f in WEIGHT_FORMATS if f != "unquantized"])
def test_layer_with_weight_format(fmt):
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=128, dtype="float32")
    layer = MoE(cfg, weight_format=fmt)
    assert layer.config.weight_format == fmt and layer.quant_spec.name == fmt
    assert "w13" not in dict(layer.named_parameters())
    ew = layer.expert_weights
    assert ew.format == fmt and (ew.hidden_size, ew.intermediate_size) == (128, 128)
    x, logits = torch.randn(9, 128), torch.randn(9, 4)
    out = layer(x, logits)
    ref = moe_reference_fp64(x, layer.route(logits), ew, layer.act)
    assert rel_err(out, ref) < (1e-5 if ew.spec.weight_only else 0.06)
    # state dict round trip into a fresh layer of the same format
    other = MoE(cfg, weight_format=fmt)
    assert not torch.equal(other(x, logits), out)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x, logits), out)
    # reset draws new weights and quantizes them
    before = layer.w13.clone()
    layer.reset_parameters()
    assert layer.w13.dtype == before.dtype and not torch.equal(layer.w13, before)


def test_quantize_weights_in_place_and_its_errors():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype="float32")
    layer = MoE(cfg)
    x, logits = torch.randn(9, 128), torch.randn(9, 4)
    ref = layer(x, logits)
    unq = layer.expert_weights
    layer.quantize_weights_("int4_w4a16", group_size=32, symmetric=False)
    assert layer.config.weight_format == "int4_w4a16" and layer.w13_zero is not None
    expect = quantize_experts(unq, Int4W4A16(32, False))
    assert torch.equal(layer.w13, expect.w13) and torch.equal(layer.w2_scale, expect.w2_scale)
    assert 0 < rel_err(layer(x, logits), ref) < 0.2
    with pytest.raises(ValueError, match="already quantized"):
        layer.quantize_weights_("fp8_w8a8")
    static = Fp8W8A8("tensor", activation_scheme="static_tensor")
    with pytest.raises(ValueError, match="needs calibrated activation scales"):
        MoE(cfg).quantize_weights_(static)
    layer = MoE(cfg)
    layer.quantize_weights_(static, a13_scale=0.02, a2_scale=0.002)
    assert layer.a13_scale.shape == (4,)
    layer.reset_parameters()  # keeps the static scales
    assert layer.a13_scale.tolist() == pytest.approx([0.02] * 4)
    layer(x, logits)


def test_random_static_layer_calibrates_for_standard_normal_inputs():
    """MoE(weight_format=<static fp8>) draws its experts and calibrates their static scales
    on N(0, 1) tokens, as `standard_normal_scales` does for the same unquantized draw."""
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=128, intermediate_size=64, dtype="float32")
    torch.manual_seed(5)
    layer = MoE(cfg, weight_format="fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor")
    torch.manual_seed(5)
    twin = MoE(cfg)
    scales = standard_normal_scales(twin.expert_weights, twin.act)
    assert torch.equal(layer.a13_scale, scales["a13_scale"])
    assert torch.equal(layer.a2_scale, scales["a2_scale"])
    assert layer.quant_spec == Fp8W8A8("tensor", activation_scheme="static_tensor")
    x, logits = torch.randn(9, 128), torch.randn(9, 4)
    assert rel_err(layer(x, logits), twin(x, logits)) < 0.1


def test_quantized_layer_loads_unquantized_hf_weights():
    cfg = MoEConfig(num_experts=3, top_k=2, hidden_size=128, intermediate_size=64, dtype="float32")
    sd = {
        "experts.gate_up_proj": torch.randn(3, 128, 128),
        "experts.down_proj": torch.randn(3, 128, 64),
    }
    layer = MoE(cfg, weight_format="mxfp4")
    layer.load_hf_state_dict(sd)
    expect = quantize_experts(ExpertWeights(sd["experts.gate_up_proj"], sd["experts.down_proj"]), "mxfp4")
    assert torch.equal(layer.w13, expect.w13) and torch.equal(layer.w2_scale, expect.w2_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_torch_runner_bf16_cuda(spec):
    q = make_weights(spec, dtype=torch.float32)
    q = quantize_experts(q.dequantized(torch.float32), spec, a13_scale=q.a13_scale, a2_scale=q.a2_scale)
    qc = ExpertWeights(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(q).items()})
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    topk = topk_for(64)
    topk = TopKOutput(topk.weights.cuda(), topk.ids.cuda())
    out = registry.runner_class("torch")().run(StandardDispatchOutput(x, topk), qc, ActivationSpec()).out
    ref = pairs_reference(x.cpu(), TopKOutput(topk.weights.cpu(), topk.ids.cpu()), q, ActivationSpec())
    assert rel_err(out, ref) < 3e-2
