"""Weight loading from Hugging Face style state dicts: layouts, TP slices, EP partition."""

import pytest
import torch

from moekit import MoE, MoEConfig, ParallelConfig, RunnerConfig
from moekit.loading import load_hf_experts
from tests.helpers import rel_err

E, K, H, I = 6, 2, 16, 12


def config(**kw):
    base = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dtype="float32")
    return MoEConfig(**{**base, **kw})


def random_experts(bias=False):
    w = dict(gate=torch.randn(E, I, H), up=torch.randn(E, I, H), down=torch.randn(E, H, I))
    if bias:
        w.update(gate_b=torch.randn(E, I), up_b=torch.randn(E, I), down_b=torch.randn(E, H))
    return w


def per_expert_sd(w, prefix="mlp.experts.", names=("gate_proj", "up_proj", "down_proj")):
    sd = {}
    for e in range(E):
        for name, key in zip(names, ("gate", "up", "down")):
            sd[f"{prefix}{e}.{name}.weight"] = w[key][e]
            if key + "_b" in w:
                sd[f"{prefix}{e}.{name}.bias"] = w[key + "_b"][e]
    return sd


def fused_sd(w, transposed=False, interleaved=False, prefix="mlp.experts."):
    if interleaved:
        gate_up = torch.stack([w["gate"], w["up"]], dim=2).reshape(E, 2 * I, H)
    else:
        gate_up = torch.cat([w["gate"], w["up"]], dim=1)
    down = w["down"]
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    sd = {prefix + "gate_up_proj": gate_up.contiguous(), prefix + "down_proj": down.contiguous()}
    if "gate_b" in w:
        if interleaved:
            b = torch.stack([w["gate_b"], w["up_b"]], dim=2).reshape(E, 2 * I)
        else:
            b = torch.cat([w["gate_b"], w["up_b"]], dim=1)
        sd[prefix + "gate_up_proj_bias"] = b
        sd[prefix + "down_proj_bias"] = w["down_b"]
    return sd


def dense_expert(w, e, x, act=torch.nn.functional.silu):
    """Expert e written out from the HF tensors: down(act(gate x) * up x)."""
    h = act(x @ w["gate"][e].T + (w["gate_b"][e] if "gate_b" in w else 0))
    h = h * (x @ w["up"][e].T + (w["up_b"][e] if "up_b" in w else 0))
    return h @ w["down"][e].T + (w["down_b"][e] if "down_b" in w else 0)


@pytest.mark.parametrize("layout", ["per_expert", "mixtral_names", "fused", "fused_transposed"])
def test_layouts_load_the_same_experts(layout):
    w = random_experts()
    sd = {
        "per_expert": lambda: per_expert_sd(w),
        "mixtral_names": lambda: per_expert_sd(w, names=("w1", "w3", "w2")),
        "fused": lambda: fused_sd(w),
        "fused_transposed": lambda: fused_sd(w, transposed=True),
    }[layout]()
    layer = MoE(config())
    layer.load_hf_state_dict(sd, prefix="mlp.")
    x = torch.randn(5, H)
    for e in range(E):
        ids = torch.full((5, 1), e, dtype=torch.int32)
        from moekit.router import TopKOutput
        out = layer.forward_topk(x, TopKOutput(torch.ones(5, 1), ids))
        assert rel_err(out, dense_expert(w, e, x)) < 1e-5


def test_interleaved_fused_with_biases_round_trip():
    w = random_experts(bias=True)
    cfg = config(interleaved=True, has_bias=True)
    loaded = load_hf_experts(fused_sd(w, interleaved=True, prefix="experts."), cfg, range(E))
    gate, up = loaded.w13[:, 0::2], loaded.w13[:, 1::2]
    assert torch.equal(gate, w["gate"]) and torch.equal(up, w["up"])
    assert torch.equal(loaded.b13[:, 0::2], w["gate_b"]) and torch.equal(loaded.b2, w["down_b"])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tp, ep", [(2, 1), (3, 1), (2, 2), (6, 2), (3, 3)])
def test_tp_slices_and_ep_partition_sum_to_the_full_layer(tp, ep, interleaved):
    """Summing every rank's partial output (what the all-reduce does) gives the full layer,
    biases included (the down bias is kept by one moe-TP rank only)."""
    w = random_experts(bias=True)
    sd = fused_sd(w, interleaved=interleaved, prefix="experts.")
    cfg = config(interleaved=interleaved, has_bias=True, activation="swiglu_oai")
    full = MoE(cfg, runner=RunnerConfig(moe_runner_backend="torch"))
    full.load_hf_state_dict(sd)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    parallel = ParallelConfig(tp_size=tp, ep_size=ep)
    total = torch.zeros(9, H)
    held = []
    for rank in range(tp):
        layer = MoE(cfg, parallel, tp_rank=rank)
        layer.load_hf_state_dict(sd)
        assert layer.w13.shape == (E // ep, 2 * I // (tp // ep), H)
        held.append(layer.local_experts.tolist())
        total += layer(x, logits)
    assert rel_err(total, full(x, logits)) < 1e-5
    per_ep = {tuple(h) for h in held}
    assert sorted(e for h in per_ep for e in h) == list(range(E))


def test_shared_experts_load_as_slices_of_one_mlp():
    S = 2
    w = random_experts()
    sd = per_expert_sd(w, prefix="experts.")
    shared = dict(gate=torch.randn(S * I, H), up=torch.randn(S * I, H), down=torch.randn(H, S * I))
    for name, key in zip(("gate_proj", "up_proj", "down_proj"), ("gate", "up", "down")):
        sd[f"shared_experts.{name}.weight"] = shared[key]
    sd["gate.e_score_correction_bias"] = torch.randn(E)
    cfg = config(num_shared_experts=S, use_correction_bias=True, scoring_func="sigmoid")
    layer = MoE(cfg)
    layer.load_hf_state_dict(sd)
    assert torch.equal(layer.correction_bias, sd["gate.e_score_correction_bias"])
    x = torch.randn(4, H)
    from moekit.router import TopKOutput
    ids = torch.tensor([[E, E + 1]] * 4, dtype=torch.int32)
    out = layer.forward_topk(x, TopKOutput(torch.ones(4, 2), ids))
    ref = (torch.nn.functional.silu(x @ shared["gate"].T) * (x @ shared["up"].T)) @ shared["down"].T
    assert rel_err(out, ref) < 1e-5


def test_loading_errors_name_the_missing_piece():
    w = random_experts()
    sd = per_expert_sd(w, prefix="experts.")
    del sd["experts.3.up_proj.weight"]
    with pytest.raises(KeyError, match="experts.3.up_proj.weight"):
        MoE(config()).load_hf_state_dict(sd)
    bad = fused_sd(w, prefix="experts.")
    bad["experts.down_proj"] = torch.randn(E, H + 1, I)
    with pytest.raises(ValueError, match=r"down_proj has shape"):
        MoE(config()).load_hf_state_dict(bad)
    with pytest.raises(ValueError, match="has_bias=True but the state dict has no expert biases"):
        MoE(config(has_bias=True)).load_hf_state_dict(fused_sd(w, prefix="experts."))
    with pytest.raises(KeyError, match="e_score_correction_bias"):
        MoE(config(use_correction_bias=True)).load_hf_state_dict(fused_sd(w, prefix="experts."))
    transposed = per_expert_sd(w, prefix="experts.")
    transposed["experts.2.gate_proj.weight"] = transposed["experts.2.gate_proj.weight"].T
    with pytest.raises(ValueError, match=rf"experts.2.gate_proj.weight has shape \[{H}, {I}\]; "
                                         rf"the config gives \[{I}, {H}\]"):  # fmt: skip
        MoE(config()).load_hf_state_dict(transposed)
    fewer = {k: v[: E - 1] for k, v in fused_sd(w, prefix="experts.").items()}
    with pytest.raises(ValueError, match=rf"down_proj has shape \[{E - 1}, .*expected \[E, H, I\] "
                                         rf"= \[{E}, "):  # fmt: skip
        MoE(config()).load_hf_state_dict(fewer)
