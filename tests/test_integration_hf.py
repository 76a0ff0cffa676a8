"""moekit as a transformers experts implementation (`moekit.integrations.hf`): small random
Qwen3-MoE, Mixtral and gpt-oss models give the same logits with their experts on moekit as with
transformers' own eager experts; the cases moekit cannot run are refused with the reason."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from helpers import DEVICE, rel_err  # noqa: E402
from moekit.config import ConfigError  # noqa: E402
from moekit.integrations import hf  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)  # fmt: skip


def qwen3():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=3, intermediate_size=128))


def mixtral():
    return MixtralForCausalLM(MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=5,
                                            num_experts_per_tok=2))  # fmt: skip


def gpt_oss():
    model = GptOssForCausalLM(GptOssConfig(**SMALL, intermediate_size=32, num_local_experts=4,
                                           num_experts_per_tok=2))  # fmt: skip
    for module in experts_modules(model):  # its init leaves the experts at zero
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.05)
    return model


def experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def logits(model, ids, impl):
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("make", [qwen3, mixtral, gpt_oss], ids=lambda f: f.__name__)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_same_logits_as_transformers_eager_experts(make, backend):
    torch.manual_seed(0)
    model = make().to(DEVICE).eval()
    name = hf.register(f"moekit-{backend}", moe_runner_backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), device=DEVICE)
    ref = logits(model, ids, "eager")
    out = logits(model, ids, name)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-5


def test_transposed_weights_are_copied_once_and_refreshed():
    """gpt-oss stores its experts [E, H, 2I]: the copy in moekit's layout is kept and made again
    after the weights change."""
    torch.manual_seed(0)
    model = gpt_oss().to(DEVICE).eval()
    name = hf.register()
    ids = torch.randint(0, 128, (1, 5), device=DEVICE)
    logits(model, ids, name)
    module = experts_modules(model)[0]
    first = module._moekit_weights[2][0]
    logits(model, ids, name)
    assert module._moekit_weights[2][0] is first
    with torch.no_grad():
        module.gate_up_proj.mul_(2.0)
    assert rel_err(logits(model, ids, name), logits(model, ids, "eager")) < 1e-5
    assert module._moekit_weights[2][0] is not first


def test_ids_of_other_ranks_are_skipped_under_expert_parallelism():
    """transformers' expert parallelism marks other ranks' experts with ids >= num_experts."""
    torch.manual_seed(0)
    module = experts_modules(qwen3())[0]
    with torch.no_grad():
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(6, 64)
    ids = torch.tensor([[0, 9], [3, 1], [8, 8], [2, 5], [7, 10], [4, 6]])
    w = torch.rand(6, 2)
    module._is_expert_parallel = True
    kept = torch.where(ids < 8, ids, 0)
    ref = module.__class__.forward.__wrapped__(module, x, kept, w * (ids < 8))
    assert rel_err(hf.experts_forward(module, x, ids, w), ref) < 1e-5


def test_what_moekit_cannot_run_is_refused():
    with pytest.raises(ConfigError, match="--moe-runner-backend: unknown value 'fastest'"):
        hf.register("moekit-fastest", moe_runner_backend="fastest")
    assert hf.register() == hf.register()  # moekit's own name may be registered again
    for name in ("grouped_mm", "", None):  # transformers' own stays its own
        with pytest.raises(ValueError, match="name must be a new experts implementation name"):
            hf.register(name)
    module = experts_modules(qwen3())[0]
    module.act_fn = torch.nn.Tanh()
    with pytest.raises(ValueError, match="activation Tanh is not one moekit runs"):
        hf.activation_of(module)
    module.has_gate = False
    with pytest.raises(ValueError, match="experts without a gate"):
        hf.activation_of(module)
    module.has_gate, module.has_post_expert_norm = True, True
    with pytest.raises(ValueError, match="a norm after each expert"):
        hf.activation_of(module)


@pytest.mark.parametrize("make", [qwen3, mixtral, gpt_oss], ids=lambda f: f.__name__)
def test_compiled_model_gives_the_eager_logits(make):
    """torch.compile(fullgraph=True) traces the whole model with moekit's experts as one op
    (aot_eager on CPU: the graph and its fake-tensor shapes, without Inductor), for two batch
    shapes; gpt-oss's transposed experts are read from the copy `prepare` made."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().to(DEVICE).eval()
    name = hf.register()
    model.set_experts_implementation(name)
    compiled = torch.compile(hf.prepare(model), fullgraph=True, backend="aot_eager")
    for shape in ((2, 11), (1, 5)):
        ids = torch.randint(0, model.config.vocab_size, shape, device=DEVICE)
        with torch.no_grad():
            ref, out = model(ids).logits, compiled(ids).logits
        assert out.shape == ref.shape and rel_err(out, ref) < 1e-5


def test_compiled_transposed_experts_need_prepare():
    torch._dynamo.reset()
    model = gpt_oss().eval()
    model.set_experts_implementation(hf.register())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"call moekit.integrations.hf.prepare\(model\)"):
        with torch.no_grad():
            compiled(torch.randint(0, 128, (1, 3)))
