"""The layer under torch.compile (`moekit.compiled`): the experts run as one custom op, so the
whole layer traces without a graph break (fullgraph=True), gives the eager outputs at every
batch size (empty batches included), and layers alike share one compiled graph. CPU: dynamo +
aot_eager (the graph and its fake-tensor shapes, no Inductor); GPU: Inductor, and CUDA graphs
through mode="reduce-overhead"."""

import math

import pytest
import torch

from moekit import MoE, MoEConfig, RunnerConfig, envs, fused_moe
from moekit.layer import run_experts
from moekit.router import count_experts
from moekit.runners.torch import moe_reference_fp64
from moekit.stages import MaskedDispatchOutput
from tests.helpers import DEVICE, TOLERANCE, rel_err

BACKEND = "inductor" if DEVICE == "cuda" else "aot_eager"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# the runners the CPU tests trace through (triton under the interpreter)
RUNNERS = ["torch", "triton", "auto"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer(runner: str, weight_format: str | None = None, **cfg) -> MoE:
    base = dict(num_experts=8, top_k=2, hidden_size=128, intermediate_size=64,
                dtype=str(DTYPE).removeprefix("torch."))  # fmt: skip
    return MoE(MoEConfig(**{**base, **cfg}), runner=RunnerConfig(runner), device=DEVICE,
               weight_format=weight_format).eval()  # fmt: skip


def inputs(m: MoE, T: int):
    x = torch.randn(T, m.config.hidden_size, device=DEVICE, dtype=DTYPE)
    return x, torch.randn(T, m.config.num_experts, device=DEVICE)


@pytest.mark.parametrize("runner", RUNNERS)
def test_layer_compiles_whole_and_matches_eager(runner):
    cfg = dict(activation="swiglu_oai", has_bias=True, interleaved=True)
    m = layer(runner, **cfg)
    compiled = torch.compile(m, fullgraph=True, backend=BACKEND)
    for T in (5, 1, 0, 17, 9):  # a static first graph, then the dynamic one, 0 and 1 specialised
        x, logits = inputs(m, T)
        with torch.no_grad():
            ref, out = m(x, logits), compiled(x, logits)
        assert out.shape == (T, m.config.hidden_size) and out.dtype == DTYPE
        assert rel_err(out, ref) < TOLERANCE[DTYPE], T


def _counting(graphs: list):
    """A torch.compile backend that runs each graph eagerly and keeps it in `graphs`."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_dynamic_shapes_trace_one_graph():
    """torch.compile(dynamic=True): the activation's float fields (traced as symbols) reach the
    experts op as float arguments, not in its constant context, and a masked dispatch's
    expected_rows computed from the symbolic batch size stays a symbol: one graph serves every
    batch size. `fused_moe` with the floats as arguments of the compiled function: one graph
    per alpha (the op's float argument specialises)."""
    m = layer("torch", activation="swiglu_oai", interleaved=True)
    graphs: list = []
    compiled = torch.compile(m, fullgraph=True, backend=_counting(graphs), dynamic=True)
    for T in (3, 5, 9):
        x, logits = inputs(m, T)
        with torch.no_grad():
            assert rel_err(compiled(x, logits), m(x, logits)) < TOLERANCE[DTYPE], T
    assert len(graphs) == 1
    weights, act, E, H = m.expert_weights, m.act, 8, m.config.hidden_size

    def step(x, counts):
        hint = math.ceil(x.shape[1] * 2.5 / E)
        d = MaskedDispatchOutput(x, counts, expected_rows=hint)
        return run_experts(d, weights, act, m.runners).out

    masked: list = []
    compiled = torch.compile(step, fullgraph=True, backend=_counting(masked), dynamic=True)
    for C in (4, 6, 9):
        counts = torch.randint(0, C + 1, (E,), dtype=torch.int32, device=DEVICE)
        x = torch.randn(E, C, H, device=DEVICE, dtype=DTYPE)
        valid = torch.arange(C, device=DEVICE)[None, :] < counts[:, None]
        assert rel_err(compiled(x, counts)[valid], step(x, counts)[valid]) < TOLERANCE[DTYPE]
    assert len(masked) == 1

    def functional(x, w, ids, alpha):
        return fused_moe(x, weights.w13, weights.w2, w, ids, activation="swiglu_oai",
                         interleaved=True, swiglu_alpha=alpha, moe_runner_backend="torch")

    calls: list = []
    compiled = torch.compile(functional, fullgraph=True, backend=_counting(calls), dynamic=True)
    for T, alpha in ((3, 1.702), (5, 1.702), (9, 1.5)):
        x = torch.randn(T, H, device=DEVICE, dtype=DTYPE)
        ids = torch.rand(T, E, device=DEVICE).argsort(1)[:, :2].to(torch.int32)
        w = torch.rand(T, 2, device=DEVICE)
        want = functional(x, w, ids, alpha)  # eager first: it makes the backend's runners
        got = compiled(x, w, ids, alpha)
        assert rel_err(got, want) < TOLERANCE[DTYPE], (T, alpha)
    assert len(calls) == 2


ROUTINGS = {
    "deepseek": dict(num_experts=16, top_k=4, scoring_func="sigmoid", num_expert_group=4,
                     topk_group=2, use_correction_bias=True, routed_scaling_factor=2.5,
                     num_shared_experts=1),
    "softmax": dict(num_experts=16, top_k=4, renormalize=False),
}  # fmt: skip


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_fused_routing_compiles_as_one_op(monkeypatch, routing):
    """A layer that routes with the fused kernel (on CUDA by default; on the CPU under the
    interpreter when asked) keeps it compiled, as the op `moekit::route`, in one dynamic graph
    without a break, and gives the eager outputs (empty batch included)."""
    monkeypatch.setenv(envs.MOEKIT_FUSED_ROUTER.name, "auto" if DEVICE == "cuda" else "1")
    m = layer("torch", **ROUTINGS[routing])
    if m.correction_bias is not None:
        m.correction_bias.copy_(torch.randn(16, device=DEVICE) * 0.1)
    rec = m.record_expert_load()  # counted inside the op, compiled or not
    want = torch.zeros_like(rec.counts)
    graphs: list = []
    compiled = torch.compile(m, fullgraph=True, backend=_counting(graphs), dynamic=True)
    for T in (3, 5, 0, 9):
        x, logits = inputs(m, T)
        with torch.no_grad():
            out, ref = compiled(x, logits), m(x, logits)
        assert out.shape == ref.shape and rel_err(out, ref) < TOLERANCE[DTYPE], T
        count_experts(m.route(logits).ids.repeat(2, 1), want)  # the compiled and eager calls
    assert len(graphs) == 2  # T = 0 specialises
    assert all("moekit.route" in gm.code and "topk" not in gm.code for gm in graphs)
    assert all("index_add" not in gm.code for gm in graphs)
    assert torch.equal(rec.counts, want)


@pytest.mark.parametrize("fmt", ["fp8_w8a8", "int4_w4a16", "mxfp4"])
def test_quantized_layer_compiles(fmt):
    """The spec travels into the op by value (its fields), the scales in the tensor list."""
    m = layer("torch", fmt, intermediate_size=128)
    compiled = torch.compile(m, fullgraph=True, backend=BACKEND)
    x, logits = inputs(m, 6)
    with torch.no_grad():
        assert rel_err(compiled(x, logits), m(x, logits)) < TOLERANCE[DTYPE]


def test_layers_alike_share_one_graph():
    """The op's context holds values, not the layer's objects: a second layer of the same
    config runs the first one's compiled graph (no recompile) and its own weights."""
    a, b = layer("torch"), layer("torch")
    step = torch.compile(lambda m, x, lg: m(x, lg), fullgraph=True, backend=BACKEND)
    for T in (4, 7):  # the second size compiles the dynamic graph
        with torch.no_grad():
            step(a, *inputs(a, T))
    x, logits = inputs(b, 5)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        out = step(b, x, logits)
    assert rel_err(out, b(x, logits)) < TOLERANCE[DTYPE]


def test_fused_moe_functional_compiles():
    E, K, H, I, T = 6, 2, 64, 32, 9
    w13 = torch.randn(E, 2 * I, H, device=DEVICE, dtype=DTYPE) / H**0.5
    w2 = torch.randn(E, H, I, device=DEVICE, dtype=DTYPE) / I**0.5
    step = torch.compile(
        lambda x, w, ids: fused_moe(x, w13, w2, w, ids, moe_runner_backend="auto"),
        fullgraph=True, backend=BACKEND,
    )  # fmt: skip
    x = torch.randn(T, H, device=DEVICE, dtype=DTYPE)
    ids = torch.rand(T, E, device=DEVICE).argsort(1)[:, :K].to(torch.int32)
    w = torch.rand(T, K, device=DEVICE)
    ref = fused_moe(x, w13, w2, w, ids, moe_runner_backend="torch")
    assert rel_err(step(x, w, ids), ref) < TOLERANCE[DTYPE]


@pytest.mark.parametrize("hint", [None, 2])
def test_masked_format_compiles(hint):
    """hint: the dispatcher's expected rows per expert, a constant of the graph."""
    m = layer("torch")
    weights, act = m.expert_weights, m.act
    E, C, H = 8, 4, m.config.hidden_size
    counts = torch.tensor([0, 4, 2, 1, 0, 3, 4, 2], dtype=torch.int32, device=DEVICE)
    x = torch.randn(E, C, H, device=DEVICE, dtype=DTYPE)

    def step(x, counts):
        d = MaskedDispatchOutput(x, counts, expected_rows=hint)
        return run_experts(d, weights, act, m.runners).out

    out = torch.compile(step, fullgraph=True, backend=BACKEND)(x, counts)
    ref = step(x, counts)
    valid = torch.arange(C, device=DEVICE)[None, :] < counts[:, None]
    assert rel_err(out[valid], ref[valid]) < TOLERANCE[DTYPE]


def test_compiled_layer_reads_the_current_weights():
    """Weights are graph inputs: an in-place update is seen by the next compiled call."""
    m = layer("torch")
    compiled = torch.compile(m, fullgraph=True, backend=BACKEND)
    x, logits = inputs(m, 3)
    with torch.no_grad():
        compiled(x, logits)
        m.w2.mul_(-1.0)
        out = compiled(x, logits)
    ref = moe_reference_fp64(x, m.route(logits), m.expert_weights, m.act)
    assert rel_err(out, ref) < TOLERANCE[DTYPE]


@pytest.mark.gpu
@pytest.mark.parametrize("runner", ["triton", "auto"])
def test_reduce_overhead_graphs_match_eager_gpu(runner):
    """mode='reduce-overhead': Inductor plus CUDA graphs recorded per batch size, the experts'
    kernels inside them; each size replayed with fresh inputs."""
    m = layer(runner, num_experts=16, top_k=4, hidden_size=512, intermediate_size=256)
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for T in (1, 16, 64, 1, 16):
        for _ in range(3):  # warm-up, record, replay
            x, logits = inputs(m, T)
            with torch.no_grad():
                out = compiled(x, logits).clone()
                ref = m(x, logits)
            assert rel_err(out, ref) < TOLERANCE[DTYPE], T
