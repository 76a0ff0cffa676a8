"""h quantized in gate_up's epilogue (`ops.gate_up(..., quant_h=...)`) against its reference
twin, gate_up's bf16 / fp16 h quantized by `quantize_input`, as the down GEMM would get it.

Bit for bit: the scales, and the fp8 codes. On CPU the Triton interpreter's cast to fp8 is
wrong, so there the kernel stores the values just before the cast (float32) and torch casts
them; on a GPU the kernel's own fp8 store is checked too, and the whole layer against the
path with a quantization kernel.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from helpers import capture_graph, make_topk, rel_err  # noqa: E402

from moekit.experts import ActivationSpec, ExpertWeights  # noqa: E402
from moekit.quant import Fp8W8A8, quantize_experts  # noqa: E402
from moekit.quant.act_quant import quantize_act_ref  # noqa: E402
from moekit.runners._align import align_block_size  # noqa: E402
from moekit.runners.triton import ops  # noqa: E402
from moekit.runners.triton.configs import GemmConfig  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
FP8 = torch.float8_e4m3fn
OAI = ActivationSpec("swiglu_oai", interleaved=True)


def _experts(E, H, I, bias=False):
    w13 = torch.randn(E, 2 * I, H, device=DEVICE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE) / I**0.5
    b13 = (torch.randn(E, 2 * I, device=DEVICE) * 0.1).to(DTYPE) if bias else None
    b2 = (torch.randn(E, H, device=DEVICE) * 0.1).to(DTYPE) if bias else None
    return quantize_experts(ExpertWeights(w13, w2, b13, b2), Fp8W8A8("block"))


def _rows(x, topk, w, cfg):
    """The rows fused_moe would use, and which slots of h hold a pair."""
    x, ids, _ = ops.kernel_inputs(x, topk)
    E = w.num_experts
    if x.shape[0] <= ops.PIPELINE.direct_max_tokens:
        cfg = ops._direct_rows(cfg)
        flat = ids.reshape(-1)
        return x, cfg, ops.Rows.direct(flat, E), (flat >= 0) & (flat < E)
    align = align_block_size(ids, E, cfg.block_m)
    rows = ops.Rows.sorted(align, E, 1.0)
    used = torch.arange(rows.slots(), device=x.device) < align.num_rows  # rows past: unwritten
    return x, cfg, rows, used & (align.sorted_ids < align.num_pairs)


CASES = {
    "bn128": (GemmConfig(16, 128, 64), ActivationSpec(), False, 256),
    "bn128-swap-oai-bias": (GemmConfig(16, 128, 128, swap_ab=True), OAI, True, 256),
    # I = 320: the last group 64 columns wide, the last tile past N
    "bn128-partial": (GemmConfig(16, 128, 64), ActivationSpec(), False, 320),
    "bn256-partial-oai-bias": (GemmConfig(32, 256, 64), OAI, True, 320),
    # split-K: the last K share of each tile quantizes it
    "bn128-split4-oai-bias": (GemmConfig(16, 128, 64, split_k=4), OAI, True, 320),
}


@pytest.mark.parametrize("T", [0, 3, 13])
@pytest.mark.parametrize("case", list(CASES))
def test_quant_h_matches_separate_quantization(case, T):
    cfg, act, bias, I = CASES[case]
    E, K, H = 6, 2, 192
    w = _experts(E, H, I, bias)
    x = torch.randn(T, H, device=DEVICE, dtype=DTYPE) * 2
    topk = make_topk(T, K, E, masked=0.2 if T > 1 else 0.0, device=DEVICE)
    x, cfg, rows, valid = _rows(x, topk, w, cfg)
    h = ops.gate_up(x, rows, w, act, cfg, K)
    q_ref, s_ref = quantize_act_ref(h[valid], "token_group", FP8)
    for out_dtype in (torch.float32, FP8) if ON_GPU else (torch.float32,):
        q, s = ops.gate_up(x, rows, w, act, cfg, K, quant_h=out_dtype)
        assert q.shape == h.shape and s.shape == (h.shape[0], -(-I // 128))
        codes = q[valid] if out_dtype == FP8 else q[valid].to(FP8)
        assert torch.equal(codes.view(torch.uint8), q_ref.view(torch.uint8)), (case, out_dtype)
        assert torch.equal(s[valid], s_ref), (case, out_dtype)


def test_quant_h_refused_where_it_cannot_apply():
    w = _experts(2, 128, 128)
    x = torch.randn(2, 128, device=DEVICE, dtype=DTYPE)
    topk = make_topk(2, 1, 2, device=DEVICE)
    plain = ExpertWeights(torch.randn(2, 256, 128, device=DEVICE),
                          torch.randn(2, 128, 128, device=DEVICE))  # fmt: skip
    per_token = quantize_experts(plain, Fp8W8A8("block", activation_scheme="token"))
    x, cfg, rows, _ = _rows(x, topk, w, GemmConfig(16, 128, 64))
    with pytest.raises(ValueError, match="quant_h: needs per-token-group activations"):
        ops.gate_up(x, rows, per_token, ActivationSpec(), cfg, 1, quant_h=torch.float32)
    narrow = replace(cfg, block_n=64)
    with pytest.raises(ValueError, match="a group that divides block_n 64, and no `out`"):
        ops.gate_up(x, rows, w, ActivationSpec(), narrow, 1, quant_h=torch.float32)
    with pytest.raises(ValueError, match="and no `out`"):
        ops.gate_up(x, rows, w, ActivationSpec(), cfg, 1, out=torch.empty(2, 128, dtype=DTYPE),
                    quant_h=torch.float32)  # fmt: skip
    assert ops.h_quant_dtype(per_token, cfg, x) is None
    assert ops.h_quant_dtype(w, narrow, x) is None
    expected = FP8 if x.device.type == "cuda" else None  # the interpreter cannot cast to fp8
    assert ops.h_quant_dtype(w, cfg, x) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("model,tp,ep", [("qwen3-30b-a3b", 1, 1), ("gpt-oss-120b", 1, 1),
                                         ("deepseek-v3", 8, 8)])  # fmt: skip
def test_layer_with_quant_h_gpu(model, tp, ep, T, monkeypatch):
    """The fp8 block-wise layer on the preset shapes with its tables' configs (gate_up at least
    128 columns wide): h quantized in gate_up equals h quantized by its own kernel, bit for bit
    (same h, same arithmetic), eager and in CUDA-graph replay."""
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    torch.manual_seed(T)
    w = quantize_experts(random_weights(shape, "cuda"), Fp8W8A8("block"))
    x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.02, device="cuda")
    cfgs = ops.configs_for(T, shape.top_k, w, x.dtype, x.device)
    cfgs = (replace(cfgs[0], block_n=max(cfgs[0].block_n, 128)), cfgs[1])
    assert ops.h_quant_dtype(w, cfgs[0], x) == FP8
    # deterministic sums, so that the two paths can be compared bit for bit
    cfgs = (cfgs[0], replace(cfgs[1], reduce="kernel", split_k=1))
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, quant_h_in_gate_up=False))
    separate = ops.fused_moe(x, topk, w, shape.act, configs=cfgs)
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, quant_h_in_gate_up=True))
    fused = ops.fused_moe(x, topk, w, shape.act, configs=cfgs)
    assert torch.equal(fused, separate), rel_err(fused, separate)
    g, replayed = capture_graph(lambda: ops.fused_moe(x, topk, w, shape.act, configs=cfgs))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, quant_h_in_gate_up=False))
        expect = ops.fused_moe(x, topk, w, shape.act, configs=cfgs)
        monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, quant_h_in_gate_up=True))
        torch.cuda.synchronize()
        assert torch.equal(replayed, expect)
