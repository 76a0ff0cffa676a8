"""moekit as a transformers experts implementation (`moekit.integrations.hf`): small random
Qwen3-MoE, Mixtral and gpt-oss models give the same logits with their experts on moekit as with
transformers' own eager experts; the cases moekit cannot run are refused with the reason."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from helpers import DEVICE, rel_err  # noqa: E402
from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from moekit.config import ConfigError  # noqa: E402
from moekit.integrations import hf  # noqa: E402
from moekit.layer import fused_moe  # noqa: E402
from moekit.quant import Fp8W8A8, QuantizedTensor, dequantize, quantize  # noqa: E402

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


E8, H8, I8 = 4, 256, 128  # fp8 experts: whole [128, 128] blocks, as real checkpoints have


def fp8_experts(**kw):
    """transformers' fp8 experts module (as a fine-grained fp8 checkpoint loads them) holding
    random block-fp8 experts, and those experts as QuantizedTensors."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    class TinyFP8Experts(FP8Experts):  # decorated here, leaving transformers' class as it is
        pass

    use_experts_implementation(experts_class=TinyFP8Experts,
                               experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)  # fmt: skip
    config = Qwen3MoeConfig(**{**SMALL, "hidden_size": H8}, moe_intermediate_size=I8,
                            num_experts=E8, num_experts_per_tok=2)  # fmt: skip
    module = TinyFP8Experts(config, **{"block_size": (128, 128), **kw})
    q13 = quantize(torch.randn(E8, 2 * I8, H8) / 8, Fp8W8A8("block"))
    q2 = quantize(torch.randn(E8, H8, I8) / 8, Fp8W8A8("block"))
    with torch.no_grad():
        for name, q in (("gate_up_proj", q13), ("down_proj", q2)):
            getattr(module, name).copy_(q.data)
            getattr(module, name + "_scale_inv").copy_(q.scale)
    return module.to(DEVICE), q13, q2


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fp8_experts_run_on_moekit(backend):
    """transformers' fp8 experts set to moekit run its fp8_w8a8 block path on the module's own
    tensors: the same output as fused_moe over those tensors as QuantizedTensors, and within
    the activations' fp8 error of the dequantized experts."""
    torch.manual_seed(0)
    module, q13, q2 = fp8_experts()
    name = hf.register(f"moekit-{backend}", moe_runner_backend=backend)
    module.config._experts_implementation = name
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16  # the interpreter: no bf16
    x = torch.randn(7, H8, device=DEVICE, dtype=dtype)
    ids = torch.randint(0, E8, (7, 2), device=DEVICE)
    w = torch.rand(7, 2, device=DEVICE)
    out = module(x, ids, w)
    assert "_moekit_act" in module.__dict__  # moekit ran, not transformers' fp8 forward
    q13, q2 = (QuantizedTensor(q.data.to(DEVICE), q.scale.to(DEVICE), q.spec, q.shape)
               for q in (q13, q2))  # fmt: skip
    same = fused_moe(x, q13, q2, w, ids, moe_runner_backend=backend)
    assert torch.equal(out, same)
    ref = fused_moe(x.float(), dequantize(q13), dequantize(q2), w, ids, moe_runner_backend="torch")
    assert out.dtype == dtype and rel_err(out, ref) < 0.06


def test_fp8_experts_views_are_built_once_and_follow_replaced_parameters():
    module = fp8_experts()[0]
    first = hf._fp8_weights(module)
    assert hf._fp8_weights(module) is first
    module.down_proj = torch.nn.Parameter(module.down_proj.data.clone(), requires_grad=False)
    again = hf._fp8_weights(module)
    assert again is not first and again[1].data is module.down_proj


def test_fp8_experts_moekit_cannot_run_are_refused():
    module = fp8_experts()[0]
    with pytest.raises(ValueError, match=r"block_size \(64, 64\): moekit runs fp8 experts with "
                                         r"\[128, 128\] weight blocks"):  # fmt: skip
        module.block_size = (64, 64)
        hf.fp8_activation_of(module)
    module.block_size = (128, 128)
    module.activation_scheme = "static"
    with pytest.raises(ValueError, match="activation_scheme 'static'"):
        hf.fp8_activation_of(module)
    module.activation_scheme = "dynamic"
    module.down_proj_scale_inv.data = module.down_proj_scale_inv.data.half()
    with pytest.raises(ValueError, match="down_proj / down_proj_scale_inv are torch.float8_e4m3fn "
                                         "/ torch.float16"):  # fmt: skip
        hf.fp8_activation_of(module)
    module.down_proj_scale_inv.data = module.down_proj_scale_inv.data.float()
    module.gate_softcap = 30.0
    with pytest.raises(ValueError, match="softcapped gate"):
        hf.fp8_activation_of(module)


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
