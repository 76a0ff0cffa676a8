"""moekit as a Hugging Face transformers experts implementation (transformers >= 5).

transformers 5 runs the expert FFNs of its MoE models (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
GLM-4.5, gpt-oss and the others whose experts class carries `use_experts_implementation`)
through a registry of implementations. `register()` adds moekit to it; the model keeps its own
router, and moekit's runners (chosen per batch size by `auto`, or the backend named) run the
experts:

    from moekit.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit")
    # or, on a loaded model: model.set_experts_implementation("moekit")
    model = torch.compile(hf.prepare(model))  # optional; fullgraph works, and
                                              # mode="reduce-overhead" graphs the experts too

Gated experts with a SiLU or exact-GELU gate, or gpt-oss's clamped SwiGLU, concatenated or
interleaved gate/up rows, with or without biases. Experts stored transposed ([E, H, 2I], as
gpt-oss does) are copied once into moekit's layout ([E, 2I, H]) and the copy is kept on the
module (refreshed when the weights change), which doubles those weights' memory. Anything else
(ungated experts, a post-expert norm, another gate function) raises an error naming it.

transformers' fp8 experts (`FP8Experts`, what a fine-grained fp8 checkpoint such as DeepSeek-V3
or Qwen3-*-FP8 loads into; they dispatch through an fp8 registry of their own, where `register`
adds moekit too) run as moekit's fp8_w8a8 block format, reading the module's e4m3 weights and
float32 [128, 128] `*_scale_inv` in place: dynamic activations, a SiLU / GELU gate or the
clamped SwiGLU; other fp8 experts (per-tensor or static scales, UE8M0 scales, fp4 weights) raise
an error naming what they hold.
"""

from __future__ import annotations

import functools

import torch

from moekit.config import RunnerConfig
from moekit.layer import fused_moe
from moekit.quant import Fp8W8A8, QuantizedTensor
from moekit.quant.spec import FP8_DTYPE

NAME = "moekit"


def register(name: str = NAME, moe_runner_backend: str = "auto") -> str:
    """Add moekit to transformers' experts implementations under `name` (runs every model's
    experts on `moe_runner_backend`); returns the name to pass as `experts_implementation`.
    A backend name moekit does not know fails here (ConfigError naming the allowed ones), and so
    does a name another implementation holds (transformers' own, say)."""
    RunnerConfig(moe_runner_backend=moe_runner_backend)
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:
        raise ImportError("moekit.integrations.hf needs transformers >= 5 (its registry of "
                          "experts implementations): pip install 'moekit[hf]'") from err
    names = ExpertsInterface()  # a fresh instance: a mapping view of the global registry
    taken = names.get(name) if isinstance(name, str) else None
    if not isinstance(name, str) or not name or (
        taken is not None and getattr(taken, "func", None) is not experts_forward
    ):
        raise ValueError(
            f"register: name must be a new experts implementation name or moekit's, got {name!r} "
            f"(taken: {', '.join(sorted(names))})"
        )
    ExpertsInterface.register(name, functools.partial(experts_forward,
                                                      moe_runner_backend=moe_runner_backend))
    fp8 = _fp8_interface()
    if fp8 is not None:
        fp8.register(name, functools.partial(fp8_experts_forward,
                                             moe_runner_backend=moe_runner_backend))
    return name


def _fp8_interface():
    """transformers' registry of fp8 experts implementations (None in versions without one)."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return None
    return FP8ExpertsInterface


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                    moe_runner_backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """The forward of a transformers experts module on moekit: hidden_states [S, H],
    top_k_index [S, K], top_k_weights [S, K] -> [S, H] (ids at or past the module's expert count,
    which its expert parallelism uses for other ranks' experts, are skipped)."""
    act = module.__dict__.get("_moekit_act")
    if act is None:  # once per module: the forward's host path
        act = module._moekit_act = activation_of(module)
    w13, w2 = _weights(module)
    bias = getattr(module, "has_bias", False)
    return fused_moe(
        hidden_states, w13, w2, top_k_weights, _ids(module, top_k_index),
        b13=module.gate_up_proj_bias if bias else None,
        b2=module.down_proj_bias if bias else None,
        interleaved=not getattr(module, "is_concatenated", True),
        moe_runner_backend=moe_runner_backend, **act,
    )  # fmt: skip


def fp8_experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor,
                        top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                        moe_runner_backend: str = "auto") -> torch.Tensor:  # fmt: skip
    """`experts_forward` of transformers' fp8 experts: gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] e4m3 with `*_scale_inv` [E, ceil(N/128), ceil(K/128)] float32, read in place as
    moekit's fp8_w8a8 block format (per-token-group activations, as theirs)."""
    act = module.__dict__.get("_moekit_act")
    if act is None:
        act = module._moekit_act = fp8_activation_of(module)
    w13, w2 = _fp8_weights(module)
    return fused_moe(hidden_states, w13, w2, top_k_weights, _ids(module, top_k_index),
                     moe_runner_backend=moe_runner_backend, **act)  # fmt: skip


def _fp8_weights(module: torch.nn.Module) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The module's fp8 tensors as QuantizedTensors (views, no copy), checked and built once
    and kept on the module; built again only when a parameter is replaced (in-place writes
    are seen through the views)."""
    sources = (module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj,
               module.down_proj_scale_inv)  # fmt: skip
    cached = module.__dict__.get("_moekit_fp8")
    if cached is None or any(a is not b for a, b in zip(cached[0], sources)):
        spec = Fp8W8A8("block")
        w13, s13, w2, s2 = sources
        cached = module._moekit_fp8 = (sources, (QuantizedTensor(w13, s13, spec, w13.shape),
                                                 QuantizedTensor(w2, s2, spec, w2.shape)))
    return cached[1]


def _ids(module: torch.nn.Module, top_k_index: torch.Tensor) -> torch.Tensor:
    """int32 ids, those at or past the module's expert count (other EP ranks') as -1."""
    ids = top_k_index.to(torch.int32)
    if getattr(module, "_is_expert_parallel", False):
        ids = torch.where(ids < module.num_experts, ids, -1)
    return ids


def fp8_activation_of(module: torch.nn.Module) -> dict:
    """moekit's activation arguments for transformers' fp8 experts; ValueError naming what it
    holds when moekit cannot run it as the fp8_w8a8 block format."""
    cls = type(module).__name__
    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        raise ValueError(f"{cls}: moekit runs fp8 experts with a gate and no biases")
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != Fp8W8A8().block_shape:
        raise ValueError(f"{cls}: block_size {block}: moekit runs fp8 experts with [128, 128] "
                         "weight blocks (per-tensor fp8 experts are not read)")  # fmt: skip
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{cls}: activation_scheme {module.activation_scheme!r}: moekit runs "
                         "block fp8 experts with dynamic activations")  # fmt: skip
    for w, s in (("gate_up_proj", "gate_up_proj_scale_inv"), ("down_proj", "down_proj_scale_inv")):
        dtypes = (getattr(module, w).dtype, getattr(module, s).dtype)
        if dtypes != (FP8_DTYPE, torch.float32):
            raise ValueError(f"{cls}: {w} / {s} are {dtypes[0]} / {dtypes[1]}: moekit reads "
                             "float8_e4m3fn weights with float32 scales")  # fmt: skip
    if getattr(module, "gate_softcap", None) is not None:
        raise ValueError(f"{cls}: a softcapped gate is not one moekit runs")
    if getattr(module, "swiglu_alpha", None) is not None:
        return {"activation": "swiglu_oai", "swiglu_alpha": float(module.swiglu_alpha),
                "swiglu_limit": float(module.swiglu_limit)}  # fmt: skip
    if getattr(module, "limit", None) is not None:
        raise ValueError(f"{cls}: a clamped gate without swiglu_alpha is not one moekit runs")
    return _act_fn(module, cls)


def activation_of(module: torch.nn.Module) -> dict:
    """moekit's activation arguments for a transformers experts module; ValueError naming the
    class when moekit cannot run its experts."""
    from transformers.integrations.moe import _default_apply_gate

    cls = type(module).__name__
    if not getattr(module, "has_gate", True):
        raise ValueError(f"{cls}: experts without a gate (up -> activation -> down) are not "
                         "supported by moekit, which runs gated (GLU) experts")  # fmt: skip
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"{cls}: a norm after each expert is not supported by moekit")
    if type(module)._apply_gate is not _default_apply_gate:
        if cls == "GptOssExperts":
            return {"activation": "swiglu_oai", "swiglu_alpha": float(module.alpha),
                    "swiglu_limit": float(module.limit)}  # fmt: skip
        raise ValueError(f"{cls}: its own gate function (_apply_gate) is not one moekit runs "
                         "(silu, exact gelu, gpt-oss's clamped swiglu)")  # fmt: skip
    return _act_fn(module, cls)


def _act_fn(module: torch.nn.Module, cls: str) -> dict:
    """The activation of the module's `act_fn` (SiLU or exact GELU)."""
    from transformers.activations import GELUActivation, SiLUActivation

    act_fn = getattr(module, "act_fn", None)
    if isinstance(act_fn, (SiLUActivation, torch.nn.SiLU)):
        return {"activation": "silu"}
    if type(act_fn) is GELUActivation:
        return {"activation": "gelu"}
    raise ValueError(f"{cls}: activation {type(act_fn).__name__} is not one moekit runs "
                     "(silu, exact gelu)")  # fmt: skip


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """Make moekit's copies of the transposed experts (gpt-oss) of every experts module of
    `model` now; returns `model`. Needed once before `torch.compile` (a compiled graph cannot
    check whether the weights changed, so it reads the copy made here) and again after the
    weights change; eager forwards refresh the copies by themselves."""
    for module in model.modules():
        if getattr(module, "is_transposed", False) and hasattr(module, "gate_up_proj"):
            _copy_transposed(module)
    return model


def _weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H], w2 [E, H, I]): the module's own tensors, or for transposed storage a
    contiguous copy kept on the module and made again when the weights change (under
    torch.compile: the copy `prepare` made)."""
    w13, w2 = module.gate_up_proj, module.down_proj
    if not getattr(module, "is_transposed", False):
        return w13, w2
    cached = module.__dict__.get("_moekit_weights")
    if torch.compiler.is_compiling():
        if cached is None or cached[0][0] is not w13 or cached[0][1] is not w2:
            raise RuntimeError(
                f"{type(module).__name__} stores its experts transposed; under torch.compile "
                "moekit reads the copy in its layout made beforehand: call "
                "moekit.integrations.hf.prepare(model) before compiling (and again after "
                "changing the weights)"
            )
        return cached[2]
    if cached is None or cached[1] != _version_key(w13, w2):
        cached = _copy_transposed(module)
    return cached[2]


def _version_key(*tensors: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)


def _copy_transposed(module: torch.nn.Module) -> tuple:
    """Store (sources, their version key, (w13, w2) in moekit's layout) on the module."""
    w13, w2 = module.gate_up_proj, module.down_proj
    with torch.no_grad():
        copies = (w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous())
    module._moekit_weights = cached = ((w13, w2), _version_key(w13, w2), copies)
    return cached
