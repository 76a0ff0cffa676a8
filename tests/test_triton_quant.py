"""Quantized weight formats in the triton runner against the torch reference runner.

CPU: the Triton interpreter with float16 activations on small shapes, every implemented format
(fp8 too: an fp8 x fp8 tl.dot and fp8 -> float32 loads are exact in the interpreter; only its
cast *to* fp8 is wrong, so on CPU the runner quantizes fp8 activations with the reference
quantizer, bit-identical to the Triton one on a GPU). GPU (marked): bfloat16 on the preset
shapes.

Bounds (relative norm error against the torch runner on the same quantized weights): the
weight-only formats dequantize to exactly the reference's weights, so only the accumulation
order and the reference's rounding of the first GEMM's output differ (fp16: `TOLERANCE`);
the w8a8 formats also quantize the intermediate, where such a one-ulp difference can move a
value to the neighbouring fp8 / int8 step: W8A8_TOL. In fp16 (CPU) that measured up to 0.022
over 32 seeds of `test_formats_vs_torch`'s T = 9 case (fp8 tensor / channel / block, dynamic and
static scales; median 0.0015-0.0045), while the kernels' intermediate stays within 1-2 ulp of
the reference's. A wrong scale or row gives errors of 0.1 and more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

pytest.importorskip("triton")

from helpers import TOLERANCE, make_topk, rel_err  # noqa: E402

from moekit.experts import ActivationSpec, ExpertWeights  # noqa: E402
from moekit.quant import (  # noqa: E402
    Fp8W8A8,
    Int4W4A16,
    calibrate_static_scales,
    make_spec,
    quantize_experts,
)
from moekit.runners import _tables  # noqa: E402
from moekit.runners.base import RunnerError  # noqa: E402
from moekit.runners.torch import TorchRunner  # noqa: E402
from moekit.runners.triton import TritonRunner, configs, ops  # noqa: E402
from moekit.runners.triton.configs import GemmConfig  # noqa: E402
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
W8A8_TOL = {torch.float16: 3e-2, torch.bfloat16: 3e-2}

# name: (spec, H, I) - shapes chosen to hit partial fp8 blocks, several int4 groups per K step
FORMATS = {
    "int8_w8a16": (make_spec("int8_w8a16"), 64, 48),
    "int4-g32-sym": (Int4W4A16(32, True), 96, 64),
    "int4-g64-asym": (Int4W4A16(64, False, torch.float16), 128, 64),
    "int4-g128-sym": (Int4W4A16(128, True, torch.float32), 128, 128),
    "mxfp4": (make_spec("mxfp4"), 64, 64),
    "nvfp4": (make_spec("nvfp4"), 64, 32),
    "fp8-block": (Fp8W8A8("block"), 192, 160),
    "fp8-channel": (Fp8W8A8("channel"), 64, 48),
    "fp8-tensor": (Fp8W8A8("tensor"), 64, 48),
    "fp8-block-token": (Fp8W8A8("block", activation_scheme="token"), 128, 64),
    # one calibrated activation scale per expert: each pair's row quantized with its own
    "fp8-tensor-static": (Fp8W8A8("tensor", activation_scheme="static_tensor"), 64, 48),
    "fp8-block-static": (Fp8W8A8("block", activation_scheme="static_tensor"), 192, 160),
    "int8_w8a8": (make_spec("int8_w8a8"), 64, 48),
}


def tol(spec, dtype=DTYPE) -> float:
    return TOLERANCE[dtype] if spec.weight_only else W8A8_TOL[dtype]


def make_experts(spec, E, H, I, bias=False, device=DEVICE, dtype=DTYPE) -> ExpertWeights:
    w13 = (torch.rand(E, 2 * I, H, device=device) * 2 - 1) / H**0.5
    w2 = (torch.rand(E, H, I, device=device) * 2 - 1) / I**0.5
    b13 = b2 = None
    if bias:
        b13 = (torch.randn(E, 2 * I, device=device) * 0.1).to(dtype)
        b2 = (torch.randn(E, H, device=device) * 0.1).to(dtype)
    static = {}
    if spec.act_scheme == "static_tensor":  # calibrated scales, different per expert
        static = dict(a13_scale=torch.rand(E, device=device) * 0.01 + 0.01,
                      a2_scale=torch.rand(E, device=device) * 0.004 + 0.004)  # fmt: skip
    return quantize_experts(ExpertWeights(w13, w2, b13, b2), spec, **static)


def run_both(x, topk, w, act, configs=None):
    d = StandardDispatchOutput(x, topk)
    ref = TorchRunner().run(d, w, act).out
    if configs is None:
        out = TritonRunner().run(d, w, act).out
    else:
        out = ops.fused_moe(x, topk, w, act, configs=configs)
    return out, ref


@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_formats_vs_torch(fmt, T):
    spec, H, I = FORMATS[fmt]
    E, K = 5, 2
    w = make_experts(spec, E, H, I)
    x = torch.randn(T, H, device=DEVICE, dtype=DTYPE)
    topk = make_topk(T, K, E, masked=0.2 if T > 1 else 0.0)
    out, ref = run_both(x, topk, w, ActivationSpec())
    assert out.shape == (T, H) and out.dtype == DTYPE
    if T:
        assert rel_err(out, ref) < tol(spec), (fmt, T, rel_err(out, ref))


@dataclass(frozen=True)
class Variant:
    fmt: str
    configs: tuple[GemmConfig, GemmConfig]
    act: ActivationSpec = ActivationSpec()
    bias: bool = False
    T: int = 12


OAI = ActivationSpec("swiglu_oai", interleaved=True)
VARIANTS = {
    # several int4 groups per K step (SG = 2), K not a multiple of block_k, swapped MMA, atomics
    "int4-g32-swap-atomic": Variant(
        "int4-g32-sym", (GemmConfig(16, 32, 64, swap_ab=True), GemmConfig(16, 32, 64, reduce="atomic"))
    ),
    "int4-asym-oai-bias": Variant("int4-g64-asym", (GemmConfig(32, 16, 32), GemmConfig(16, 64, 128)), OAI, True),
    "mxfp4-oai-bias-swap": Variant(
        "mxfp4", (GemmConfig(16, 16, 64, swap_ab=True), GemmConfig(16, 16, 32, swap_ab=True)), OAI, True
    ),
    "nvfp4-bk16": Variant("nvfp4", (GemmConfig(16, 16, 16), GemmConfig(16, 16, 16))),
    # block_k above the scale group is capped to it; small K steps inside one block
    "fp8-block-bk256-swap": Variant(
        "fp8-block", (GemmConfig(16, 32, 256, swap_ab=True), GemmConfig(32, 32, 32, reduce="atomic"))
    ),
    "fp8-block-oai-bias": Variant("fp8-block", (GemmConfig(16, 64, 64), GemmConfig(16, 16, 128)), OAI, True),
    "fp8-tensor-atomic": Variant("fp8-tensor", (GemmConfig(16, 16, 32), GemmConfig(16, 32, 32, reduce="atomic"))),
    # static scales: sorted rows (T above the direct rows), swapped MMA, split-K gate_up, atomics
    "fp8-static-sorted-swap": Variant(
        "fp8-tensor-static", (GemmConfig(16, 16, 32, swap_ab=True), GemmConfig(32, 32, 32, reduce="atomic")), T=40
    ),
    "fp8-static-split-oai-bias": Variant(
        "fp8-block-static", (GemmConfig(16, 32, 64, split_k=2), GemmConfig(16, 16, 64)), OAI, True, T=40
    ),
    "fp8-static-row1": Variant("fp8-tensor-static", (GemmConfig(1, 16, 32), GemmConfig(1, 32, 32))),
    "int8-w8a8-swap": Variant(
        "int8_w8a8", (GemmConfig(16, 16, 32, swap_ab=True), GemmConfig(16, 16, 64, swap_ab=True))
    ),
    # split-K down: K shares by the step (scales of each share's own groups), bias once
    "int4-g32-split4-bias": Variant(
        "int4-g32-sym", (GemmConfig(16, 32, 64), GemmConfig(16, 32, 32, reduce="atomic", split_k=4)),
        OAI, True,
    ),
    "fp8-block-split2": Variant(
        "fp8-block", (GemmConfig(16, 32, 128), GemmConfig(16, 16, 64, reduce="atomic", split_k=2))
    ),
    # split-K gate_up: each share scaled per K step / in its epilogue, added up by the last one
    "fp8-block-split-gate_up4": Variant(
        "fp8-block", (GemmConfig(16, 32, 64, split_k=4), GemmConfig(16, 16, 64)), OAI, True
    ),
    # one pair per program (block_m 1): dequantized tiles / w8a8 products on the CUDA cores
    "int4-g32-row1": Variant("int4-g32-sym", (GemmConfig(1, 32, 64), GemmConfig(1, 16, 128, reduce="atomic"))),
    "int4-asym-row1-oai": Variant("int4-g64-asym", (GemmConfig(1, 16, 64), GemmConfig(1, 32, 64)), OAI, True, T=1),
    "mxfp4-row1-oai": Variant("mxfp4", (GemmConfig(1, 32, 64), GemmConfig(1, 16, 32)), OAI, True),
    "nvfp4-row1": Variant("nvfp4", (GemmConfig(1, 16, 32), GemmConfig(1, 16, 16)), T=1),
    "int8_w8a16-row1": Variant("int8_w8a16", (GemmConfig(1, 16, 32), GemmConfig(1, 32, 16))),
    "fp8-block-row1": Variant("fp8-block", (GemmConfig(1, 32, 128), GemmConfig(1, 16, 64, reduce="atomic"))),
    "fp8-tensor-row1": Variant("fp8-tensor", (GemmConfig(1, 16, 32), GemmConfig(16, 32, 32)), T=1),
    "int8-w8a8-row1": Variant("int8_w8a8", (GemmConfig(1, 16, 32), GemmConfig(1, 16, 64))),
    "int8-w8a8-split-gate_up2-swap": Variant(
        "int8_w8a8", (GemmConfig(16, 16, 32, split_k=2, swap_ab=True), GemmConfig(16, 16, 64)), T=1
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_variants(name):
    v = VARIANTS[name]
    spec, H, I = FORMATS[v.fmt]
    E, K = 4, 2
    w = make_experts(spec, E, H, I, bias=v.bias)
    x = torch.randn(v.T, H, device=DEVICE, dtype=DTYPE)
    topk = make_topk(v.T, K, E, masked=0.1)
    out, ref = run_both(x, topk, w, v.act, v.configs)
    assert rel_err(out, ref) < tol(spec), (name, rel_err(out, ref))


@pytest.mark.parametrize("fmt", ["int4-g64-asym", "fp8-block", "fp8-tensor", "int8_w8a8",
                                 "fp8-tensor-static"])
def test_masked_format(fmt):
    spec, H, I = FORMATS[fmt]
    E, C = 3, 6
    w = make_experts(spec, E, H, I)
    x = torch.randn(E, C, H, device=DEVICE, dtype=DTYPE)
    x[0, 4:] = 1e4  # padding rows (count 4) must not enter the 'dynamic_tensor' scale
    counts = torch.tensor([4, 0, 6], dtype=torch.int32, device=DEVICE)
    d = MaskedDispatchOutput(x, counts)
    out = TritonRunner().run(d, w, ActivationSpec()).out
    ref = TorchRunner().run(d, w, ActivationSpec()).out
    valid = torch.arange(C, device=DEVICE)[None, :] < counts[:, None]
    assert rel_err(out[valid], ref[valid]) < tol(spec)


# ---------------------------------------------------------------------------------------------
# Errors and capabilities
# ---------------------------------------------------------------------------------------------


def test_static_scales_are_per_expert():
    """Each pair's row is quantized with its own expert's scale: two experts on the same token
    with scales 16x apart, against the reference (a single shared scale would clip one and
    coarsen the other), and the ids the sorted rows need are asked for by name."""
    spec, H, I = FORMATS["fp8-tensor-static"]
    E, T = 4, 24
    w = make_experts(spec, E, H, I)
    w.a13_scale.copy_(torch.tensor([0.002, 0.032, 0.008, 0.016], device=DEVICE))
    x = torch.randn(T, H, device=DEVICE, dtype=DTYPE)
    out, ref = run_both(x, make_topk(T, 2, E), w, ActivationSpec())
    assert rel_err(out, ref) < tol(spec)
    cfg = GemmConfig(16, 16, 32)
    align = ops.align_block_size(make_topk(T, 2, E).ids.to(torch.int32), E, 16)
    with pytest.raises(ValueError, match="ids"):
        ops.gate_up(x, ops.Rows.sorted(align, E), w, ActivationSpec(), cfg, 2)


def test_caps_list_every_format():
    assert TritonRunner.caps.weight_formats == frozenset(ops.SUPPORTED_FORMATS)
    assert TritonRunner.unsupported("standard", "int4_w4a16", "silu", "float16", DEVICE, False) is None
    msg = TritonRunner.unsupported("standard", "int2", "silu", "float16", DEVICE, False)
    assert "int2" in msg and "mxfp4" in msg


def test_bad_scale_tensors():
    spec, H, I = FORMATS["int4-g32-sym"]
    w = make_experts(spec, 2, H, I)
    x = torch.randn(3, H, device=DEVICE, dtype=DTYPE)
    topk = make_topk(3, 1, 2)
    # a non-contiguous scale of the right shape and dtype
    w.w13_scale = w.w13_scale.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RunnerError, match="w13_scale must be a contiguous"):
        TritonRunner().run(StandardDispatchOutput(x, topk), w, ActivationSpec())
    # a scale of the wrong shape (one group short) is caught by ExpertWeights
    with pytest.raises(ValueError, match="w13_scale"):
        ExpertWeights(
            w.w13, w.w2, format="int4_w4a16", spec=spec,
            w13_scale=w.w13_scale[..., :-1].contiguous(), w2_scale=w.w2_scale,
        )  # fmt: skip
    with pytest.raises(ValueError, match="group_size 64 must divide"):
        quantize_experts(ExpertWeights(torch.randn(2, 64, 96), torch.randn(2, 96, 32)),
                         Int4W4A16(64, True))  # fmt: skip
    with pytest.raises(Exception, match="group_size"):
        Int4W4A16(48, True)


def test_quantized_weights_on_other_device_refused():
    if not ON_GPU:
        pytest.skip("needs a second device type")
    spec, H, I = FORMATS["mxfp4"]
    w = make_experts(spec, 2, H, I, device="cpu")
    x = torch.randn(3, H, device="cuda", dtype=DTYPE)
    with pytest.raises(RunnerError, match="device"):
        TritonRunner().run(StandardDispatchOutput(x, make_topk(3, 1, 2)), w, ActivationSpec())


# ---------------------------------------------------------------------------------------------
# Config keys
# ---------------------------------------------------------------------------------------------


def test_quant_tags_and_keys():
    assert _tables.quant_tag(None) == "unquantized"
    assert _tables.quant_tag(Fp8W8A8("block")) == "fp8_w8a8-block128x128-token_group"
    assert _tables.quant_tag(Fp8W8A8("channel")) == "fp8_w8a8-channel-token"
    assert _tables.quant_tag(Int4W4A16(64, False)) == "int4_w4a16-g64-asym"
    assert _tables.quant_tag(make_spec("nvfp4")) == "nvfp4"
    k0 = configs.TableKey("down", 8, 64, 32, "bfloat16", "dev", "3.6.0")
    k1 = replace(k0, quant="mxfp4")
    assert ",quant=" not in k0.filename()  # unquantized file names unchanged
    assert ",quant=mxfp4," in k1.filename() and k1.filename() != k0.filename()


def test_quant_config_fallback_and_clamp():
    base = configs.get_config("gate_up", 64, 2, 8, 256, 128, "float16", "nodev")
    fp8 = configs.get_config("gate_up", 64, 2, 8, 256, 128, "float16", "nodev",
                             "fp8_w8a8-block128x128-token_group")  # fmt: skip
    int4 = configs.get_config("gate_up", 64, 2, 8, 256, 128, "float16", "nodev", "int4_w4a16-g32-sym")
    # group scales: one group per K step, and half the accumulator area (partial products)
    assert fp8.block_k == 128 and fp8.block_m * 2 * fp8.block_n <= 64 * 128 * fp8.num_warps // 4
    fp8c = configs.get_config("gate_up", 64, 2, 8, 256, 128, "float16", "nodev",
                              "fp8_w8a8-channel-token")  # fmt: skip
    assert fp8c.block_k == min(2 * base.block_k, 256)
    big = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8)
    tag = "fp8_w8a8-block128x128-token_group"
    assert configs.adapt_config(big, tag, "gate_up").block_n == 64
    assert configs.adapt_config(big, tag, "down").block_n == 128
    assert int4.block_m == base.block_m and not int4.tma
    spec, H, I = FORMATS["fp8-block"]
    wq = ops.WeightQuant(make_experts(spec, 2, H, I), "w13")
    assert wq.clamp(GemmConfig(block_k=256)).block_k == 128  # one scale group per K step
    assert wq.clamp(GemmConfig(block_k=16)).block_k == 32  # fp8 dot K >= 32


# ---------------------------------------------------------------------------------------------
# GPU: bf16 on the preset shapes
# ---------------------------------------------------------------------------------------------

PRESET_SHAPES = [
    ("qwen3-30b-a3b", 1, 1),
    ("deepseek-v3", 8, 8),
    ("mixtral-8x7b", 2, 1),
    ("gpt-oss-120b", 1, 1),
]
GPU_FORMATS = {
    "fp8-block": Fp8W8A8("block"),
    "fp8-channel": Fp8W8A8("channel"),
    "fp8-tensor": Fp8W8A8("tensor"),
    "fp8-tensor-static": Fp8W8A8("tensor", activation_scheme="static_tensor"),
    "int8_w8a8": make_spec("int8_w8a8"),
    "int8_w8a16": make_spec("int8_w8a16"),
    "int4-g128-sym": Int4W4A16(128, True),
    "int4-g32-asym": Int4W4A16(32, False),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4": make_spec("nvfp4"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(GPU_FORMATS))
@pytest.mark.parametrize("model,tp,ep", PRESET_SHAPES, ids=lambda v: str(v))
def test_presets_bf16_gpu(model, tp, ep, fmt):
    """Every format on the preset shapes in bf16 (gpt-oss H = 2880: fp8 blocks of the last
    K block are partial, 64 wide; int4 group 128 does not divide it and is skipped)."""
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    spec = GPU_FORMATS[fmt]
    group = getattr(spec, "group_size", 1)
    if shape.hidden % group or shape.intermediate % group:
        pytest.skip(f"{spec.describe()}: group {group} does not divide H={shape.hidden} / I={shape.intermediate}")
    torch.manual_seed(0)
    w = random_weights(shape, "cuda")
    w = quantize_experts(w, spec, **calibrated_scales(w, shape.act, spec))
    for T in (1, 16, 300):
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.02 if T > 1 else 0.0, device="cuda")
        out, ref = run_both(x, topk, w, shape.act)
        err = rel_err(out, ref)
        assert err < tol(spec, torch.bfloat16), (model, fmt, T, err)
    E, C = shape.num_experts, 8
    xm = torch.randn(E, C, shape.hidden, device="cuda", dtype=torch.bfloat16)
    counts = torch.randint(0, C + 1, (E,), dtype=torch.int32, device="cuda")
    d = MaskedDispatchOutput(xm, counts)
    out = TritonRunner().run(d, w, shape.act).out
    ref = TorchRunner().run(d, w, shape.act).out
    valid = torch.arange(C, device="cuda")[None, :] < counts[:, None]
    assert rel_err(out[valid], ref[valid]) < tol(spec, torch.bfloat16), (model, fmt, "masked")


def calibrated_scales(w: ExpertWeights, act: ActivationSpec, spec) -> dict:
    """'static_tensor' specs: per-expert activation scales as a calibration would give them
    (`calibrate_static_scales` over 64 random tokens, every expert on every token), times 1-2
    so that experts differ; other specs: none."""
    if spec.act_scheme != "static_tensor":
        return {}
    x = torch.randn(64, w.hidden_size, device=w.w13.device)
    a13, a2 = calibrate_static_scales(w, act, x)
    spread = 1 + torch.rand(2, w.num_experts, device=x.device)
    return dict(a13_scale=a13 * spread[0], a2_scale=a2 * spread[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8-block", "int4-g128-sym", "mxfp4", "fp8-tensor",
                                 "fp8-tensor-static"])
def test_cuda_graph_gpu(fmt):
    """A quantized call replays in a CUDA graph (activation quantization included)."""
    spec = GPU_FORMATS[fmt]
    E, K, H, I, T = 8, 2, 256, 256, 33
    w = make_experts(spec, E, H, I, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, K, E, device="cuda")
    act = ActivationSpec()
    ops.fused_moe(x, topk, w, act)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.fused_moe(x, topk, w, act)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    ref = TorchRunner().run(StandardDispatchOutput(x, topk), w, act).out
    assert rel_err(out, ref) < tol(spec, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("model,tp,ep", [("qwen3-30b-a3b", 1, 1), ("deepseek-v3", 8, 8)])
def test_fused_act_quant_gpu(model, tp, ep, monkeypatch):
    """T = 1 (direct rows): fp8 token-group activations quantized inside the GEMMs
    (`PIPELINE.fuse_act_quant`) against the separate `quantize_act` kernels. Same arithmetic,
    but not bit-identical (seen on the H100: ~1% on a few outputs): the fp8 MMA takes its A
    operand from registers instead of shared memory and may sum in another order, and one
    bf16 ulp of h can move an element to the next fp8 step in the down GEMM."""
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    torch.manual_seed(0)
    w = quantize_experts(random_weights(shape, "cuda"), Fp8W8A8("block"))
    x = torch.randn(1, shape.hidden, device="cuda", dtype=torch.bfloat16) * 3
    topk = make_topk(1, shape.top_k, shape.num_experts, device="cuda")
    cfgs = tuple(replace(c, block_k=128) for c in ops.configs_for(1, shape.top_k, w, x.dtype, x.device))
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, fuse_act_quant=True))
    fused = ops.fused_moe(x, topk, w, shape.act, configs=cfgs)
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, fuse_act_quant=False))
    separate = ops.fused_moe(x, topk, w, shape.act, configs=cfgs)
    assert rel_err(fused, separate) < W8A8_TOL[torch.bfloat16]


@pytest.mark.skipif(ON_GPU, reason="CPU interpreter run")
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8_w8a8"])
def test_tiny_tune_quantized(tmp_path, fmt):
    """`moekit tune --quantization`: tables keyed by the format, found by the runner's lookup
    (fp8: down timed on h quantized with gate_up's time, at direct and sorted rows)."""
    from moekit.bench import Ceilings
    from moekit.tune import TuneShape, tune

    shape = TuneShape(4, 2, 64, 32, "float16", ActivationSpec("silu"), False, "tiny")
    ceilings = Ceilings(1e10, 1e11, "float16")
    report = tune(shape, [3, 9], out_dir=tmp_path, device="cpu", progress=False, limit=1,
                  ceilings=ceilings, quantization=fmt)  # fmt: skip
    bound = TOLERANCE[torch.float16] if fmt == "mxfp4" else 3e-2  # fp8: the tuner's own check
    for r in report.results:
        assert r.rel_err < bound
    tag = _tables.quant_tag(make_spec(fmt))
    for path in report.paths.values():
        assert f",quant={tag}," in path.name and path.is_file()
    key = configs.TableKey("down", 4, 64, 32, "float16", "cpu", _tables.triton_version(), tag)
    assert key.filename() == report.paths["down"].name
