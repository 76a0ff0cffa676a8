"""The fused routing kernel (`select_experts_fused`) against its twin `select_experts` (which
test_router checks against a per-token reference); on the CPU under the Triton interpreter
(float32 / float16 logits), bf16 and CUDA-graph capture on the GPU."""

import pytest
import torch

pytest.importorskip("triton")

from test_router import CASES, routing_kwargs  # noqa: E402

from moekit import MoE, envs  # noqa: E402
from moekit.config import ConfigError, MoEConfig  # noqa: E402
from moekit.router import (  # noqa: E402
    FUSED_MAX_EXPERTS,
    count_experts,
    explain_routing,
    fused_mode,
    fused_problem,
    route,
    select_experts,
    select_experts_fused,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# the shapes of the presets' routing, beside test_router's small cases
PRESET_CASES = [
    dict(E=128, K=8, scoring="softmax", renorm=True),  # qwen3-30b-a3b
    dict(E=8, K=2, scoring="softmax", renorm=True),  # mixtral-8x7b
    dict(E=256, K=8, scoring="sigmoid", renorm=True, groups=8, topk_group=4, bias=True,
         scale=2.5),  # deepseek-v3  # fmt: skip
    dict(E=384, K=8, scoring="sigmoid", renorm=True, bias=True, scale=2.827),  # kimi-k2
    dict(E=128, K=4, scoring="softmax", renorm=True),  # gpt-oss-120b
    dict(E=60, K=4, scoring="softmax", renorm=False, shared=2),
]


def _separated_logits(T, E, K, dtype, gap=1e-3):
    """Fresh random logits whose K-th and (K+1)-th largest differ by more than `gap` in every
    row (so that the choice has no near-tie for rounding to flip): the rows that do not are
    drawn again (bf16 rounds about one row in five of 384 experts to such a tie)."""
    logits = torch.randn(T, E, device=DEVICE).to(dtype)
    for _ in range(100):
        if K >= E or T == 0:
            return logits
        top = logits.float().topk(K + 1, dim=-1).values
        tied = (top[:, K - 1] - top[:, K]) <= gap
        if not bool(tied.any()):
            return logits
        logits[tied] = torch.randn(int(tied.sum()), E, device=DEVICE).to(dtype)
    raise AssertionError(f"no separated logits drawn for T={T}, E={E}, K={K}, {dtype}")


@pytest.mark.parametrize("case", CASES + PRESET_CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))  # fmt: skip
@pytest.mark.parametrize("T", [0, 1, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_router_matches_twin(case, T, dtype):
    E, K = case["E"], case["K"]
    bias = torch.randn(E, device=DEVICE) * 0.1 if case.get("bias") else None
    logits = _separated_logits(T, E, K, dtype)
    ref = select_experts(logits, K, **routing_kwargs(case, bias))
    out = select_experts_fused(logits, K, **routing_kwargs(case, bias))
    assert out.weights.dtype == torch.float32 and out.ids.dtype == torch.int32
    assert out.ids.shape == ref.ids.shape == (T, K + case.get("shared", 0))
    # the same experts per token (in any order) with the same weights; a bias or the groups
    # can leave a near-tie the logits' separation does not rule out: one token of 37 at most
    got_ids, order = out.ids.sort(dim=-1)
    ref_ids, ref_order = ref.ids.sort(dim=-1)
    same = (got_ids == ref_ids).all(dim=-1)
    assert int((~same).sum()) <= (1 if (case.get("bias") or case.get("groups")) else 0)
    torch.testing.assert_close(out.weights.gather(1, order)[same],
                               ref.weights.gather(1, ref_order)[same], rtol=1e-5, atol=1e-6)


def _set_route_kernel(monkeypatch, **fields):
    """The routing kernel launched with these `RouteKernelConfig` fields for the test."""
    from dataclasses import replace

    import moekit.router as router

    monkeypatch.setattr(router, "ROUTE_KERNEL", replace(router.ROUTE_KERNEL, **fields))


@pytest.mark.parametrize("variant", [dict(group_tile=False, num_warps=4), dict(num_warps=1),
                                     dict(num_warps=2, group_tile=False)], ids=str)
@pytest.mark.parametrize("case", CASES + PRESET_CASES + [
    dict(E=32, K=4, scoring="softmax", renorm=False, groups=4, topk_group=2),  # no bias: best
    dict(E=64, K=6, scoring="sigmoid", renorm=True, groups=2, topk_group=1, bias=True),
    dict(E=8, K=2, scoring="sigmoid", renorm=True, groups=8, topk_group=4, bias=True),  # 1 a group
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))  # fmt: skip
def test_route_kernel_variants_route_the_same(case, variant, monkeypatch):
    """`RouteKernelConfig`'s alternatives (warps a program, the groups scored in a pass over the
    row each instead of from a [tokens, G, E / G] view) pick the same experts as the default
    kernel, in the same order, on fresh logits with ties left in (the same ties broken the
    same way)."""
    E, K = case["E"], case["K"]
    bias = torch.randn(E, device=DEVICE) * 0.1 if case.get("bias") else None
    logits = torch.randn(37, E, device=DEVICE).to(torch.float16)
    ref = select_experts_fused(logits, K, **routing_kwargs(case, bias))
    _set_route_kernel(monkeypatch, **variant)
    out = select_experts_fused(logits, K, **routing_kwargs(case, bias))
    assert torch.equal(out.ids, ref.ids)
    torch.testing.assert_close(out.weights, ref.weights, rtol=1e-6, atol=1e-7)


def test_fused_router_strided_logits_and_one_expert_every_token():
    logits = torch.randn(9, 2 * 16, device=DEVICE)[:, ::2]  # a column stride of 2
    logits[:, 5] = 50.0  # every token's first choice
    out = select_experts_fused(logits, 3)
    ref = select_experts(logits, 3)
    assert (out.ids[:, 0] == 5).all() and (ref.ids[:, 0] == 5).all()
    assert torch.equal(out.ids.sort(-1).values, ref.ids.sort(-1).values)
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(9, device=DEVICE))


def test_layer_routes_with_the_fused_kernel_when_asked(monkeypatch):
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8,
                    scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                    use_correction_bias=True, routed_scaling_factor=2.0, num_shared_experts=1)
    logits = _separated_logits(11, 16, 4, torch.float32)
    bias = torch.zeros(16, device=DEVICE)
    calls = []
    import moekit.router as router

    real = router._select_fused
    monkeypatch.setattr(router, "_select_fused", lambda *a: calls.append(1) or real(*a))
    layers = {}
    for flag in ("0", "1", "auto"):  # the layer reads the variable once, when it is built
        monkeypatch.setenv(envs.MOEKIT_FUSED_ROUTER.name, flag)
        layers[flag] = MoE(cfg, device=DEVICE, init_weights=False)
        layers[flag].correction_bias.copy_(bias)
    monkeypatch.setenv(envs.MOEKIT_FUSED_ROUTER.name, "0")
    plain = layers["0"].route(logits)
    assert not calls
    layers["auto"].route(logits)  # auto: the kernel for CUDA logits only
    assert calls == ([1] if DEVICE == "cuda" else [])
    calls.clear()
    fused = layers["1"].route(logits)
    assert calls == [1]
    assert torch.equal(fused.ids.sort(-1).values, plain.ids.sort(-1).values)
    assert (fused.ids[:, 4] == 16).all() and (fused.weights[:, 4] == 1.0).all()
    # a custom routing function runs as it is, fused router or not
    out = route(logits, cfg, bias, fused="on", custom_routing_function=lambda lg, k, r: (
        torch.ones(lg.shape[0], k), torch.arange(k).expand(lg.shape[0], k)))  # fmt: skip
    assert calls == [1] and out.ids[:, :4].tolist() == [[0, 1, 2, 3]] * 11


def test_layer_forward_is_the_same_with_either_routing(monkeypatch):
    """The whole layer (DeepSeek-style choice, a fused shared expert) with the fused routing
    against the same layer with the twin's: the same experts, so the same output."""
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=32, intermediate_size=16,
                    scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                    use_correction_bias=True, routed_scaling_factor=2.0, num_shared_experts=1,
                    dtype="float32")  # fmt: skip
    import moekit.router as router

    calls = []
    real = router._select_fused
    monkeypatch.setattr(router, "_select_fused", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv(envs.MOEKIT_FUSED_ROUTER.name, "1")
    layer = MoE(cfg, device=DEVICE)
    layer.correction_bias.copy_(torch.randn(16, device=DEVICE) * 0.1)
    x = torch.randn(2, 5, 32, device=DEVICE)
    logits = _separated_logits(10, 16, 4, torch.float32).view(2, 5, 16)
    fused = layer(x, logits)
    layer.fused_router = "off"
    twin = layer(x, logits)
    assert calls == [1]
    torch.testing.assert_close(fused, twin, rtol=1e-5, atol=1e-5)


def _config(case) -> MoEConfig:
    """The routing of a test case as a layer's config."""
    return MoEConfig(num_experts=case["E"], top_k=case["K"], hidden_size=8, intermediate_size=8,
                     scoring_func=case["scoring"], renormalize=case["renorm"],
                     num_expert_group=case.get("groups"), topk_group=case.get("topk_group"),
                     use_correction_bias=bool(case.get("bias")),
                     routed_scaling_factor=case.get("scale", 1.0),
                     num_shared_experts=case.get("shared", 0))  # fmt: skip


@pytest.mark.parametrize("case", PRESET_CASES, ids=["qwen3", "mixtral", "deepseek", "kimi",
                                                    "gptoss", "shared2"])  # fmt: skip
@pytest.mark.parametrize("T", [0, 1, 37, 300])
@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_fused_router_counts_what_it_routes(case, T, count, monkeypatch):
    """The kernel adds its routed pairs per expert (the shared experts' too) to the load counts
    (several programs at T = 37 / 300 for the wider rows), on top of what they held: what
    count_experts (the twin) adds for the kernel's ids, with an add per pair, per expert a
    program (a sum over its tokens, or a histogram of its ids), or the default's choice; and
    route's twin path counts its own."""
    _set_route_kernel(monkeypatch, count=count)
    cfg = _config(case)
    bias = torch.randn(case["E"], device=DEVICE) * 0.1 if case.get("bias") else None
    logits = torch.randn(T, case["E"], device=DEVICE)
    held = torch.randint(0, 1000, (cfg.total_experts,), device=DEVICE)
    for fused in ("on", "off"):
        counts = held.clone()
        out = route(logits, cfg, bias, fused=fused, counts_N=counts)
        want = held.clone()
        count_experts(out.ids, want)
        assert torch.equal(counts, want), fused
        assert int((counts - held).sum()) == T * (cfg.top_k + cfg.num_shared_experts)


def test_tokens_per_program_keeps_programs_narrow():
    """The rule the H200 and H100 timings chose (sessions 74-76): at most 8 tokens and 2 KiB of
    logits a program, one where a row spans more than a warp's 16-byte loads (512 bytes), at
    least one token, never more than T rounded up."""
    from moekit._triton_host import next_pow2
    from moekit.router import tokens_per_program

    for score_bytes in (2, 4):
        for EP in (8, 128, 256, 512, 1024):
            for T in (1, 2, 3, 16, 4096):
                n = tokens_per_program(T, EP, score_bytes)
                assert 1 <= n <= 8 and n <= next_pow2(T), (T, EP, score_bytes)
                assert n * EP * score_bytes <= 2048 or n == 1, (T, EP, score_bytes)
                assert n == 1 or EP * score_bytes <= 512, (T, EP, score_bytes)
    assert tokens_per_program(16, 256) == 4 and tokens_per_program(16, 512) == 1
    assert tokens_per_program(16, 128) == 8 and tokens_per_program(3, 8) == 4
    assert tokens_per_program(16, 256, 4) == 1 and tokens_per_program(16, 128, 4) == 4


def test_count_mode_adds_per_expert_only_where_it_pays():
    """Per pair for wide rows and for small batches of several tokens a program; per expert for
    one-token programs of at most 128 experts and where counters contend (64+ pairs each)."""
    from moekit.router import count_mode

    assert count_mode(16384, 256, 8, 4) == 1 and count_mode(1, 512, 8, 1) == 1
    assert count_mode(1, 128, 8, 1) == 2 and count_mode(256, 128, 8, 8) == 1
    assert count_mode(1024, 128, 8, 8) == 2 and count_mode(1024, 128, 4, 8) == 1
    assert count_mode(256, 8, 2, 8) == 2 and count_mode(64, 8, 2, 8) == 1


def test_route_kernel_config_names_what_it_allows():
    """A count mode or warp count the kernel has no launch for fails where it is set, naming
    the field and the values it takes."""
    from moekit.router import RouteKernelConfig

    with pytest.raises(ValueError, match=r"count must be 0 .* got 4"):
        RouteKernelConfig(count=4)
    with pytest.raises(ValueError, match=r"num_warps must be 0 .* got 3"):
        RouteKernelConfig(num_warps=3)
    assert RouteKernelConfig(count=3, num_warps=1).count == 3


def test_count_experts_skips_masked_and_foreign_ids():
    counts = torch.zeros(4, dtype=torch.int64)
    count_experts(torch.tensor([[0, -1], [3, 4], [3, 2]], dtype=torch.int32), counts)
    assert counts.tolist() == [1, 0, 1, 2]
    count_experts(torch.zeros(0, 2, dtype=torch.int32), counts)  # an empty batch
    assert counts.tolist() == [1, 0, 1, 2]


def test_layer_counts_its_load_once_a_call_with_either_routing(monkeypatch):
    """forward counts inside the routing (the kernel), forward_topk with count_experts: each
    call adds its pairs once, the fused shared expert's included."""
    cfg = _config(dict(E=16, K=4, scoring="sigmoid", renorm=True, groups=4, topk_group=2,
                       bias=True, scale=2.0, shared=1))  # fmt: skip
    monkeypatch.setenv(envs.MOEKIT_FUSED_ROUTER.name, "1")
    layer = MoE(cfg, device=DEVICE)
    rec = layer.record_expert_load()
    x = torch.randn(11, 8, device=DEVICE, dtype=torch.bfloat16)
    logits = _separated_logits(11, 16, 4, torch.float32)
    layer(x, logits)
    topk = layer.route(logits)  # counts nothing
    want = torch.bincount(topk.ids.flatten().long(), minlength=17)
    assert torch.equal(rec.counts, want) and int(want[16]) == 11
    layer.forward_topk(x, topk)
    assert torch.equal(rec.counts, 2 * want)
    layer.fused_router = "off"
    layer(x, logits)
    assert torch.equal(rec.counts, 3 * want)


def _nonfinite_rows_route_to_valid_experts(dtype):
    """Rows of NaN, +inf and -inf logits (a broken model's) still pick K distinct experts in
    [0, E): ids outside would be read as slots by the dispatch. A single NaN ranks first, as in
    torch.topk; a single +inf logit is a score of 1 (sigmoid), ranked with the bias as the
    twin ranks it."""
    for case in PRESET_CASES[:4] + [dict(E=10, K=3, scoring="sigmoid", renorm=True, bias=True)]:
        E, K = case["E"], case["K"]
        bias = torch.randn(E, device=DEVICE) * 0.1 if case.get("bias") else None
        logits = torch.randn(6, E, device=DEVICE)
        logits[0] = float("nan")
        logits[1, 3] = float("nan")
        logits[2] = float("inf")
        logits[3] = float("-inf")
        logits[4, 2] = float("inf")
        logits[5, ::2] = float("nan")
        out = select_experts_fused(logits.to(dtype), K, **routing_kwargs(case, bias))
        ids = out.ids[:, :K].long()
        assert ((ids >= 0) & (ids < E)).all(), (case, out.ids)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), (case, out.ids)  # distinct
        if case["scoring"] == "sigmoid":  # softmax spreads a NaN over the row
            assert 3 in ids[1].tolist(), (case, out.ids)
            twin = select_experts(logits.to(dtype), K, **routing_kwargs(case, bias))
            assert ids[4].sort().values.tolist() == twin.ids[4].sort().values.tolist()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, interpreting NaN rows
def test_fused_router_nonfinite_logits():
    _nonfinite_rows_route_to_valid_experts(torch.float32)


def test_fused_router_modes():
    assert envs.MOEKIT_FUSED_ROUTER.default == "auto"
    assert [fused_mode(v) for v in ("auto", " AUTO", "1", "true", "on", "0", "no", "off")] == [
        "auto", "auto", "on", "on", "on", "off", "off", "off"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"MOEKIT_FUSED_ROUTER='fast'; allowed: auto .*, 1 / on"):
        fused_mode("fast")
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
    with pytest.raises(ValueError, match="route: fused must be one of auto, on, off, got True"):
        route(torch.randn(3, 8, device=DEVICE), cfg, fused=True)


def test_explain_routing():
    from moekit.hardware import Platform

    gpu = Platform("cuda", "H100", (9, 0), 1, libraries={"triton": "3.6.0"})
    assert explain_routing("auto", gpu, 256).startswith("one Triton kernel (select_experts_fused")
    assert explain_routing("off", gpu, 256) == "PyTorch ops (select_experts): MOEKIT_FUSED_ROUTER=0"
    assert "at most 1024 experts, got 2048" in explain_routing("on", gpu, 2048)
    cpu = Platform("cpu", "cpu", libraries={"triton": "3.6.0"})
    assert "auto takes the kernel for CUDA logits only" in explain_routing("auto", cpu, 8)
    no_triton = Platform("cuda", "H100", (9, 0), 1, libraries={"triton": None})
    assert "the fused kernel needs Triton" in explain_routing("auto", no_triton, 8)
    # with the batch size: how the kernel runs it (deepseek-v3 at T = 16, qwen3 at T = 1)
    assert explain_routing("auto", gpu, 256, 16, 8).endswith(
        "; at T = 16: bf16 logits 4 tokens a program, 4 warps, a recorded load counted per "
        "pair; float32 logits 1 token a program, 1 warp, a recorded load counted per pair")
    assert explain_routing("auto", gpu, 128, 1, 8).endswith(
        "float32 logits 1 token a program, 1 warp, a recorded load counted per expert a program")
    assert "at T =" not in explain_routing("off", gpu, 128, 1, 8)


def test_route_launch_is_what_the_kernel_runs(monkeypatch):
    """The launch the explanation describes is the rules' (and a set ROUTE_KERNEL's)."""
    from moekit._triton_host import next_pow2
    from moekit.router import count_mode, route_launch, tokens_per_program

    for T, E, K, b in ((1, 128, 8, 2), (16, 256, 8, 2), (4096, 128, 8, 4), (300, 8, 2, 2)):
        got = route_launch(T, E, K, b)
        n = tokens_per_program(T, next_pow2(E), b)
        assert got.tokens_per_program == n and got.num_warps == (1 if n == 1 else 4)
        assert got.count == count_mode(T, next_pow2(E), K, n)
    _set_route_kernel(monkeypatch, num_warps=2, count=2)
    assert route_launch(16, 256, 8, 2).num_warps == 2 and route_launch(16, 256, 8, 2).count == 2


def test_explain_routing_on_the_cpu(monkeypatch):
    import moekit.router as router
    from moekit.hardware import Platform

    cpu = Platform("cpu", "cpu", libraries={"triton": "3.6.0"})
    monkeypatch.setattr(router, "interpret_mode", lambda: True)
    assert explain_routing("on", cpu, 8).startswith("one Triton kernel")
    monkeypatch.setattr(router, "interpret_mode", lambda: False)
    assert "the fused kernel needs CUDA tensors (or TRITON_INTERPRET=1" in explain_routing(
        "on", cpu, 8)  # fmt: skip


def test_fused_router_says_what_it_cannot_route():
    too_wide = torch.randn(2, FUSED_MAX_EXPERTS + 1, device=DEVICE)
    assert "at most 1024 experts" in fused_problem(too_wide)
    with pytest.raises(ValueError, match="select_experts_fused: at most 1024 experts"):
        select_experts_fused(too_wide, 2)
    with pytest.raises(ValueError, match="needs float logits"):
        select_experts_fused(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), 2)
    with pytest.raises(ValueError, match=r"--top-k \(9\) must be at most --num-experts \(8\)"):
        select_experts_fused(torch.randn(2, 8, device=DEVICE), 9)
    with pytest.raises(ValueError, match="scoring_func: unknown 'relu'"):
        select_experts_fused(torch.randn(2, 8, device=DEVICE), 2, scoring_func="relu")


def test_fused_router_without_triton_routes_with_the_twin(monkeypatch):
    import moekit.router as router
    from moekit.hardware import Platform

    monkeypatch.setattr(router.hardware, "detect", lambda: Platform("cpu", "cpu", libraries={}))
    logits = torch.randn(5, 8, device=DEVICE)
    assert "needs Triton (not importable, or MOEKIT_DISABLE_TRITON=1)" in fused_problem(logits)
    with pytest.raises(ValueError, match="select_experts_fused: needs Triton"):
        select_experts_fused(logits, 2)
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=8, intermediate_size=8)
    monkeypatch.setattr(router, "_select_fused", lambda *a: pytest.fail("took the kernel"))
    out = route(logits, cfg, fused="on")
    assert torch.equal(out.ids, select_experts(logits, 2).ids)


@pytest.mark.gpu
def test_fused_router_nonfinite_logits_bf16():
    _nonfinite_rows_route_to_valid_experts(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PRESET_CASES[:4], ids=["qwen3", "mixtral", "deepseek", "kimi"])
def test_fused_router_bf16_and_cuda_graph(case):
    E, K = case["E"], case["K"]
    bias = torch.randn(E, device="cuda") * 0.1 if case.get("bias") else None
    logits = _separated_logits(200, E, K, torch.bfloat16)
    ref = select_experts(logits, K, **routing_kwargs(case, bias))
    eager = select_experts_fused(logits, K, **routing_kwargs(case, bias))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = select_experts_fused(logits, K, **routing_kwargs(case, bias))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.ids, eager.ids) and torch.equal(captured.weights, eager.weights)
    same = (eager.ids.sort(-1).values == ref.ids.sort(-1).values).all(-1)
    assert int((~same).sum()) <= 2
