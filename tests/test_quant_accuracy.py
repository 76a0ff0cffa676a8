"""Accuracy table: the MoE output of every weight format (torch reference runner, bf16
activations) against

  kernel     float64 with what a kernel computes: weights dequantized to bf16 (weight-only
             formats) or float32 (w8a8), the same activation quantization, the first GEMM's
             output and the intermediate rounded to bf16: only the accumulation order and the
             output rounding differ, so a fast runner's kernel is checked against this bound;
  dequant    float64 with the dequantized weights and unquantized activations: adds the w8a8
             activation-quantization loss;
  unquant    float64 with the original unquantized weights: the format's own loss.

Inputs: 'random' (nn.Linear-like weights, normal x), 'outliers' (a few x channels x50 and a few
weights x20), 'zero_groups' (all-zero x groups / rows and weight groups / rows), 'extremes'
(weights x1e3 on half the experts and x1e-3 on the other half; x x1e-2 on half the tokens and
x1e2 on the other half). Relative norm errors; the
bounds are about 1.5x the largest value measured over the cases (seeded per test; see below). Run with -s
to see the table.
"""

import pytest
import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import (
    Fp8W8A8,
    Int4W4A16,
    calibrate_static_scales,
    make_spec,
    quantize_experts,
)
from moekit.quant.act_quant import fake_quantize_act, tensor_scale
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.torch import activate, moe_reference_fp64
from moekit.stages import StandardDispatchOutput
from tests.helpers import rel_err

E, K, T, H, I = 6, 2, 48, 256, 128

# name: (spec, bound vs kernel, vs dequant, vs unquant). Measured maxima over the four cases
# (E=6, K=2, T=48, H=256, I=128): kernel 0.0017 (w8a8) / 0.0025 (weight-only); dequant fp8 0.049,
# int8_w8a8 0.037, weight-only 0.0052; unquant fp8 0.070, int8_w8a8 0.039, int8_w8a16 0.014,
# int4 g32/g64 0.127, int4 g128 0.200 (outliers), mxfp4 0.198, nvfp4 0.182.
KERNEL = 0.005
FORMATS = {
    "fp8 block/token_group": (Fp8W8A8("block"), KERNEL, 0.075, 0.105),
    "fp8 channel/token": (Fp8W8A8("channel"), KERNEL, 0.075, 0.105),
    "fp8 tensor/dynamic": (Fp8W8A8("tensor"), KERNEL, 0.075, 0.105),
    "fp8 tensor/static": (Fp8W8A8("tensor", activation_scheme="static_tensor"), KERNEL, 0.075, 0.105),
    "int8_w8a8": (make_spec("int8_w8a8"), KERNEL, 0.055, 0.06),
    "int8_w8a16": (make_spec("int8_w8a16"), KERNEL, 0.008, 0.021),
    "int4 g32 sym": (Int4W4A16(32, True), KERNEL, 0.008, 0.19),
    "int4 g64 asym": (Int4W4A16(64, False), KERNEL, 0.008, 0.19),
    "int4 g128 sym": (Int4W4A16(128, True), KERNEL, 0.008, 0.3),
    "mxfp4": (make_spec("mxfp4"), KERNEL, 0.008, 0.3),
    "nvfp4": (make_spec("nvfp4"), KERNEL, 0.008, 0.27),
}
CASES = ("random", "outliers", "zero_groups", "extremes")


def make_case(case: str):
    """Unquantized weights (float32), x [T, H] bf16, top-k."""
    w13 = (torch.rand(E, 2 * I, H) * 2 - 1) / H**0.5
    w2 = (torch.rand(E, H, I) * 2 - 1) / I**0.5
    x = torch.randn(T, H)
    if case == "outliers":
        x[:, torch.randperm(H)[:4]] *= 50
        for w in (w13, w2):
            flat = w.view(-1)
            flat[torch.randperm(flat.numel())[:20]] *= 20
    elif case == "zero_groups":
        x[::2, 128:256] = 0  # a zero activation group (token_group) on half the tokens
        x[5] = 0  # a zero token
        w13[:, :, 64:128] = 0  # zero weight groups (int4 / fp4) and half an fp8 block
        w13[:, 5] = 0  # a zero row (per-channel)
        w13[0] = 0  # a zero expert (per-tensor)
        w2[:, :, 32:64] = 0
    elif case == "extremes":
        w13[: E // 2] *= 1e3
        w2[: E // 2] *= 1e3
        x *= 1e-2
        w13[E // 2 :] *= 1e-3
        w2[E // 2 :] *= 1e-3
        x[T // 2 :] *= 1e4
    ids = torch.rand(T, E).argsort(dim=1)[:, :K].to(torch.int32)
    return ExpertWeights(w13, w2), x.to(torch.bfloat16), TopKOutput(torch.rand(T, K), ids)


def kernel_reference(x, topk, q: ExpertWeights, act):
    """Float64, every expert on every token (dense), with the roundings of a kernel (module
    docstring); the activation quantization sees only the routed (token, expert) rows."""
    spec = q.spec
    w = q.dequantized(x.dtype if spec.weight_only else torch.float32)
    routed = torch.zeros(E, T, dtype=torch.bool)  # [E, T]: token t is routed to expert e
    for k in range(K):
        ok = topk.ids[:, k] >= 0
        routed[topk.ids[ok, k].long(), torch.nonzero(ok)[:, 0]] = True

    def fq(v, which):  # v [E, T, D] or [T, D]
        if spec.weight_only:
            return v.double()
        scale = None
        if spec.act_scheme == "static_tensor":
            scale = (q.a13_scale if which == 1 else q.a2_scale).view(E, 1, 1)
        elif spec.act_scheme == "dynamic_tensor":
            scale = tensor_scale(x if which == 1 else v[routed], spec.act_dtype)
        g = spec.act_group_size or 128
        return fake_quantize_act(
            v, spec.act_scheme, spec.act_dtype, scale=scale, group_size=g, out_dtype=torch.float64
        )

    if spec.act_scheme == "static_tensor":  # one scale per expert: x quantized per expert
        h = torch.einsum("eth,eih->eti", fq(x.expand(E, T, H), 1), w.w13.double())
    else:
        h = torch.einsum("th,eih->eti", fq(x, 1), w.w13.double())
    a = activate(h.to(x.dtype).double(), act).to(x.dtype)
    y = torch.einsum("eti,ehi->eth", fq(a, 2), w.w2.double())  # [E, T, H]
    ids = topk.ids.long()
    picked = y[ids.clamp(min=0), torch.arange(T).unsqueeze(1)]  # [T, K, H]
    weights = torch.where(ids >= 0, topk.weights.double(), 0.0)
    return (picked * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize("case", CASES)
def test_accuracy_table(case):
    act = ActivationSpec("silu")
    unq, x, topk = make_case(case)
    runner = registry.runner_class("torch")()
    ref_unquant = moe_reference_fp64(x, topk, unq, act)
    assert ref_unquant.norm() > 0
    rows, failures = [], []
    for name, (spec, b_kernel, b_dequant, b_unquant) in FORMATS.items():
        scales = {}
        if spec.act_scheme == "static_tensor":
            a13, a2 = calibrate_static_scales(unq, act, x, topk)  # over the routed tokens
            scales = dict(a13_scale=a13, a2_scale=a2)
        q = quantize_experts(unq, spec, **scales)
        out = runner.run(StandardDispatchOutput(x, topk), q, act).out
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all(), name
        errs = (
            rel_err(out, kernel_reference(x, topk, q, act)),
            rel_err(out, moe_reference_fp64(x, topk, q, act)),
            rel_err(out, ref_unquant),
        )
        rows.append((name, *errs))
        bounds = (b_kernel, b_dequant, b_unquant)
        for what, err, bound in zip(("kernel", "dequant", "unquant"), errs, bounds):
            if not err <= bound:
                failures.append(f"{name} vs {what}: {err:.4f} > bound {bound}")
    print(f"\n[{case}] rel. error of the torch runner (bf16)  kernel    dequant   unquant")
    for name, ek, ed, eu in rows:
        print(f"  {name:40s} {ek:9.5f} {ed:9.5f} {eu:9.5f}")
    assert not failures, "\n".join(failures)
