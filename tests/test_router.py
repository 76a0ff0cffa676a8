"""Router variants against a hand-written per-token reference (Python loops over one token)."""

import math

import pytest
import torch

from moekit.config import MoEConfig
from moekit.router import route, select_experts


def token_reference(logits, top_k, scoring, renorm, groups, topk_group, bias, scale, shared):
    """One token: list of (expert, weight), written plainly."""
    E = len(logits)
    if scoring == "softmax":
        m = max(logits)
        ex = [math.exp(v - m) for v in logits]
        scores = [v / sum(ex) for v in ex]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
    allowed = set(range(E))
    if groups:
        size = E // groups
        gscore = []
        for g in range(groups):
            members = sorted(choice[g * size : (g + 1) * size], reverse=True)
            gscore.append(sum(members[:2]) if bias is not None else members[0])
        best = sorted(range(groups), key=lambda g: -gscore[g])[:topk_group]
        allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
    picked = sorted(allowed, key=lambda e: -choice[e])[:top_k]
    weights = [scores[e] for e in picked]
    if renorm:
        weights = [w / sum(weights) for w in weights]
    weights = [w * scale for w in weights]
    return list(zip(picked, weights)) + [(E + j, 1.0) for j in range(shared)]


CASES = [
    dict(E=8, K=2, scoring="softmax", renorm=True),
    dict(E=8, K=2, scoring="softmax", renorm=False),
    dict(E=10, K=3, scoring="sigmoid", renorm=True, bias=True),
    dict(E=16, K=4, scoring="sigmoid", renorm=True, groups=4, topk_group=2, bias=True, scale=2.5),
    dict(E=12, K=2, scoring="softmax", renorm=True, groups=3, topk_group=1),
    dict(E=8, K=2, scoring="sigmoid", renorm=True, bias=True, scale=1.5, shared=1),
    dict(E=6, K=6, scoring="softmax", renorm=False),
]


def routing_kwargs(case: dict, bias) -> dict:
    """select_experts' keyword arguments for a case of CASES."""
    return dict(
        scoring_func=case["scoring"],
        renormalize=case["renorm"],
        num_expert_group=case.get("groups"),
        topk_group=case.get("topk_group"),
        correction_bias_E=bias,
        routed_scaling_factor=case.get("scale", 1.0),
        num_fused_shared_experts=case.get("shared", 0),
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("T", [0, 1, 13])
def test_router_matches_per_token_reference(case, T):
    E, K = case["E"], case["K"]
    logits = torch.randn(T, E, dtype=torch.bfloat16)
    bias = torch.randn(E) * 0.1 if case.get("bias") else None
    out = select_experts(logits, K, **routing_kwargs(case, bias))
    assert out.weights.dtype == torch.float32 and out.ids.dtype == torch.int32
    assert out.ids.shape == (T, K + case.get("shared", 0))
    for t in range(T):
        ref = token_reference(
            logits[t].float().tolist(), K, case["scoring"], case["renorm"], case.get("groups"),
            case.get("topk_group"), None if bias is None else bias.tolist(),
            case.get("scale", 1.0), case.get("shared", 0),
        )
        got = sorted(zip(out.ids[t].tolist(), out.weights[t].tolist()))
        ref = sorted(ref)
        assert [e for e, _ in got] == [e for e, _ in ref]
        assert [w for _, w in got] == pytest.approx([w for _, w in ref], rel=1e-5, abs=1e-7)


def test_custom_routing_function_and_config_route():
    def first_k(logits, top_k, renormalize):
        T = logits.shape[0]
        ids = torch.arange(top_k).expand(T, top_k)
        return torch.full((T, top_k), 0.5, dtype=torch.float16), ids

    cfg = MoEConfig(num_experts=4, top_k=2, hidden_size=8, intermediate_size=8)
    out = route(torch.randn(3, 4), cfg, custom_routing_function=first_k)
    assert out.ids.tolist() == [[0, 1]] * 3
    assert out.weights.dtype == torch.float32 and torch.all(out.weights == 0.5)


def test_masked_ids_pass_through_custom_router():
    def with_mask(logits, top_k, renormalize):
        ids = logits.topk(top_k, dim=-1).indices
        ids[0, 1] = -1
        return torch.ones(ids.shape), ids

    out = select_experts(torch.randn(2, 5), 2, custom_routing_function=with_mask)
    assert out.ids[0, 1].item() == -1


def test_route_all_options_together():
    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=8, intermediate_size=8,
                    scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                    use_correction_bias=True, routed_scaling_factor=2.0, num_shared_experts=1)
    out = route(torch.randn(5, 16), cfg, torch.randn(16) * 0.1)
    assert out.ids.shape == (5, 5)
    assert torch.all(out.ids[:, 4] == 16) and torch.all(out.weights[:, 4] == 1.0)
    assert torch.allclose(out.weights[:, :4].sum(-1), torch.full((5,), 2.0))
    groups = (out.ids[:, :4] // 4).tolist()
    assert all(len(set(g)) <= 2 for g in groups)


@pytest.mark.gpu
def test_router_cuda_graph_capture():
    cfg = MoEConfig(num_experts=64, top_k=8, hidden_size=8, intermediate_size=8,
                    scoring_func="sigmoid", num_expert_group=8, topk_group=4,
                    use_correction_bias=True, routed_scaling_factor=2.5)
    logits = torch.randn(32, 64, device="cuda")
    bias = torch.randn(64, device="cuda") * 0.1
    eager = route(logits, cfg, bias)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            route(logits, cfg, bias)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            captured = route(logits, cfg, bias)
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(captured.ids, eager.ids)
    assert torch.allclose(captured.weights, eager.weights)


@pytest.mark.parametrize("kw, needle", [
    (dict(top_k=9), r"--top-k \(9\) must be at most --num-experts \(8\)"),
    (dict(top_k=0), "--top-k must be a positive integer, got 0"),
    (dict(num_expert_group=3, topk_group=1), r"--num-expert-group \(3\) must divide --num-experts"),
    (dict(num_expert_group=4), "must be given together"),
    (dict(num_expert_group=4, topk_group=5), r"--topk-group \(5\) must be at most"),
    (dict(num_expert_group=4, topk_group=1, top_k=3), r"--top-k \(3\) exceeds the experts in"),
    (dict(num_fused_shared_experts=-1), "--num-shared-experts must be an integer >= 0, got -1"),
    (dict(correction_bias_E=torch.zeros(1)), r"correction_bias must be \[E\] = \[8\], got \[1\]"),
    (dict(custom_routing_function=lambda lg, k, r: (lg[:, :k + 1], lg[:, :k + 1].long())),
     r"must return \(weights \[T, top_k\] = \[4, 2\] float"),
    (dict(custom_routing_function=lambda lg, k, r: (lg[:, :k], lg[:, :k])),
     r"ids \[T, top_k\] int\), got torch.float32 \[4, 2\] and torch.float32"),
])  # fmt: skip
def test_bad_routing_options_are_refused_by_name(kw, needle):
    kw = {"top_k": 2, **kw}
    logits = torch.randn(4, 8)
    assert select_experts(logits, 2).ids.shape == (4, 2)
    with pytest.raises(ValueError, match=needle):
        select_experts(logits, **kw)
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\], got \[8\]"):
        select_experts(logits[0], 2)
