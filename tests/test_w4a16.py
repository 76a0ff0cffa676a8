"""The `w4a16` runner (moekit's CUDA kernels for 4-bit weight-only experts at decode sizes).

CPU: the permuted weight layout (`runners/w4a16/pack.py`) round trips, and an emulation of the
kernels' dequantization (the same bit operations and bf16 products, on the packed layout)
reproduces `moekit.quant.dequantize` exactly (nvfp4: with its scale rounded to bf16, as the
kernel does; int4 with groups of 64 or more: q - z, the scale applied in float32); availability
and workload rules. GPU (marked): every format, activation, bias, masked ids and batch size
against the torch reference runner, the preset shapes, CUDA graphs.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers import make_topk, rel_err

import moekit.runners.w4a16 as w4a16_runner
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Platform
from moekit.quant import Int4W4A16, make_spec, quantize_experts
from moekit.quant.packing import e2m1_decode, unpack_uint4
from moekit.quant.quantize import QuantizedTensor, dequantize, quantize
from moekit.runners import registry
from moekit.runners.base import RunnerError
from moekit.runners.torch import TorchRunner
from moekit.runners.w4a16 import W4A16Runner, jit, plans
from moekit.runners.w4a16 import pack as pk
from moekit.select import Workload, why_not
from moekit.stages import StandardDispatchOutput

SPECS = {
    "int4-g128-sym": Int4W4A16(128, True),
    "int4-g32-asym-f16": Int4W4A16(32, False, torch.float16),
    "int4-g64-asym-f32": Int4W4A16(64, False, torch.float32),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4": make_spec("nvfp4"),
}
BOUND = 3e-2  # bf16 against the reference (TOLERANCE[bfloat16]); bf16 atomics sum the K pairs


# ---------------------------------------------------------------------------------------------
# CPU: the layout and an emulation of the kernels' dequantization
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [0, 1, 2])
def test_codes_round_trip(fmt):
    codes = torch.randint(0, 16, (3, 48, 192), dtype=torch.uint8)
    packed = pk.pack_codes(codes, fmt)
    assert packed.shape == (3, 3, 3, 32, 4) and packed.dtype == torch.int32
    assert torch.equal(pk.unpack_codes(packed, fmt), codes)


@pytest.mark.parametrize("group", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_scales_round_trip(group, dtype):
    s = torch.randint(0, 255, (2, 32, 256 // group), dtype=torch.uint8)
    if dtype == torch.bfloat16:
        s = torch.randn(2, 32, 256 // group).to(dtype)
    packed = pk.pack_scales(s, group)
    # one block per K chunk of 64, or per group where a group spans chunks: each scale once
    per_block = max(1, 64 // group) * 16 * s.element_size()
    assert packed.shape == (2, 2, 256 // max(group, 64), per_block)
    assert torch.equal(pk.unpack_scales(packed, dtype, group), s)


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    """uint16 bit patterns (held in int64) -> bf16 values."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _halves(word: torch.Tensor):
    return _bf16(word & 0xFFFF), _bf16((word >> 16) & 0xFFFF)


def _multipliers(m: pk.PackedMatrix, scales: torch.Tensor, e: torch.Tensor):
    """The kernel's bf16 multiplier of each (row, group) entry: int4 the scale; mxfp4
    2^(code - 1) (one product) or 2^(code - 127); nvfp4 bf16(2^126 s g) or bf16(s g)."""
    if m.fmt == pk.FMT_CODES["int4_w4a16"]:
        return scales.float()
    if m.fmt == pk.FMT_CODES["mxfp4"]:
        code = scales.to(torch.int64)
        if m.two_mul:
            return _bf16(torch.where(code > 0, code << 7, 0x40)).float()
        return _bf16((code + 126) << 7).float()
    f = scales.view(torch.float8_e4m3fn).float() * m.global_scale[e]
    return (f if m.two_mul else f * 2.0**126).to(torch.bfloat16).float()


def emulate_dequant(m: pk.PackedMatrix, N: int, K: int) -> torch.Tensor:
    """[E, N, K]: the weights the kernels multiply by, computed from the packed tensors with the
    kernels' bit operations (csrc/w4a16.cu `dequant`, `fp4_multiplier`): bf16, or float32 where
    the MMAs take q - z and the scale multiplies their sums (`post_scale`)."""
    E = m.codes.shape[0]
    q = m.codes.to(torch.int64) & 0xFFFFFFFF  # [E, NT, KC, 32, 4]
    dt = torch.bfloat16 if m.fmt == pk.FMT_CODES["int4_w4a16"] else torch.uint8
    scales = pk.unpack_scales(m.scales, dt, m.group)  # [E, N, K / group]
    e = torch.arange(E).view(E, 1, 1)
    mult = _multipliers(m, scales, e).repeat_interleave(m.group, dim=2)  # [E, N, K]
    zero = None
    if m.zeros is not None:
        zero = pk.unpack_scales(m.zeros, torch.bfloat16, m.group)
        zero = zero.repeat_interleave(m.group, dim=2)
    row, col = pk._lane_map(q.device)  # [32, 4, 4, 2]
    vals = torch.empty(*q.shape, 4, 2, dtype=torch.bfloat16)
    for j in range(4):
        if m.fmt == pk.FMT_CODES["int4_w4a16"]:
            t = ((q >> (4 * j)) & 0x000F000F) | 0x43004300
        elif j < 3:
            t = (q << (3 * j)) & 0x81C081C0
        else:
            t = ((q << 1) & 0x80008000) | ((q >> 5) & 0x01000100) | ((q >> 4) & 0x00C000C0)
        for half, v in enumerate(_halves(t)):
            vals[..., j, half] = v
    # place each value at its (row, column) and apply the kernel's arithmetic there
    NT, KC = q.shape[1], q.shape[2]
    tile = torch.empty(E, NT, KC, 16 * 64, dtype=torch.bfloat16)
    tile[..., (row * 64 + col).reshape(-1)] = vals.reshape(E, NT, KC, -1)
    raw = tile.view(E, NT, KC, 16, 64).permute(0, 1, 3, 2, 4).reshape(E, N, K)
    if m.fmt == pk.FMT_CODES["int4_w4a16"]:
        z = zero if zero is not None else torch.full_like(raw, 136.0)
        if m.post_scale:
            return (raw - z).float() * mult
        return ((raw - z) * mult.to(torch.bfloat16)).to(torch.bfloat16)
    if m.two_mul:
        raw = raw * torch.tensor(2.0**126, dtype=torch.bfloat16)
    return raw * mult.to(torch.bfloat16)


def reference_weights(q: QuantizedTensor, post_scale: bool) -> torch.Tensor:
    """The weights as the kernels must see them: `dequantize` rounded to bf16 (in float32 where
    the kernels scale after the MMAs), with the scale first rounded to bf16 where the kernel
    does (int4 float32 / float16 scales, nvfp4)."""
    spec = q.spec
    if spec.name == "int4_w4a16":
        s = q.scale.to(torch.bfloat16).to(spec.scale_dtype)
        return dequantize(replace(q, scale=s), torch.float32 if post_scale else torch.bfloat16)
    if spec.name == "nvfp4":
        v = e2m1_decode(unpack_uint4(q.data))
        s = (q.scale.float() * q.global_scale[:, None, None]).to(torch.bfloat16).float()
        return (v * s.repeat_interleave(16, dim=-1)).to(torch.bfloat16)
    return dequantize(q, torch.bfloat16)


@pytest.mark.parametrize("fmt", list(SPECS))
@pytest.mark.parametrize("scale_up", [1.0, 2.0**10])
def test_emulated_dequant_matches_reference(fmt, scale_up):
    """The kernels' bit tricks give the reference's bf16 weights exactly, for codes of every
    value (e2m1 subnormals included) and scales large enough to need two products."""
    spec = SPECS[fmt]
    w = torch.randn(3, 32, 256) * scale_up
    w[0, 0, :64] = 0.0  # an all-zero group
    w[1, 3, 5] = 10 * scale_up  # an outlier (fp4 scale 2: still one product)
    q = quantize(w, spec)
    m = pk.pack_matrix(q.data, q.scale, q.zero, q.global_scale, spec)
    if spec.name in ("mxfp4", "nvfp4"):
        assert m.two_mul == (scale_up > 1)
    assert m.post_scale == (spec.name == "int4_w4a16" and spec.group_size >= 64)
    got = emulate_dequant(m, 32, 256)
    assert torch.equal(got, reference_weights(q, m.post_scale)), fmt


def test_pack_experts_deinterleaves_gate_and_up():
    spec = make_spec("mxfp4")
    E, H, I = 2, 64, 64
    w = ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(E, 2 * I),
                      torch.randn(E, H))  # fmt: skip
    q = quantize_experts(w, spec)
    p = pk.pack_experts(q, interleaved=True)
    codes = pk.unpack_codes(p.w13.codes, p.w13.fmt)
    stored = unpack_uint4(q.w13)
    assert torch.equal(codes[:, :I], stored[:, 0::2]) and torch.equal(codes[:, I:], stored[:, 1::2])
    assert torch.equal(p.b13.float(), torch.cat((q.b13[:, 0::2], q.b13[:, 1::2]), 1).to(
        torch.bfloat16).float())  # fmt: skip
    plain = pk.pack_experts(q, interleaved=False)
    assert torch.equal(pk.unpack_codes(plain.w13.codes, 1), stored)


# ---------------------------------------------------------------------------------------------
# CPU: availability and workload rules
# ---------------------------------------------------------------------------------------------

H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"torch": "2.11"})
T4 = Platform("cuda", "Tesla T4", (7, 5), 1, {"torch": "2.11"})
CPU = Platform("cpu", "cpu", None, 0, {"torch": "2.11"})


def test_availability(monkeypatch):
    assert "no CUDA GPU" in registry.availability("w4a16", CPU).reason
    assert "SM75" in registry.availability("w4a16", T4).reason
    monkeypatch.setattr(W4A16Runner, "toolchain_problem", staticmethod(lambda: None))
    assert registry.availability("w4a16", H100)
    monkeypatch.setattr(W4A16Runner, "toolchain_problem", staticmethod(lambda: "needs nvcc"))
    assert registry.availability("w4a16", H100).reason == "needs nvcc"


def test_workload_rules(monkeypatch):
    monkeypatch.setattr(W4A16Runner, "toolchain_problem", staticmethod(lambda: None))
    base = dict(weight_format="mxfp4", num_experts=128, hidden_size=2880, intermediate_size=2880,
                top_k=4)  # fmt: skip
    assert why_not("w4a16", Workload(32, **base), H100) is None
    assert "at most 128" in why_not("w4a16", Workload(33, **base), H100)
    odd = dict(base, intermediate_size=96)
    assert "I=96" in why_not("w4a16", Workload(1, **odd), H100)
    bf16 = dict(base, weight_format="unquantized")
    assert "weight format 'unquantized'" in why_not("w4a16", Workload(1, **bf16), H100)
    masked = Workload(1, format="masked", **base)
    assert "dispatch format 'masked'" in why_not("w4a16", masked, H100)


def test_run_refuses_large_batches():
    spec = make_spec("mxfp4")
    w = quantize_experts(ExpertWeights(torch.randn(4, 128, 64), torch.randn(4, 64, 64)), spec)
    x = torch.randn(65, 64, dtype=torch.bfloat16)
    with pytest.raises(RunnerError, match="at most 128"):
        W4A16Runner().run_standard(x, make_topk(65, 2, 4, device="cpu"), w, ActivationSpec())


def test_plan_rules():
    """Segments of 16 pairs only when experts expect more than 8; a GEMM with little work (few
    experts) spreads over more blocks: K over more warps, then down at 16 rows a warp; one with
    plenty keeps whole rows of K per warp."""
    sms, occ = 132, (9, 7, 6, 5)  # H100 blocks per multiprocessor, (nt, mt) = 11, 12, 21, 22
    # mixtral-8x7b TP2 at T = 1: two experts
    assert jit.plan(jit.GATE_UP, 2, 8, 7168, 4096, sms, occ) == jit.Plan(1, 4, 2)
    assert jit.plan(jit.DOWN, 2, 8, 4096, 7168, sms, occ) == jit.Plan(1, 4, 1, 2)
    # qwen3-30b-a3b at T = 16: 128 pairs over 128 experts, plenty of blocks
    assert jit.plan(jit.DOWN, 128, 128, 2048, 768, sms, occ) == jit.Plan(1, 1, 2)
    # mixtral-8x7b TP2 at T = 64: 16 pairs an expert
    assert jit.plan(jit.GATE_UP, 128, 8, 7168, 4096, sms, occ).nt == 2
    for kind, n in ((jit.GATE_UP, 768), (jit.DOWN, 2048)):
        p = jit.plan(kind, 1, 128, n, 2048, sms, occ)
        assert (p.mt, p.split_k, p.k_blocks) in jit.SHARES[kind]


def test_overlap_rule():
    """down starts during gate_up where its blocks cannot pile onto a few multiprocessors."""
    assert jit.overlap_pays(924, 924, 660, 660)  # down fills every slot of a wave
    assert jit.overlap_pays(660, 660, 720, 792)  # nearly
    assert jit.overlap_pays(384, 660, 256, 660)  # gate_up leaves room for all of down's blocks
    assert not jit.overlap_pays(896, 924, 256, 660)  # mixtral TP2 T = 1: they would pile up
    assert not jit.overlap_pays(720, 924, 360, 660)


def test_launches_decided_once_per_call_shape(monkeypatch):
    """The plans and the overlap are decided on the first call of a shape, again for new
    weights."""
    decided = []
    monkeypatch.setattr(W4A16Runner, "choose_plans",
                        staticmethod(lambda T, *a: decided.append(T) or (jit.Plan(1, 4), jit.Plan(1, 2))))  # fmt: skip
    monkeypatch.setattr(jit, "down_overlaps", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch
    r, act, dev = W4A16Runner(), ActivationSpec(), torch.device("cpu")
    spec, E, H, I = make_spec("mxfp4"), 2, 64, 64
    for _ in range(2):  # a new set of weights the second time
        w = quantize_experts(ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I)), spec)
        p = r.packed(w, interleaved=False)
        for T in (1, 4, 1, 4):
            assert r.launches(T, 2, w, act, 1.0, p, dev) == (jit.Plan(1, 4), jit.Plan(1, 2), True)
    assert decided == [1, 4, 1, 4]


def test_plan_tables(tmp_path, monkeypatch):
    """Measured plans: written and read back, the nearest measured batch size within a factor
    2 wins; the runner looks them up by shape, format and GPU name, else asks the cost model."""
    a = (jit.Plan(1, 4, 2, 1, True), jit.Plan(1, 4, 1, 2, False))
    b = (jit.Plan(2, 1, 2, 1, False), jit.Plan(2, 2, 2, 1, True))
    name = plans.table_name(4, 2, 64, 128, "silu", False, "mxfp4", "NVIDIA H100 80GB HBM3")
    assert name == "E=4,K=2,H=64,I=128,act=silu,quant=mxfp4,device=NVIDIA_H100_80GB_HBM3.json"
    plans.write_table(tmp_path / name, {1: a, 16: b, 0.5: a}, {"device": "test"})
    assert plans.read_table(tmp_path / name) == {0.5: a, 1: a, 16: b}
    assert plans.plans_for(name, 2, tmp_path) == a
    assert plans.plans_for(name, 4, tmp_path) is None  # a factor 4 from both 1 and 16
    assert plans.plans_for(name, 8, tmp_path) == b
    assert plans.plans_for(name, 0.25, tmp_path) == a
    assert plans.plans_for(name, 64, tmp_path) is None  # more than a factor 2 from 16
    assert plans.plans_for("other.json", 1, tmp_path) is None
    bad = tmp_path / "bad.json"
    bad.write_text('{"plans": {"1": {"gate_up": {"nt": 3, "split_k": 1}, "down": {}}}}')
    with pytest.raises(ValueError, match="bad w4a16 plan file .*bad.json"):
        plans.read_table(bad)

    spec = make_spec("mxfp4")
    w = quantize_experts(ExpertWeights(torch.randn(4, 256, 64), torch.randn(4, 64, 128)), spec)
    assert plans.table_name_for(w, 2, ActivationSpec(), "NVIDIA H100 80GB HBM3") == name
    monkeypatch.setattr(plans, "table_dir", lambda: tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(w4a16_runner, "sm_count", lambda *_: 132)
    occ = (7, 5, 4, 4)
    monkeypatch.setattr(jit, "occupancy", lambda *_, **__: occ)
    packed = SimpleNamespace(w13=None, b13=None, w2=None, b2=None)
    dev = torch.device("cuda", 0)
    assert W4A16Runner.choose_plans(2, 2, w, ActivationSpec(), 1.0, packed, dev) == a
    assert W4A16Runner.choose_plans(64, 2, w, ActivationSpec(), 0.25, packed, dev) == b  # 16 local
    model = (jit.plan(jit.GATE_UP, 128, 4, 128, 64, 132, occ),
             jit.plan(jit.DOWN, 128, 4, 64, 128, 132, occ))  # fmt: skip
    assert W4A16Runner.choose_plans(64, 2, w, ActivationSpec(), 1.0, packed, dev) == model


def test_shipped_plan_tables():
    """Every shipped table parses, names a GPU and has plans the kernels take."""
    files = sorted(plans.table_dir().glob("*.json"))
    assert files, "no shipped w4a16 plan tables"
    for f in files:
        table = plans.read_table(f)
        assert "device=" in f.name and table, f
        for gate_up, down in table.values():
            assert (gate_up.mt, gate_up.split_k, gate_up.k_blocks) in jit.SHARES[jit.GATE_UP], f
            assert (down.mt, down.split_k, down.k_blocks) in jit.SHARES[jit.DOWN], f


# ---------------------------------------------------------------------------------------------
# GPU: against the reference runner
# ---------------------------------------------------------------------------------------------


def _run_both(x, topk, w, act, runner=None):
    d = StandardDispatchOutput(x, topk)
    out = (runner or W4A16Runner()).run(d, w, act).out
    ref = TorchRunner().run(d, w, act).out
    return out, ref


def _experts(spec, E, H, I, bias):
    w13 = (torch.rand(E, 2 * I, H, device="cuda") * 2 - 1) / H**0.5
    w2 = (torch.rand(E, H, I, device="cuda") * 2 - 1) / I**0.5
    b13 = b2 = None
    if bias:
        b13 = (torch.randn(E, 2 * I, device="cuda") * 0.1).to(torch.bfloat16)
        b2 = (torch.randn(E, H, device="cuda") * 0.1).to(torch.bfloat16)
    return quantize_experts(ExpertWeights(w13, w2, b13, b2), spec)


ACTS = {
    "silu": (ActivationSpec(), False),
    "gelu": (ActivationSpec("gelu"), False),
    "swiglu_oai": (ActivationSpec("swiglu_oai", interleaved=True), True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(SPECS))
@pytest.mark.parametrize("act", list(ACTS))
def test_formats_and_activations_gpu(fmt, act):
    """E not a power of two, masked ids, T = 0, 1, 5 (one segment per expert) and 16 (two
    MMA column groups), and every pair on one expert (segments of 8 / 16 pairs)."""
    torch.manual_seed(0)
    spec, (a, bias) = SPECS[fmt], ACTS[act]
    E, K, H, I = 12, 4, 384, 256
    w = _experts(spec, E, H, I, bias)
    runner = W4A16Runner()
    for T, kw in ((0, {}), (1, {}), (5, dict(masked=0.2)), (16, dict(masked=0.1)),
                  (16, dict(one_expert=True)), (3, dict(one_expert=True))):  # fmt: skip
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, K, E, device="cuda", **kw)
        out, ref = _run_both(x, topk, w, a, runner)
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        assert rel_err(out, ref) < BOUND, (fmt, act, T, kw, rel_err(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4-g128-sym", "mxfp4", "nvfp4"])
@pytest.mark.parametrize(
    "model,tp,ep",
    [
        ("qwen3-30b-a3b", 1, 1),
        ("deepseek-v3", 8, 8),
        ("gpt-oss-120b", 1, 1),
        ("mixtral-8x7b", 2, 1),
    ],
)
def test_presets_gpu(model, tp, ep, fmt):
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    spec = SPECS[fmt]
    if shape.hidden % getattr(spec, "group_size", 1) or shape.intermediate % spec.group_size:
        pytest.skip(f"group {spec.group_size} does not divide H / I")
    torch.manual_seed(0)
    w = quantize_experts(random_weights(shape, "cuda"), spec)
    runner = W4A16Runner()
    for T in (1, 4, 16):
        T = min(T, jit.MAX_PAIRS // shape.top_k)
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.1 if ep > 1 else 0.0,
                         device="cuda")  # fmt: skip
        out, ref = _run_both(x, topk, w, shape.act, runner)
        assert rel_err(out, ref) < BOUND, (model, fmt, T, rel_err(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4-g64-asym-f32", "nvfp4"])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_plan_gpu(fmt, overlap, monkeypatch):
    """Every way of running the two GEMMs (through the ring or directly into registers, 8 or 16
    pairs a segment, K over 1, 2 or 4 warps, down at 16 or 32 rows a warp and over 1, 2 or 4
    blocks, down started during gate_up or after it), whatever the runner would pick, against
    the reference."""
    torch.manual_seed(0)
    E, K, H, I = 12, 4, 384, 256
    w = _experts(SPECS[fmt], E, H, I, bias=True)
    act = ActivationSpec("swiglu_oai", interleaved=True)
    monkeypatch.setattr(jit, "down_overlaps", lambda *a: overlap)
    for ring in (True, False):
        for nt in (1, 2):
            for mt, split_k, k_blocks in jit.SHARES[jit.DOWN]:
                forced = (
                    jit.Plan(nt, split_k, 2, 1, ring),
                    jit.Plan(nt, split_k, mt, k_blocks, ring),
                )
                monkeypatch.setattr(W4A16Runner, "choose_plans", staticmethod(lambda *a, p=forced: p))
                runner = W4A16Runner()  # decides its plans once per call shape
                for T, kw in ((1, {}), (20, dict(masked=0.1)), (6, dict(one_expert=True))):
                    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                    topk = make_topk(T, K, E, device="cuda", **kw)
                    out, ref = _run_both(x, topk, w, act, runner)
                    assert rel_err(out, ref) < BOUND, (fmt, forced, T, rel_err(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_cuda_graph_gpu(overlap, monkeypatch):
    from helpers import capture_graph

    monkeypatch.setattr(jit, "down_overlaps", lambda *a: overlap)
    spec = SPECS["mxfp4"]
    E, K, H, I, T = 16, 4, 512, 256, 9
    w = _experts(spec, E, H, I, bias=True)
    act = ActivationSpec("swiglu_oai", interleaved=True)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, K, E, device="cuda")
    runner = W4A16Runner()
    d = StandardDispatchOutput(x, topk)
    graph, out = capture_graph(lambda: runner.run(d, w, act).out)
    x.copy_(torch.randn_like(x))
    topk.ids.copy_(make_topk(T, K, E, device="cuda").ids)
    graph.replay()
    torch.cuda.synchronize()
    ref = TorchRunner().run(d, w, act).out
    assert rel_err(out, ref) < BOUND


def test_packed_copy_follows_the_weights():
    """The permuted copy is made once per set of weights; weights written in place (an EPLB
    move) are permuted again into the same copy (CUDA graphs captured with it stay valid) with
    the call plans kept; other weights get a new copy, new plans, and the old copy is freed."""
    import gc
    import weakref

    g = torch.Generator().manual_seed(3)
    w = ExpertWeights(torch.randn(4, 128, 128, generator=g).bfloat16() * 0.1,
                      torch.randn(4, 128, 64, generator=g).bfloat16() * 0.1)  # fmt: skip
    q = quantize_experts(w, "int4_w4a16", group_size=64)
    runner = W4A16Runner()
    p = runner.packed(q, False)
    runner._launches["plan"] = "kept"
    assert runner.packed(q, False) is p
    codes = p.w13.codes.data_ptr()
    q.w13.copy_(q.w13.flip(0))  # the experts move, in place
    assert runner.packed(q, False) is p and p.w13.codes.data_ptr() == codes
    assert torch.equal(p.w13.codes, pk.pack_experts(q, False).w13.codes)
    assert runner._launches == {"plan": "kept"}
    old = weakref.ref(p)
    del p
    other = quantize_experts(w, "int4_w4a16", group_size=64)
    assert runner.packed(other, False) is not None and runner._launches == {}
    gc.collect()
    assert old() is None
