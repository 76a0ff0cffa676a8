"""Quantized checkpoints into the layer: each convention's tensors (written here per weight, as
the checkpoints store them) load without requantizing, sliced for TP and EP, and equal the
layer loaded from their dequantized twin; static fp8 input scales, conversion to the layer's own
format, and the errors."""

import pytest
import torch

from moekit import MoE, MoEConfig, ParallelConfig, RunnerConfig
from moekit.quant import Fp8W8A8, dequantize, quantize
from moekit.quant.calibrate import standard_normal_scales
from moekit.quant.loaders import cat_rows, load_weight, narrow
from tests.helpers import rel_err
from tests.test_quant_loaders import awq_checkpoint, ct_packed_checkpoint, gptq_checkpoint

E, K, H, I = 4, 2, 256, 256
NAMES = ("gate_proj", "up_proj", "down_proj")


def config(**kw) -> MoEConfig:
    base = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype="float32")
    return MoEConfig(**{**base, **kw})


def _fp8(weight_scale, scale_key="weight_scale", shape=lambda s: s):
    def write(w):
        q = quantize(w, Fp8W8A8(weight_scale))
        return {".weight": q.data, "." + scale_key: shape(q.scale)}
    return write


def _gptq(w):
    (qweight, qzeros, scales, g_idx), _ = gptq_checkpoint(w, 32, sym=False)
    return {".qweight": qweight, ".qzeros": qzeros, ".scales": scales, ".g_idx": g_idx}


def _awq(w):
    (qweight, qzeros, scales), _ = awq_checkpoint(w, 128)
    return {".qweight": qweight, ".qzeros": qzeros, ".scales": scales}


def _ct_int4(w):
    return ct_packed_checkpoint(w, 4, 32, sym=False)[0]


def _ct_int8(w):
    return ct_packed_checkpoint(w, 8)[0]


def _int8(w):
    q = quantize(w, "int8_w8a8")
    return {".weight": q.data, ".weight_scale": q.scale[:, None]}


def _nvfp4(w):
    q = quantize(w, "nvfp4")
    return {".weight": q.data, ".weight_scale": q.scale, ".weight_scale_2": q.global_scale}


# format name -> (its name after loading, the writer of one weight [N, K]'s checkpoint tensors)
CHECKPOINTS = {
    "fp8-block-scale-inv": ("fp8_w8a8", _fp8("block", "weight_scale_inv")),
    "fp8-channel": ("fp8_w8a8", _fp8("channel", shape=lambda s: s[:, None])),
    "fp8-tensor": ("fp8_w8a8", _fp8("tensor")),
    "int8": ("int8_w8a8", _int8),
    "gptq-g32": ("int4_w4a16", _gptq),
    "awq-g128": ("int4_w4a16", _awq),
    "compressed-tensors-int4-g32": ("int4_w4a16", _ct_int4),
    "compressed-tensors-int8": ("int8_w8a16", _ct_int8),
    "nvfp4": ("nvfp4", _nvfp4),
}


def weights():
    return {n: torch.randn(E, *((I, H) if n != "down_proj" else (H, I))) / 16 for n in NAMES}


def quantized_sd(write, w, prefix="experts.", names=NAMES, input_scales=None):
    sd = {}
    for e in range(E):
        for name, key in zip(names, NAMES):
            for suffix, t in write(w[key][e]).items():
                sd[f"{prefix}{e}.{name}{suffix}"] = t
            if input_scales is not None:
                sd[f"{prefix}{e}.{name}.input_scale"] = input_scales[key][e]
    return sd


def dequantized_sd(qsd, prefix="experts.", names=NAMES):
    """The plain twin of a quantized state dict: what each expert dequantizes to (gate and up
    joined first, as the loader joins them: fp8 per-tensor requantizes them to one scale)."""
    sd = {}
    for e in range(E):
        g, u, d = (load_weight(qsd, f"{prefix}{e}.{n}")[0] for n in names)
        w13 = dequantize(cat_rows([g, u]))
        sd[f"{prefix}{e}.{names[0]}.weight"], sd[f"{prefix}{e}.{names[1]}.weight"] = w13.chunk(2)
        sd[f"{prefix}{e}.{names[2]}.weight"] = dequantize(d)
    return sd


@pytest.mark.parametrize("ckpt", list(CHECKPOINTS))
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)])
def test_quantized_checkpoint_loads_as_stored(ckpt, tp, ep):
    """Every rank holds the checkpoint's format, and its experts dequantize to exactly what the
    rank loads from the dequantized twin (TP rows / columns and the EP share cut alike)."""
    fmt, write = CHECKPOINTS[ckpt]
    qsd = quantized_sd(write, weights())
    sd = dequantized_sd(qsd)
    for rank in range(tp):
        layer = MoE(config(), ParallelConfig(tp_size=tp, ep_size=ep), tp_rank=rank)
        layer.load_hf_state_dict(qsd)
        ref = MoE(config(), ParallelConfig(tp_size=tp, ep_size=ep), tp_rank=rank)
        ref.load_hf_state_dict(sd)
        assert layer.quant_spec.name == fmt and layer.config.weight_format == fmt
        got = layer.expert_weights.dequantized(torch.float32)
        assert torch.equal(got.w13, ref.w13) and torch.equal(got.w2, ref.w2)


# w8a8: the activations' quantization error (5 seeds measured 0.041-0.049 for fp8, 0.017-0.021
# for int8); weight-only formats multiply the dequantized weights: equal up to float32 rounding.
@pytest.mark.parametrize("ckpt, bound", [("fp8-block-scale-inv", 0.08), ("int8", 0.04),
                                         ("gptq-g32", 1e-5), ("nvfp4", 1e-5),
                                         ("compressed-tensors-int4-g32", 1e-5),
                                         ("compressed-tensors-int8", 1e-5)])  # fmt: skip
def test_loaded_layer_runs_like_its_dequantized_twin(ckpt, bound):
    """The `torch` runner on the loaded layer against the float layer of the dequantized
    weights."""
    qsd = quantized_sd(CHECKPOINTS[ckpt][1], weights())
    run = RunnerConfig(moe_runner_backend="torch")
    layer, ref = MoE(config(), runner=run), MoE(config(), runner=run)
    layer.load_hf_state_dict(qsd)
    ref.load_hf_state_dict(dequantized_sd(qsd))
    x, logits = torch.randn(7, H), torch.randn(7, E)
    assert rel_err(layer(x, logits), ref(x, logits)) < bound


def test_fp8_input_scales_load_as_static_scales():
    """Mixtral-style w1 / w3 / w2 with per-tensor fp8 scales and `input_scale`s: the static
    scheme, a13 = the larger of w1's and w3's input scale, a2 = w2's, per local expert."""
    w = weights()
    scales = {n: torch.rand(E) * 0.01 + 0.005 for n in NAMES}
    names = ("w1", "w3", "w2")
    qsd = quantized_sd(_fp8("tensor"), w, "block_sparse_moe.experts.", names, scales)
    run = RunnerConfig(moe_runner_backend="torch")
    for rank in range(2):
        layer = MoE(config(), ParallelConfig(tp_size=2, ep_size=2), run, tp_rank=rank)
        layer.load_hf_state_dict(qsd, prefix="block_sparse_moe.")
        local = layer.local_experts
        assert layer.quant_spec.act_scheme == "static_tensor"
        a13 = torch.maximum(scales["gate_proj"], scales["up_proj"])[local]
        assert torch.equal(layer.a13_scale, a13)
        assert torch.equal(layer.a2_scale, scales["down_proj"][local])
        out = layer(torch.randn(3, H), torch.randn(3, E))
        assert out.shape == (3, H) and torch.isfinite(out).all()


def test_fused_shared_expert_of_a_block_fp8_checkpoint():
    """DeepSeek-V3 style: routed and shared experts in block fp8 with weight_scale_inv."""
    write = CHECKPOINTS["fp8-block-scale-inv"][1]
    qsd = quantized_sd(write, weights())
    shared = {"gate_proj": torch.randn(I, H), "up_proj": torch.randn(I, H),
              "down_proj": torch.randn(H, I)}  # fmt: skip
    for name, t in shared.items():
        for suffix, v in write(t / 16).items():
            qsd[f"shared_experts.{name}{suffix}"] = v
    cfg = config(num_shared_experts=1)
    layer = MoE(cfg)
    layer.load_hf_state_dict(qsd)
    got = layer.expert_weights.dequantized(torch.float32)
    gate, up, down = (dequantize(load_weight(qsd, f"shared_experts.{n}")[0]) for n in NAMES)
    assert torch.equal(got.w13[E], torch.cat([gate, up])) and torch.equal(got.w2[E], down)


@pytest.mark.parametrize("tp", [1, 2])
def test_gpt_oss_fused_mxfp4_blocks(tp):
    """gpt-oss: gate_up_proj_blocks / _scales (gate and up rows interleaved) and biases."""
    q13 = quantize(torch.randn(E, 2 * I, H) / 16, "mxfp4")
    q2 = quantize(torch.randn(E, H, I) / 16, "mxfp4")
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    qsd = {"experts.gate_up_proj_blocks": q13.data.reshape(E, 2 * I, H // 32, 16),
           "experts.gate_up_proj_scales": q13.scale, "experts.gate_up_proj_bias": b13,
           "experts.down_proj_blocks": q2.data.reshape(E, H, I // 32, 16),
           "experts.down_proj_scales": q2.scale, "experts.down_proj_bias": b2}  # fmt: skip
    sd = {"experts.gate_up_proj": dequantize(q13), "experts.down_proj": dequantize(q2),
          "experts.gate_up_proj_bias": b13, "experts.down_proj_bias": b2}  # fmt: skip
    cfg = config(interleaved=True, has_bias=True, activation="swiglu_oai")
    for rank in range(tp):
        layer = MoE(cfg, ParallelConfig(tp_size=tp), tp_rank=rank)
        layer.load_hf_state_dict(qsd)
        ref = MoE(cfg, ParallelConfig(tp_size=tp), tp_rank=rank)
        ref.load_hf_state_dict(sd)
        got = layer.expert_weights.dequantized(torch.float32)
        assert layer.quant_spec.name == "mxfp4"
        assert torch.equal(got.w13, ref.w13) and torch.equal(got.w2, ref.w2)
        assert torch.equal(layer.b13, ref.b13) and torch.equal(layer.b2, ref.b2)


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)])
def test_fused_fp8_experts(tp, ep):
    """transformers' fp8 experts: gate_up_proj / down_proj [E, N, K] fp8 with a block
    `_scale_inv` beside each; the declared dynamic per-tensor scheme of a per-tensor one."""
    q13 = quantize(torch.randn(E, 2 * I, H) / 16, Fp8W8A8("block"))
    q2 = quantize(torch.randn(E, H, I) / 16, Fp8W8A8("block"))
    qsd = {"experts.gate_up_proj": q13.data, "experts.gate_up_proj_scale_inv": q13.scale,
           "experts.down_proj": q2.data, "experts.down_proj_scale_inv": q2.scale}  # fmt: skip
    sd = {"experts.gate_up_proj": dequantize(q13), "experts.down_proj": dequantize(q2)}
    for rank in range(tp):
        layer = MoE(config(), ParallelConfig(tp_size=tp, ep_size=ep), tp_rank=rank)
        layer.load_hf_state_dict(qsd, quantization_config={
            "quant_method": "fp8", "weight_block_size": [128, 128]})  # fmt: skip
        ref = MoE(config(), ParallelConfig(tp_size=tp, ep_size=ep), tp_rank=rank)
        ref.load_hf_state_dict(sd)
        got = layer.expert_weights.dequantized(torch.float32)
        assert layer.quant_spec == Fp8W8A8("block")
        assert torch.equal(got.w13, ref.w13) and torch.equal(got.w2, ref.w2)
    t13, t2 = (quantize(torch.randn(*s) / 16, Fp8W8A8("tensor")) for s in
               ((E, 2 * I, H), (E, H, I)))  # fmt: skip
    layer = MoE(config())
    layer.load_hf_state_dict({"experts.gate_up_proj": t13.data, "experts.gate_up_proj_scale":
                              t13.scale, "experts.down_proj": t2.data,
                              "experts.down_proj_scale": t2.scale},
                             quantization_config={"quant_method": "fp8"})  # fmt: skip
    assert layer.quant_spec == Fp8W8A8("tensor", activation_scheme="dynamic_tensor")
    with pytest.raises(KeyError, match="experts.down_proj_scale_inv"):
        MoE(config()).load_hf_state_dict({k: v for k, v in qsd.items()
                                          if k != "experts.down_proj_scale_inv"})  # fmt: skip


def test_a_layer_with_another_format_converts():
    qsd = quantized_sd(CHECKPOINTS["fp8-block-scale-inv"][1], weights())
    layer = MoE(config(), weight_format="int4_w4a16")
    layer.load_hf_state_dict(qsd)
    assert layer.quant_spec.name == "int4_w4a16"
    ref = MoE(config())
    ref.load_hf_state_dict(dequantized_sd(qsd))
    expect = dequantize(quantize(ref.w13, layer.quant_spec))
    assert torch.equal(layer.expert_weights.dequantized(torch.float32).w13, expect)
    # int8 checkpoints are the same data for either int8 format
    w8a16 = MoE(config(), weight_format="int8_w8a16")
    w8a16.load_hf_state_dict(quantized_sd(_int8, weights()))
    assert w8a16.quant_spec.name == "int8_w8a16" and w8a16.w13.dtype == torch.int8


def test_static_scales_of_a_random_layer_follow_loaded_weights():
    """A layer made with static fp8 scales but given none calibrated them for N(0, 1) inputs on
    its random draw; loading other weights calibrates them for those weights (and warns)."""
    static = "fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor"
    layer = MoE(config(), weight_format=static)
    sd = dequantized_sd(quantized_sd(_int8, weights()))
    layer.load_hf_state_dict(sd)
    plain = MoE(config())
    plain.load_hf_state_dict(sd)
    expect = standard_normal_scales(plain.expert_weights, plain.act)
    assert torch.equal(layer.a13_scale, expect["a13_scale"])
    assert torch.equal(layer.a2_scale, expect["a2_scale"])
    given = MoE(config())  # scales given by the user stay
    given.quantize_weights_(static, a13_scale=0.03, a2_scale=0.01)
    given.load_hf_state_dict(sd)
    assert given.a13_scale.tolist() == pytest.approx([0.03] * E)


def test_quantized_loading_errors():
    w = weights()
    block = quantized_sd(CHECKPOINTS["fp8-block-scale-inv"][1], w)
    with pytest.raises(ValueError, match="multiple of 128"):  # I / 4 = 64 rows: half a block
        MoE(config(), ParallelConfig(tp_size=4), tp_rank=1).load_hf_state_dict(block)
    mixed = dict(block)
    for suffix in (".weight", ".weight_scale_inv"):
        del mixed["experts.2.up_proj" + suffix]
    mixed["experts.2.up_proj.weight"] = w["up_proj"][2]
    with pytest.raises(ValueError, match="gate_proj and up_proj must share one format"):
        MoE(config()).load_hf_state_dict(mixed)
    odd = dict(block)
    odd["experts.1.down_proj.weight"] = odd["experts.1.down_proj.weight"].view(torch.int8).short()
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight is torch.int16 .*not a "
                                         "weight format moekit reads"):  # fmt: skip
        MoE(config()).load_hf_state_dict(odd)
    no_scale = dict(block)
    del no_scale["experts.0.gate_proj.weight_scale_inv"]
    with pytest.raises(KeyError, match="experts.0.gate_proj.weight_scale"):
        MoE(config()).load_hf_state_dict(no_scale)
    with pytest.raises(ValueError, match=rf"experts.0.gate_proj holds a int8_w8a8 weight of shape "
                                         rf"\[{I}, {H}\]; the config gives \[{I // 2}, {H}\]"):
        MoE(config(intermediate_size=I // 2)).load_hf_state_dict(quantized_sd(_int8, w))
    half = quantized_sd(_fp8("tensor"), w, input_scales={n: torch.ones(E) for n in NAMES})
    del half["experts.3.up_proj.input_scale"]
    with pytest.raises(ValueError, match="must both have input_scale or neither"):
        MoE(config()).load_hf_state_dict(half)


@pytest.mark.parametrize("fmt, params, rows, cols", [
    ("fp8_w8a8", dict(weight_scale="block"), (128, 200), (128, 128)),
    ("fp8_w8a8", dict(weight_scale="channel"), (3, 50), (5, 70)),
    ("fp8_w8a8", dict(weight_scale="tensor"), (3, 50), (5, 70)),
    ("int8_w8a8", {}, (1, 7), (9, 33)),
    ("int4_w4a16", dict(group_size=64, symmetric=False), (2, 9), (64, 128)),
    ("mxfp4", {}, (0, 40), (32, 64)),
    ("nvfp4", {}, (5, 11), (16, 176)),
])  # fmt: skip
def test_narrow_cuts_like_the_dequantized_weight(fmt, params, rows, cols):
    q = quantize(torch.randn(2, 328, 256), fmt, **params)
    w = dequantize(q)
    start, length = rows
    torch.testing.assert_close(dequantize(narrow(q, -2, start, length)),
                               w.narrow(-2, start, length), rtol=0, atol=0)  # fmt: skip
    start, length = cols
    torch.testing.assert_close(dequantize(narrow(q, -1, start, length)),
                               w.narrow(-1, start, length), rtol=0, atol=0)  # fmt: skip


def test_narrow_refuses_cuts_inside_a_scale_group():
    q = quantize(torch.randn(256, 256), "int4_w4a16", group_size=128)
    with pytest.raises(ValueError, match="groups of 128 columns"):
        narrow(q, -1, 64, 128)
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        narrow(q, -2, 200, 100)
    with pytest.raises(ValueError, match="dim must be -2"):
        narrow(q, 0, 0, 1)
    block = quantize(torch.randn(256, 256), "fp8_w8a8")
    with pytest.raises(ValueError, match="groups of 128 rows"):
        narrow(block, -2, 0, 100)


@pytest.mark.gpu
def test_loading_refreshes_the_runners_copies_gpu():
    """A runner that keeps a derived copy of the weights (`cutlass` pads them) sees weights
    loaded after its first call."""
    run = RunnerConfig(moe_runner_backend="cutlass")
    cfg = config(dtype="bfloat16")
    layer = MoE(cfg, runner=run, device="cuda")
    x = torch.randn(5, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(5, E, device="cuda")
    layer(x, logits)
    sd = {k: v.to("cuda", torch.bfloat16) for k, v in dequantized_sd(
        quantized_sd(_int8, weights())).items()}  # fmt: skip
    layer.load_hf_state_dict(sd)
    fresh = MoE(cfg, runner=run, device="cuda")
    fresh.load_hf_state_dict(sd)
    assert torch.equal(layer(x, logits), fresh(x, logits))


@pytest.mark.gpu
@pytest.mark.parametrize("ckpt", ["fp8-block-scale-inv", "fp8-tensor-static", "gptq-g32",
                                  "awq-g128", "nvfp4", "int8", "compressed-tensors-int4-g32",
                                  "compressed-tensors-int8"])  # fmt: skip
def test_loaded_checkpoint_runs_in_triton_gpu(ckpt):
    """A checkpoint loaded onto the GPU runs in `triton` as in the `torch` reference."""
    w = weights()
    if ckpt == "fp8-tensor-static":
        # x ~ N(0, 1) reaches about 5 over 33 x 256 values, h about 10 (measure: calibrate)
        scales = {n: torch.full((E,), (10 if n == "down_proj" else 5) / 448) for n in NAMES}
        qsd = quantized_sd(_fp8("tensor"), w, input_scales=scales)
    else:
        qsd = quantized_sd(CHECKPOINTS[ckpt][1], w)
    cfg = config(dtype="bfloat16")
    x = torch.randn(33, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(33, E, device="cuda")
    outs = []
    for backend in ("triton", "torch"):
        layer = MoE(cfg, runner=RunnerConfig(moe_runner_backend=backend), device="cuda")
        layer.load_hf_state_dict(qsd)
        outs.append(layer(x, logits))
    assert rel_err(*outs) < 3e-2
