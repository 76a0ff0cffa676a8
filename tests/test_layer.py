"""The MoE layer and fused_moe against the float64 reference, for every available runner."""

from dataclasses import dataclass

import pytest
import torch

from moekit import MoE, MoEConfig, ParallelConfig, RunnerConfig, fused_moe
from moekit.config import ConfigError
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import detect
from moekit.layer import RunnerCache, run_experts
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.base import Runner, RunnerCaps
from moekit.runners.torch import TorchRunner, moe_reference_fp64
from moekit.select import Workload, why_not
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput
from tests import helpers
from tests.helpers import TOLERANCE, capture_graph, rel_err


@dataclass(frozen=True)
class Case:
    name: str
    E: int = 8
    K: int = 2
    H: int = 32
    I: int = 16
    activation: str = "silu"
    bias: bool = False
    interleaved: bool = False
    routing: str = "random"  # random | one_expert | masked


CASES = [
    Case("silu"),
    Case("gelu-bias", activation="gelu", bias=True),
    Case("swiglu_oai-bias-interleaved", activation="swiglu_oai", bias=True, interleaved=True),
    Case("swiglu_oai-nobias", activation="swiglu_oai"),
    Case("silu-interleaved", interleaved=True),
    Case("odd-sizes", E=7, K=3, H=24, I=10),
    Case("one-expert", routing="one_expert"),
    Case("masked-ids", E=6, K=3, routing="masked"),
]


def runners_for(device: str, dtype: torch.dtype) -> list[str]:
    """Registered runners that can run the plain case here."""
    work = Workload(1, dtype=str(dtype).removeprefix("torch."), device=device)
    return [n for n in registry.registered() if why_not(n, work, detect()) is None]


def make_topk(case: Case, T: int, device) -> TopKOutput:
    ids = torch.rand(T, case.E, device=device).argsort(dim=1)[:, : case.K]
    if case.routing == "one_expert":
        ids[:, 0] = 3
        ids[:, 1:] = -1
    if case.routing == "masked":
        ids[torch.rand(ids.shape, device=device) < 0.4] = -1
    weights = torch.rand(T, case.K, device=device)
    return TopKOutput(weights, ids.to(torch.int32))


def build(case: Case, runner: str, dtype: torch.dtype, device) -> MoE:
    cfg = MoEConfig(
        num_experts=case.E, top_k=case.K, hidden_size=case.H, intermediate_size=case.I,
        activation=case.activation, has_bias=case.bias, interleaved=case.interleaved,
        dtype=str(dtype).removeprefix("torch."),
    )
    return MoE(cfg, runner=RunnerConfig(moe_runner_backend=runner), device=device)


def check_layer(case: Case, runner: str, T: int, dtype: torch.dtype, device: str):
    work = Workload(T, activation=case.activation, dtype=str(dtype).removeprefix("torch."),
                    device=device, has_bias=case.bias, num_experts=case.E, hidden_size=case.H,
                    intermediate_size=case.I, top_k=case.K)
    problem = why_not(runner, work, detect())
    if problem is not None:  # selecting it raises ConfigError with this reason (test_select)
        pytest.skip(f"{runner} does not take this case: {problem}")
    layer = build(case, runner, dtype, device)
    x = torch.randn(T, case.H, device=device, dtype=dtype)
    topk = make_topk(case, T, device)
    out = layer.forward_topk(x, topk)
    assert out.shape == (T, case.H) and out.dtype == dtype
    ref = moe_reference_fp64(x, topk, layer.expert_weights, layer.act)
    assert rel_err(out, ref) < TOLERANCE[dtype], (case, runner, T)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("T", [0, 1, 7, 64])
@pytest.mark.parametrize("runner", runners_for("cpu", torch.float32))
def test_layer_matches_fp64_reference_cpu(case, T, runner):
    check_layer(case, runner, T, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("T", [0, 1, 7, 64, 300])
@pytest.mark.parametrize("runner", runners_for("cuda", torch.bfloat16) if torch.cuda.is_available() else ["torch"])
def test_layer_matches_fp64_reference_gpu_bf16(case, T, runner):
    check_layer(case, runner, T, torch.bfloat16, "cuda")


def test_forward_routes_and_keeps_leading_dims():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    layer = MoE(cfg)
    x, logits = torch.randn(2, 3, 16), torch.randn(2, 3, 8)
    out = layer(x, logits)
    assert out.shape == (2, 3, 16)
    flat = layer.forward_topk(x.reshape(6, 16), layer.route(logits.reshape(6, 8)))
    assert torch.equal(out.reshape(6, 16), flat)
    empty = layer(torch.randn(0, 16), torch.randn(0, 8))
    assert empty.shape == (0, 16)


def test_shared_expert_is_fused_as_a_routed_column():
    cfg = MoEConfig(num_experts=6, top_k=2, hidden_size=16, intermediate_size=8,
                    num_shared_experts=1, dtype="float32")
    layer = MoE(cfg)
    assert layer.w13.shape[0] == 7
    x, logits = torch.randn(5, 16), torch.randn(5, 6)
    topk = layer.route(logits)
    routed = TopKOutput(topk.weights[:, :2].contiguous(), topk.ids[:, :2].contiguous())
    shared = TopKOutput(torch.ones(5, 1), torch.full((5, 1), 6, dtype=torch.int32))
    expected = layer.forward_topk(x, routed) + layer.forward_topk(x, shared)
    assert rel_err(layer(x, logits), expected) < 1e-6


def test_redundant_expert_slots_compute_the_same_function():
    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, dtype="float32")
    layer = MoE(cfg, ParallelConfig(ep_num_redundant_experts=2))
    assert layer.w13.shape[0] == 6 and layer.local_experts.tolist() == [0, 1, 2, 3, 0, 1]
    x, logits = torch.randn(9, 16), torch.randn(9, 4)
    topk = layer.route(logits)
    ref = moe_reference_fp64(x, topk, layer.expert_weights, layer.act)
    assert rel_err(layer(x, logits), ref) < 1e-5


def test_masked_format_through_torch_runner():
    layer = build(Case("m"), "torch", torch.float32, "cpu")
    E, C, H = 8, 5, 32
    x = torch.randn(E, C, H)
    counts = torch.tensor([0, 5, 2, 1, 0, 3, 5, 4], dtype=torch.int32)
    runner = registry.runner_class("torch")()
    out = runner.run(MaskedDispatchOutput(x, counts), layer.expert_weights, layer.act).out
    for e in range(E):
        for c in range(C):
            ids = torch.tensor([[e]], dtype=torch.int32)
            ref = moe_reference_fp64(x[e, c : c + 1], TopKOutput(torch.ones(1, 1), ids),
                                     layer.expert_weights, layer.act)
            if c < counts[e]:
                assert rel_err(out[e, c : c + 1], ref) < 1e-5
            else:
                assert torch.all(out[e, c] == 0)


def test_fused_moe_functional_matches_reference():
    E, K, H, I, T = 5, 2, 24, 12, 11
    w13, w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    b13, b2 = torch.randn(E, 2 * I) * 0.1, torch.randn(E, H) * 0.1
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    out = fused_moe(x, w13, w2, weights, ids, b13=b13, b2=b2, activation="swiglu_oai",
                    interleaved=True, moe_runner_backend="torch")
    from moekit.experts import ActivationSpec, ExpertWeights
    ref = moe_reference_fp64(x, TopKOutput(weights, ids.int()), ExpertWeights(w13, w2, b13, b2),
                             ActivationSpec("swiglu_oai", True))
    assert rel_err(out, ref) < 1e-5


def test_unavailable_runner_fails_at_selection_with_reason():
    layer = build(Case("x"), "flashinfer_trtllm", torch.float32, "cpu")
    with pytest.raises(ConfigError, match="flashinfer_trtllm"):
        layer.forward_topk(torch.randn(2, 32), make_topk(Case("x"), 2, "cpu"))


def test_bad_weight_shapes_are_refused():
    from moekit.experts import ExpertWeights
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\]"):
        ExpertWeights(torch.randn(4, 16, 8), torch.randn(4, 8, 9))
    with pytest.raises(ValueError, match=r"b13 must be \[E, 2I\]"):
        ExpertWeights(torch.randn(4, 16, 8), torch.randn(4, 8, 8), b13=torch.randn(4, 8))


@pytest.mark.parametrize("x_shape, logits_shape", [
    ((3, 31), (3, 8)),  # hidden size
    ((3, 32), (3, 7)),  # experts
    ((3, 32), (2, 8)),  # tokens
    ((1, 3, 32), (3, 8)),  # leading shape
])
def test_layer_inputs_that_do_not_fit_are_refused_by_name(x_shape, logits_shape):
    layer = build(Case("x"), "torch", torch.float32, "cpu")
    assert layer(torch.randn(1, 3, 32), torch.randn(1, 3, 8)).shape == (1, 3, 32)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., H\] with H = 32 .* E = 8"):
        layer(torch.randn(x_shape), torch.randn(logits_shape))
    with pytest.raises(ValueError, match="x is float64 but the expert weights are float32"):
        layer(torch.randn(3, 32, dtype=torch.float64), torch.randn(3, 8))


def test_quantized_layer_refuses_activation_scales_that_are_not_positive():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    static = dict(weight_scale="tensor", activation_scheme="static_tensor")
    for scale in (0.0, -1.0, float("nan"), "1"):
        layer = MoE(cfg)
        with pytest.raises(ValueError, match="a13_scale"):
            layer.quantize_weights_("fp8_w8a8", a13_scale=scale, a2_scale=1.0, **static)
    MoE(cfg).quantize_weights_("fp8_w8a8", a13_scale=0.5, a2_scale=1.0, **static)


def test_expert_shapes_and_activation_parameters_are_checked():
    odd = r"w13 must be \[E, 2I, H\] \(gate and up rows\), got \[4, 17, 8\]"
    with pytest.raises(ValueError, match=odd):
        ExpertWeights(torch.randn(4, 17, 8), torch.randn(4, 8, 8))
    with pytest.raises(ConfigError, match="--swiglu-limit must be > 0, got -1"):
        ActivationSpec("swiglu_oai", limit=-1)


def test_layer_refuses_a_rank_or_placement_its_configs_do_not_give():
    from moekit.placement import ExpertPlacement

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
    two = ParallelConfig(tp_size=2, ep_size=2)
    for rank in (-1, 2, 1.0):
        with pytest.raises(ConfigError, match=r"tp_rank must be an integer in \[0, --tp-size = 2"):
            MoE(cfg, two, tp_rank=rank)
    for placement, needle in [
        (ExpertPlacement.contiguous(8, 2), "8 slots over 2 ranks; the configs give 8 .* --ep-size"),
        (ExpertPlacement.contiguous(8, 1, 10), "10 slots over 1 ranks; the configs give 8"),
        (ExpertPlacement(torch.tensor([0, 1, 2, 3, 4, 5, 6, 6])), r"no slot for .* \[7\]"),
    ]:
        with pytest.raises(ValueError, match=needle):
            MoE(cfg, placement=placement)
    assert MoE(cfg, two, tp_rank=1).local_experts.tolist() == [4, 5, 6, 7]


def test_fused_moe_inputs_that_do_not_fit_are_refused_by_name():
    E, H, I, T, K = 4, 16, 8, 5, 2
    x = torch.randn(T, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    w, ids = torch.rand(T, K), torch.randint(0, E, (T, K))

    def run(**kw):
        args = dict(x_TH=x, w13=w13, w2=w2, topk_weights=w, topk_ids=ids)
        args.update(kw)
        return fused_moe(**args, moe_runner_backend="torch")

    assert run().shape == (T, H)
    # ids outside [0, E) add nothing (an EP rank's experts elsewhere), as documented
    torch.testing.assert_close(run(topk_ids=torch.full((T, K), E)), torch.zeros(T, H))
    cases = [
        (dict(topk_ids=ids.float()), r"topk_ids must be an integer tensor .* float32"),
        (dict(topk_weights=torch.ones(T, K, dtype=torch.int64)), "topk_weights must be float32"),
        (dict(topk_weights=w[:, :1]), r"both be \[T, K\] with T = 5 .* \[5, 2\] and \[5, 1\]"),
        (dict(topk_weights=w[:4], topk_ids=ids[:4]), r"T = 5 \(x's rows\), got \[4, 2\]"),
        (dict(topk_weights=w[:, 0], topk_ids=ids[:, 0]), r"both be \[T, K\]"),
        (dict(x_TH=x[:, :15]), r"x must be \[T, H\] with H = 16 .* got \[5, 15\]"),
        (dict(x_TH=x.bfloat16()), "x is bfloat16 but the expert weights are float32"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            run(**kw)
    with pytest.raises(ConfigError, match="--activation: unknown value 'tanh'; allowed: gelu"):
        fused_moe(x, w13, w2, w, ids, activation="tanh")
    counts = torch.zeros(E, dtype=torch.int32)
    torch_runner = RunnerCache(RunnerConfig(moe_runner_backend="torch"))
    for mx, mc, message in [
        (torch.randn(E, 3, H - 1), counts, r"masked x must be \[E, C, H\] with E = 4, H = 16, got"),
        (torch.randn(E - 1, 3, H), counts[1:], r"with E = 4, H = 16, got \[3, 3, 16\]"),
        (torch.randn(E, 3, H), counts[1:], r"masked counts must be an integer tensor \[E\] = \[4"),
        (torch.randn(E, 3, H), counts.float(), r"counts .* got float32 \[4\]"),
        (torch.randn(E, 3, H), [0] * E, r"counts .* got list"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            run_experts(MaskedDispatchOutput(mx, mc), ExpertWeights(w13, w2), ActivationSpec(),
                        torch_runner)  # fmt: skip
    with pytest.raises(ValueError, match="topk_weights must be float32 .* got float64"):
        run_experts(StandardDispatchOutput(x, TopKOutput(w.double(), ids)), ExpertWeights(w13, w2),
                    ActivationSpec(), torch_runner)  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU run: the Triton runners under the interpreter")
def test_ep_rank_looks_up_kernel_configs_for_its_local_tokens(monkeypatch):
    """An EP rank that sees every token gets about 1 / ep of the pairs: the dispatcher says so
    (local_share) and the triton runner looks its tables up for T * local_share tokens
    (triton_kernel, whose tables are for large all-local batches, for T)."""
    pytest.importorskip("triton")
    from moekit.runners.triton import ops
    from moekit.runners.triton_kernel import ops as tk_ops

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16,
                    dtype="float32")  # fmt: skip
    T = 12
    x = torch.randn(T, 32)
    topk = TopKOutput(torch.rand(T, 2), torch.rand(T, 8).argsort(dim=1)[:, :2].int())
    seen = []
    for name, mod, fn in (("triton", ops, "configs_for"), ("triton_kernel", tk_ops, "config_for")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda n, *a, _real=real, **k: seen.append(n) or _real(n, *a, **k))
        module = MoE(cfg, ParallelConfig(tp_size=4, ep_size=4), tp_rank=0,
                     runner=RunnerConfig(name))  # fmt: skip
        d = module.dispatcher.dispatch(x, topk)
        assert d.local_share == 0.25
        out = module.forward_topk(x, topk)
        ref = moe_reference_fp64(x, d.topk, module.expert_weights, module.act)
        assert rel_err(out, ref) < TOLERANCE[torch.float32]
    assert seen == [T * 0.25, T]
    one = MoE(cfg, ParallelConfig(), runner=RunnerConfig("triton"))
    assert one.dispatcher.dispatch(x, topk).local_share == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("runner,fmt", [("triton", "unquantized"), ("triton", "fp8_w8a8"),
                                        ("w4a16", "mxfp4")])  # fmt: skip
def test_ep_decode_graph_replays_use_each_calls_ids_gpu(runner, fmt):
    """An EP rank at a decode batch (the dispatcher's local-id kernel, then the runner's
    kernels, which chain as programmatic dependent launches on sm_90+), captured in a CUDA graph
    and replayed over new routings: every call computes with its own local ids."""
    cfg = MoEConfig(num_experts=32, top_k=4, hidden_size=256, intermediate_size=512,
                    dtype="bfloat16", weight_format=fmt)  # fmt: skip
    T, dev = 4, "cuda"
    work = Workload(T, weight_format=fmt, num_experts=8, hidden_size=256, intermediate_size=512,
                    top_k=4, device=dev)  # fmt: skip
    problem = why_not(runner, work, detect())
    if problem is not None:
        pytest.skip(f"{runner}: {problem}")
    module = MoE(cfg, ParallelConfig(tp_size=4, ep_size=4), tp_rank=0,
                 runner=RunnerConfig(runner), device=dev)  # fmt: skip

    def routing():
        ids = torch.rand(T, 32, device=dev).argsort(dim=1)[:, :4].to(torch.int32)
        return torch.randn(T, 256, device=dev, dtype=torch.bfloat16), TopKOutput(
            torch.rand(T, 4, device=dev), ids)

    x, topk = routing()
    with torch.no_grad():
        graph, out = capture_graph(lambda: module.forward_topk(x, topk))
        for _ in range(6):
            x2, topk2 = routing()
            x.copy_(x2), topk.weights.copy_(topk2.weights), topk.ids.copy_(topk2.ids)
            graph.replay()
            d = module.dispatcher.dispatch(x2, topk2)
            ref = TorchRunner().run(StandardDispatchOutput(x2, d.topk), module.expert_weights,
                                    module.act).out  # fmt: skip
            assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], (runner, fmt)


def test_runner_run_passes_the_local_share_to_run_standard():
    """`Runner.run` hands the dispatcher's local share to `run_standard` (the `deep_gemm` and
    `w4a16` runners size their launches by it)."""

    class Recorder(Runner):
        name = "recorder"
        caps = RunnerCaps(formats=frozenset({"standard"}),
                          weight_formats=frozenset({"unquantized"}),
                          activations=frozenset({"silu"}), devices=frozenset({"cpu"}))  # fmt: skip
        shares: list = []

        def run_standard(self, x, topk, weights, act, local_share=1.0):
            self.shares.append(local_share)
            return x

    w = helpers.make_weights(4, 8, 16, torch.float32, False, device="cpu")
    x, topk = torch.randn(3, 8), helpers.make_topk(3, 2, 4, device="cpu")
    out = Recorder().run(StandardDispatchOutput(x, topk, local_share=0.25), w, ActivationSpec())
    assert torch.equal(out.out, x) and Recorder.shares == [0.25]


def test_repr_says_shape_format_backend_and_share():
    config = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                       dtype="float32")  # fmt: skip
    text = repr(MoE(config, ParallelConfig(tp_size=2, ep_size=2), tp_rank=1,
                    weight_format="int8_w8a16", init_weights=False))  # fmt: skip
    for part in ("num_experts=8", "top_k=2", "hidden_size=64", "intermediate_size=32",
                 "dtype=float32", "weights=int8_w8a16", "(not loaded)", "backend=auto",
                 "tp_size=2", "ep_size=2", "tp_rank=1", "local_experts=4"):  # fmt: skip
        assert part in text, (part, text)
    assert "not loaded" not in repr(MoE(config))
