"""calibrate_static_scales: a hand-computed example, routed tokens against all tokens, the
fallback of an expert no token reaches, quantized weights, the errors, and fresh random inputs
against an independent float64 loop."""

import math

import pytest
import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant import Fp8W8A8, Int4W4A16, calibrate_static_scales, quantize_experts
from moekit.quant import calibrate as calibrate_mod
from moekit.quant.act_quant import EPS
from moekit.router import TopKOutput
from moekit.runners.torch import activate

SILU = ActivationSpec("silu")


def silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def topk_of(ids) -> TopKOutput:
    ids = torch.tensor(ids, dtype=torch.int32)
    return TopKOutput(torch.ones(ids.shape), ids)


def tiny():
    """E = 2, H = 2, I = 1. Expert 0: gate = x0, up = x1. Expert 1: gate = 2 x1 + 1,
    up = x0 - 1. Tokens (1, -2) and (4, 0.5)."""
    w13 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 2.0], [1.0, 0.0]]])
    b13 = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    w = ExpertWeights(w13, torch.randn(2, 2, 1), b13=b13)
    x = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    return w, x


def check(got: torch.Tensor, amaxes: list[float]) -> None:
    assert got.dtype == torch.float32 and got.shape == (len(amaxes),)
    want = torch.tensor([a / 448 for a in amaxes], dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_worked_example_routed():
    """Token 0 -> expert 0, token 1 -> expert 1 (-1 and the non-local id 5 are ignored):
    a13 = amax|x| of the expert's token, a2 = |silu(gate) * up| of it."""
    w, x = tiny()
    a13, a2 = calibrate_static_scales(w, SILU, x, topk_of([[0, -1], [5, 1]]))
    check(a13, [2.0, 4.0])
    # expert 0, token 0: silu(1) * -2; expert 1, token 1: gate 2, up 3
    check(a2, [2 * silu(1.0), 3 * silu(2.0)])


def test_worked_example_all_tokens():
    """No topk: both experts see both tokens, so a13 is the amax over all of x and expert 0's
    a2 comes from token 1 (silu(4) * 0.5 > |silu(1) * -2|), unlike the routed case."""
    w, x = tiny()
    a13, a2 = calibrate_static_scales(w, SILU, x)
    check(a13, [4.0, 4.0])
    # expert 1 on token 0: gate -3, up 0 -> 0; token 1 as above
    assert 0.5 * silu(4.0) > 2 * silu(1.0)
    check(a2, [0.5 * silu(4.0), 3 * silu(2.0)])


def test_routed_differs_from_all_and_ignores_other_rows():
    """An expert's routed scales depend on its tokens only: changing the tokens routed
    elsewhere leaves them unchanged, and they differ from the all-token scales."""
    torch.manual_seed(0)
    E, T, H, I = 4, 40, 32, 16
    w = ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), b13=torch.randn(E, 2 * I))
    x = torch.randn(T, H)
    ids = torch.arange(T, dtype=torch.int32)[:, None] % E  # token t -> expert t % E
    topk = TopKOutput(torch.ones(T, 1), ids)
    a13, a2 = calibrate_static_scales(w, SILU, x, topk)
    x2 = x.clone()
    x2[ids[:, 0] != 1] *= 100  # every token not routed to expert 1
    b13, b2 = calibrate_static_scales(w, SILU, x2, topk)
    assert a13[1] == b13[1] and a2[1] == b2[1]
    assert (b13[[0, 2, 3]] > 50 * a13[[0, 2, 3]]).all()
    all13, all2 = calibrate_static_scales(w, SILU, x)
    # a subset's amax (up to the float32 GEMM's summation order over fewer rows)
    assert (a13 <= all13).all() and (a2 <= all2 * (1 + 1e-6)).all()
    assert (a13 < all13).any() and (a2 < all2).any()
    torch.testing.assert_close(all13, torch.full((E,), float(x.abs().amax()) / 448))


def test_unreached_expert_falls_back_to_all_tokens():
    torch.manual_seed(1)
    E, T, H, I = 3, 10, 8, 4
    w = ExpertWeights(torch.randn(E, 2 * I, H), torch.randn(E, H, I))
    x = torch.randn(T, H)
    ids = torch.randint(0, 2, (T, 2), dtype=torch.int32)  # experts 0 and 1 only
    ids[0] = torch.tensor([-1, 7])  # masked and not local
    a13, a2 = calibrate_static_scales(w, SILU, x, TopKOutput(torch.ones(T, 2), ids))
    all13, all2 = calibrate_static_scales(w, SILU, x)
    assert a13[2] == all13[2] and a2[2] == all2[2]
    # no token reaches any expert (all masked / non-local): every expert on all tokens
    none = torch.tensor([[-1, E]], dtype=torch.int32).expand(T, 2)
    n13, n2 = calibrate_static_scales(w, SILU, x, TopKOutput(torch.ones(T, 2), none))
    assert torch.equal(n13, all13) and torch.equal(n2, all2)


def test_all_zero_input_gives_the_eps_floor():
    """As act_quant.tensor_scale: an all-zero input gives eps / 448 (finite, > 0)."""
    torch.manual_seed(2)
    E, H, I = 2, 8, 4
    w13 = torch.randn(E, 2 * I, H)
    w13[1] = 0  # expert 1's GEMM-1 output (and so its a2 input) is zero
    w = ExpertWeights(w13, torch.randn(E, H, I))
    floor = torch.tensor(EPS) / 448
    a13, a2 = calibrate_static_scales(w, SILU, torch.zeros(5, H))
    assert torch.equal(a13, floor.expand(E)) and torch.equal(a2, floor.expand(E))
    a13, a2 = calibrate_static_scales(w, SILU, torch.randn(5, H))
    assert a2[1] == floor and a2[0] > 1e-3 and (a13 > 1e-3).all()


@pytest.mark.parametrize(
    "spec", [Fp8W8A8("tensor"), Fp8W8A8("tensor", activation_scheme="static_tensor"),
             Int4W4A16(32, True)],
    ids=["fp8-dynamic", "fp8-static", "int4"],
)
def test_quantized_weights_are_dequantized(spec):
    """Quantized weights calibrate as their float32 dequantized twin (recalibration), close to
    but not the same as the original weights."""
    torch.manual_seed(3)
    E, T, H, I = 4, 24, 64, 32
    unq = ExpertWeights(torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 8,
                        b13=torch.randn(E, 2 * I))  # fmt: skip
    x = torch.randn(T, H, dtype=torch.bfloat16)
    topk = topk_of(torch.randint(0, E, (T, 2)).tolist())
    scales = {}
    if spec.act_scheme == "static_tensor":
        a13, a2 = calibrate_static_scales(unq, SILU, x, topk)
        scales = dict(a13_scale=a13, a2_scale=a2)
    q = quantize_experts(unq, spec, **scales)
    got = calibrate_static_scales(q, SILU, x, topk)
    want = calibrate_static_scales(q.dequantized(torch.float32), SILU, x, topk)
    orig = calibrate_static_scales(unq, SILU, x, topk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0], orig[0])  # x is the same: a13 does not depend on the weights
    assert not torch.equal(got[1], orig[1])
    torch.testing.assert_close(got[1], orig[1], rtol=0.25, atol=0)  # int4: ~0.11
    if scales:  # recalibrated scales quantize the weights again
        quantize_experts(unq, spec, a13_scale=got[0], a2_scale=got[1])


def test_errors():
    w = ExpertWeights(torch.randn(3, 8, 16), torch.randn(3, 16, 4))
    x = torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"x must be \[T, H\] with H = 16, got \[5, 8\]"):
        calibrate_static_scales(w, SILU, torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"x must be \[T, H\] with H = 16, got \[80\]"):
        calibrate_static_scales(w, SILU, torch.randn(80))
    with pytest.raises(ValueError, match="float tensor, got torch.int64"):
        calibrate_static_scales(w, SILU, torch.ones(5, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"no tokens \(T = 0\): nothing to calibrate"):
        calibrate_static_scales(w, SILU, torch.randn(0, 16))
    with pytest.raises(ValueError, match=r"topk.ids must be integer \[T, K\] with T = 5"):
        calibrate_static_scales(w, SILU, x, topk_of([[0, 1]] * 4))
    with pytest.raises(ValueError, match=r"topk.ids must be integer \[T, K\].*\[5\]"):
        calibrate_static_scales(w, SILU, x, TopKOutput(torch.ones(5), torch.zeros(5).int()))
    with pytest.raises(ValueError, match=r"topk.ids must be integer.*torch.float32"):
        calibrate_static_scales(w, SILU, x, TopKOutput(torch.ones(5, 2), torch.zeros(5, 2)))


def reference_fp64(w: ExpertWeights, act, x, ids):
    """Independent twin: a float64 loop over experts with a boolean row mask."""
    E = w.num_experts
    a13, a2 = torch.empty(E, dtype=torch.float64), torch.empty(E, dtype=torch.float64)
    for e in range(E):
        rows = torch.ones(x.shape[0], dtype=torch.bool) if ids is None else (ids == e).any(1)
        if not rows.any():
            rows = torch.ones_like(rows)
        xe = x[rows].double()
        h = xe @ w.w13[e].double().T
        if w.b13 is not None:
            h = h + w.b13[e].double()
        a13[e] = max(xe.abs().max().item(), EPS) / 448
        a2[e] = max(activate(h, act).abs().max().item(), EPS) / 448
    return a13, a2


ACTS = [ActivationSpec("silu"), ActivationSpec("gelu", interleaved=True),
        ActivationSpec("swiglu_oai", alpha=1.702, limit=7.0)]  # fmt: skip


@pytest.mark.parametrize("act", ACTS, ids=lambda a: a.name)
@pytest.mark.parametrize("routed", [True, False], ids=["topk", "dense"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_against_float64_loop(act, routed, seed, monkeypatch):
    """E not a power of two, biases, bf16 x, masked and non-local ids, an unreached expert;
    CHUNK_ROWS = 7 so the first GEMM runs in several row blocks with a partial last one."""
    monkeypatch.setattr(calibrate_mod, "CHUNK_ROWS", 7)
    g = torch.Generator().manual_seed(seed)
    E, T, K, H, I = 5, 37, 2, 24, 12
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g) / H**0.5,
                      torch.randn(E, H, I, generator=g),
                      b13=torch.randn(E, 2 * I, generator=g))  # fmt: skip
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    ids = None
    if routed:
        ids = torch.randint(0, E - 1, (T, K), generator=g, dtype=torch.int32)  # E - 1 unreached
        ids[torch.rand(T, K, generator=g) < 0.2] = -1
        ids[3, 0] = E + 2  # another rank's expert
    a13, a2 = calibrate_static_scales(w, act, x, None if ids is None else TopKOutput(
        torch.ones(T, K), ids))  # fmt: skip
    r13, r2 = reference_fp64(w, act, x, ids)
    assert a13.dtype == a2.dtype == torch.float32
    torch.testing.assert_close(a13.double(), r13, rtol=1e-6, atol=0)
    torch.testing.assert_close(a2.double(), r2, rtol=1e-5, atol=0)
    assert len(set(a2.tolist())) == E  # the experts really differ
