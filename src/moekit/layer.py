"""The MoE layer: route -> dispatch -> run experts -> combine. Orchestration only, no math."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from moekit import envs, hardware, metrics
from moekit.compiled import run_experts_op
from moekit.config import (
    INT_DTYPES,
    ConfigError,
    MoEConfig,
    ParallelConfig,
    RunnerConfig,
    validate,
)
from moekit.dispatch.factory import make_dispatcher
from moekit.eplb.recorder import ExpertLoadRecorder
from moekit.experts import QUANT_TENSORS, ActivationSpec, ExpertWeights
from moekit.loading import load_hf_experts
from moekit.log import log_once
from moekit.parallel import ParallelState
from moekit.placement import ExpertPlacement
from moekit.quant import (
    QuantizedTensor,
    QuantSpec,
    format_name,
    from_quantized,
    make_spec,
    quantize_experts,
)
from moekit.quant.calibrate import random_experts_scales, standard_normal_scales
from moekit.quant.checkpoint import CheckpointFormat, checkpoint_format
from moekit.router import CustomRoutingFunction, TopKOutput, fused_mode, route
from moekit.runners.base import Runner, RunnerError, input_problem
from moekit.runners.registry import runner_class
from moekit.select import Decision, Workload, select_runner
from moekit.stages import DispatchOutput, StandardDispatchOutput


class RunnerCache:
    """Runner instances by name, and the selection decision per workload (made once each)."""

    def __init__(self, config: RunnerConfig) -> None:
        self.config = config
        self._runners: dict[str, Runner] = {}
        self._decisions: dict[Workload, Decision] = {}

    def decide(self, work: Workload) -> Decision:
        decision = self._decisions.get(work)
        if decision is None:
            decision = select_runner(work, self.config, hardware.detect())
            self._decisions[work] = decision
        return decision

    def runner(self, work: Workload) -> Runner:
        name = self.decide(work).backend
        if name not in self._runners:
            self._runners[name] = runner_class(name)()
        metrics.record_runner_call(name)
        return self._runners[name]

    def refresh(self, weights: ExpertWeights, act: ActivationSpec) -> None:
        """The weights were written in place: every runner made so far rewrites its copies."""
        for runner in self._runners.values():
            runner.refresh(weights, act)


def workload_of(d: DispatchOutput, weights: ExpertWeights, act: ActivationSpec) -> Workload:
    """What the runner must do for this dispatch output: the input of `moekit.select`."""
    x = d.x
    tokens = x.shape[0] if isinstance(d, StandardDispatchOutput) else x.shape[0] * x.shape[1]
    return Workload(
        num_tokens=tokens,
        format=d.format,
        weight_format=weights.format,
        activation=act.name,
        dtype=str(x.dtype).removeprefix("torch."),
        device=x.device.type,
        has_bias=weights.has_bias,
        # shape (for the selection tables; masked: no top-k) and quantization parameters
        num_experts=weights.num_experts,
        hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size,
        top_k=d.topk.top_k if isinstance(d, StandardDispatchOutput) else None,
        weight_spec=weights.spec,
        local_share=d.local_share if isinstance(d, StandardDispatchOutput) else 1.0,
    )


def run_experts(
    d: DispatchOutput, weights: ExpertWeights, act: ActivationSpec, runners: RunnerCache
):
    """Check the inputs (`input_problem`), pick the runner for this call and run it (under
    torch.compile: as one custom op, `moekit.compiled`)."""
    problem = input_problem(d, weights)
    if problem:
        raise RunnerError(problem)
    if torch.compiler.is_compiling():
        return run_experts_op(d, weights, act, runners)
    return runners.runner(workload_of(d, weights, act)).run(d, weights, act)


class MoE(nn.Module):
    """A drop-in MoE block.

    Parameters (this rank's share): w13 [E_local, 2I_local, H], w2 [E_local, H, I_local],
    b13 [E_local, 2I_local] and b2 [E_local, H] when `config.has_bias`, correction_bias [E] when
    `config.use_correction_bias`. forward(x [..., H], router_logits [..., E]) -> [..., H].

    Quantized weights (`weight_format`, a format name, a --quantization string
    'name:key=value,...' or a moekit.quant spec; default `config.weight_format`): w13 / w2
    become buffers holding the format's data, with its scale buffers beside (names in
    moekit.experts.QUANT_TENSORS); they are drawn unquantized and quantized (static fp8
    activation scales calibrated for N(0, 1) inputs). `quantize_weights_` quantizes an
    unquantized layer in place; `load_hf_state_dict` loads quantized checkpoints.
    `init_weights=False` draws no experts: they take no memory (meta tensors) until
    `load_hf_state_dict` fills them, and the layer refuses to run before (`from_pretrained`).

    Expert load (EPLB, `moekit.eplb`): `record_expert_load()` makes forward count the routed
    pairs per logical expert on the device (`expert_load`); `moekit.eplb.rebalance_` moves the
    experts to a new placement; `moekit.eplb.ExpertBalancer` does both every N steps.
    """

    def __init__(
        self,
        config: MoEConfig,
        parallel: ParallelConfig = ParallelConfig(),
        runner: RunnerConfig = RunnerConfig(),
        *,
        tp_rank: int = 0,
        placement: ExpertPlacement | None = None,
        dispatcher=None,
        custom_routing_function: CustomRoutingFunction | None = None,
        device: torch.device | str | None = None,
        state: ParallelState | None = None,
        weight_format: str | QuantSpec | None = None,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        if weight_format is not None:
            config = replace(config, weight_format=format_name(weight_format))
        spec = make_spec(weight_format if weight_format is not None else config.weight_format)
        if state is not None:  # ranks and groups from moekit.parallel.init_parallel
            parallel, tp_rank = state.resolve(parallel), state.tp_rank
        validate(config, parallel, runner)
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < parallel.tp_size:
            raise ConfigError(f"tp_rank must be an integer in [0, --tp-size = {parallel.tp_size}), "
                              f"got {tp_rank!r}")  # fmt: skip
        self.config, self.parallel = config, parallel
        self.tp_rank = tp_rank
        self.ep_rank = tp_rank // parallel.moe_tp_size
        self.moe_tp_rank = tp_rank % parallel.moe_tp_size
        slots = config.total_experts + parallel.ep_num_redundant_experts
        if placement is not None:
            if (placement.ep_size, placement.num_slots) != (parallel.ep_size, slots):
                raise ConfigError(
                    f"placement: {placement.num_slots} slots over {placement.ep_size} ranks; the "
                    f"configs give {slots} (experts + --ep-num-redundant-experts) over --ep-size "
                    f"{parallel.ep_size}"
                )
            placement.check(config.total_experts)
        self.placement = placement or ExpertPlacement.contiguous(
            config.total_experts, parallel.ep_size, slots
        )
        self.dispatcher = dispatcher or make_dispatcher(
            parallel, self.placement, config.total_experts, state=state, ep_rank=self.ep_rank
        )
        self.act = ActivationSpec.from_config(config)
        self.runners = RunnerCache(runner)
        self.custom_routing_function = custom_routing_function
        self.fused_router = fused_mode(envs.MOEKIT_FUSED_ROUTER.get())  # read once: not per call
        self.quant_spec: QuantSpec | None = None
        # static fp8 scales calibrated for N(0, 1) inputs, not given: redone for new weights
        self._standard_normal_scales = False
        self.state = state
        self.expert_load: ExpertLoadRecorder | None = None

        E, H = self.placement.slots_per_rank, config.hidden_size
        I = config.intermediate_size // parallel.moe_tp_size
        kw = dict(device=device, dtype=config.torch_dtype)
        # where a load puts the experts of a layer made without them (init_weights=False)
        self._load_device = torch.empty(0, device=device).device
        experts_kw = kw if init_weights else dict(kw, device="meta")
        self.w13 = nn.Parameter(torch.empty(E, 2 * I, H, **experts_kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, I, **experts_kw), requires_grad=False)
        self.b13 = self.b2 = self.correction_bias = None
        if config.has_bias:
            self.b13 = nn.Parameter(torch.empty(E, 2 * I, **kw), requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(E, H, **kw), requires_grad=False)
        if config.use_correction_bias:
            self.correction_bias = nn.Parameter(
                torch.zeros(config.num_experts, device=device, dtype=torch.float32),
                requires_grad=False,
            )
        if not init_weights:  # the spec is the format a load converts to (_hold_loaded)
            self.quant_spec = spec
            for name in QUANT_TENSORS if spec is not None else ():
                self.register_buffer(name, None)
            self._standard_normal_scales = spec is not None and spec.act_scheme == "static_tensor"
        else:
            self.reset_parameters()
            if spec is not None:
                scales = random_experts_scales(self.expert_weights, spec, self.act)
                self.quantize_weights_(spec, **scales)
                self._standard_normal_scales = bool(scales)
        if parallel.enable_eplb:
            self.record_expert_load()

    def extra_repr(self) -> str:
        """What `print(layer)` shows: the shape, format, backend and this rank's share."""
        c, p = self.config, self.parallel
        weights = self.quant_spec.describe() if self.quant_spec is not None else "unquantized"
        held = f"{weights} (not loaded)" if self.w13.is_meta else weights
        return (f"num_experts={c.num_experts}, top_k={c.top_k}, hidden_size={c.hidden_size}, "
                f"intermediate_size={c.intermediate_size}, activation={c.activation}, "
                f"dtype={c.dtype}, weights={held}, "
                f"backend={self.runners.config.moe_runner_backend}, tp_size={p.tp_size}, "
                f"ep_size={p.ep_size}, tp_rank={self.tp_rank}, "
                f"local_experts={self.placement.slots_per_rank}")  # fmt: skip

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random init like nn.Linear (uniform in +-1/sqrt(fan_in)); biases likewise; the local
        copies of an expert get its weights. A quantized layer draws unquantized weights and
        quantizes them."""
        w13, w2 = self.w13, self.w2
        if self.quant_spec is not None:
            ew = self.expert_weights
            E, I, H = ew.num_experts, ew.intermediate_size, ew.hidden_size
            kw = dict(device=w13.device, dtype=self.config.torch_dtype)
            w13, w2 = torch.empty(E, 2 * I, H, **kw), torch.empty(E, H, I, **kw)
        for p, fan_in in ((w13, w13.shape[2]), (w2, w2.shape[2])):
            nn.init.uniform_(p, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        for b in (self.b13, self.b2):
            if b is not None:
                nn.init.uniform_(b, -0.05, 0.05)
        # local copies of one logical expert (redundant slots) hold the same weights
        first: dict[int, int] = {}
        for slot, expert in enumerate(self.local_experts.tolist()):
            src = first.setdefault(expert, slot)
            if src == slot:
                continue
            for t in (w13, w2, self.b13, self.b2):
                if t is not None:
                    t[slot].copy_(t[src])
        if self.quant_spec is not None:
            self._requantize(w13, w2)

    @property
    def expert_weights(self) -> ExpertWeights:
        if self.w13.is_meta:
            raise RuntimeError("the layer's experts are not loaded: it was made with "
                               "init_weights=False; load_hf_state_dict fills them")  # fmt: skip
        if self.quant_spec is None:
            return ExpertWeights(self.w13, self.w2, self.b13, self.b2)
        scales = {name: getattr(self, name) for name in QUANT_TENSORS}
        return ExpertWeights(
            self.w13, self.w2, self.b13, self.b2, self.quant_spec.name, spec=self.quant_spec,
            **scales,
        )

    @torch.no_grad()
    def quantize_weights_(
        self,
        weight_format: str | QuantSpec,
        *,
        a13_scale: torch.Tensor | float | None = None,
        a2_scale: torch.Tensor | float | None = None,
        **params,
    ) -> None:
        """Quantize this (unquantized) layer's experts in place to `weight_format` (a name with
        optional spec parameters, or a QuantSpec; see moekit.quant). a13_scale / a2_scale: the
        calibrated activation scales (one value or [E_local]) of a 'static_tensor' fp8 spec."""
        if self.quant_spec is not None:
            raise ValueError(f"the layer is already quantized ({self.quant_spec.describe()})")
        spec = make_spec(weight_format, **params)
        if spec is None:
            return
        self._set_experts(
            quantize_experts(self.expert_weights, spec, a13_scale=a13_scale, a2_scale=a2_scale)
        )
        self._standard_normal_scales = False

    @torch.no_grad()
    def dequantize_weights_(self) -> None:
        """Dequantize this layer's quantized experts in place to the layer's dtype (the inverse
        of quantize_weights_): w13 [E, 2I, H] / w2 [E, H, I] become parameters again and the
        scale buffers go. An unquantized layer is left as it is."""
        if self.quant_spec is None:
            return
        w = self.expert_weights.dequantized(self.config.torch_dtype)
        for name in ("w13", "w2", *QUANT_TENSORS):
            delattr(self, name)
        self.w13 = nn.Parameter(w.w13, requires_grad=False)
        self.w2 = nn.Parameter(w.w2, requires_grad=False)
        self.quant_spec = None
        self.config = replace(self.config, weight_format="unquantized")
        self._standard_normal_scales = False
        self.runners.refresh(self.expert_weights, self.act)

    def _requantize(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantize unquantized w13 / w2 with this layer's spec (and its static activation
        scales; those calibrated for N(0, 1) inputs are calibrated anew for these weights) and
        hold them."""
        fresh = ExpertWeights(w13, w2, self.b13, self.b2)
        scales = dict(a13_scale=self.a13_scale, a2_scale=self.a2_scale)
        if self._standard_normal_scales:
            scales = standard_normal_scales(fresh, self.act)
        self._set_experts(quantize_experts(fresh, self.quant_spec, **scales))

    def _set_experts(self, q: ExpertWeights) -> None:
        """Hold quantized experts `q`: data and scales as buffers (they follow .to(), state_dict)."""
        for name in ("w13", "w2"):
            if name in self._parameters:
                delattr(self, name)
        for name in ("w13", "w2", *QUANT_TENSORS):
            self.register_buffer(name, getattr(q, name))
        self.quant_spec = q.spec
        self.config = replace(self.config, weight_format=q.spec.name)

    @property
    def _device(self) -> torch.device:
        """Where the experts are, or go when a load fills them (init_weights=False)."""
        return self._load_device if self.w13.is_meta else self.w13.device

    @property
    def local_experts(self) -> torch.Tensor:
        """Logical expert id of each local slot [E_local]."""
        return self.placement.local_experts(self.ep_rank)

    def route(self, router_logits_TE: torch.Tensor,
              counts_N: torch.Tensor | None = None) -> TopKOutput:
        """router_logits [T, E] -> TopKOutput (logical ids); with counts [total_experts] int64,
        the routed pairs per expert are also added to it (`moekit.router.route`)."""
        return route(router_logits_TE, self.config, self.correction_bias,
                     self.custom_routing_function, fused=self.fused_router,
                     counts_N=counts_N)  # fmt: skip

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [..., H], router_logits [..., E] (the same leading shape) -> [..., H]."""
        shape = x.shape
        H, E = self.config.hidden_size, self.config.num_experts
        if x.dim() == 0 or shape[-1] != H or router_logits.shape != (*shape[:-1], E):
            raise ValueError(
                f"MoE.forward: x must be [..., H] with H = {H} and router_logits [..., E] with "
                f"E = {E} over the same leading shape, got {list(shape)} and "
                f"{list(router_logits.shape)}"
            )
        x_TH = x.reshape(-1, H)
        logits_TE = router_logits.reshape(x_TH.shape[0], E)
        load = self.expert_load  # counted by the routing (inside the fused kernel)
        topk = self.route(logits_TE, None if load is None else load.counts_on(logits_TE.device))
        return self._run_experts(x_TH, topk).view(shape)

    def record_expert_load(self, enabled: bool = True) -> ExpertLoadRecorder | None:
        """Count the pairs routed to each logical expert from now on (`expert_load`, on the
        layer's device), or stop counting. Returns the recorder."""
        if not enabled:
            self.expert_load = None
        elif self.expert_load is None:
            self.expert_load = ExpertLoadRecorder(self.config.total_experts, self._device)
        return self.expert_load

    def forward_topk(self, x_TH: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """The layer after routing: x [T, H] and a TopKOutput with logical ids -> [T, H]."""
        if self.expert_load is not None:
            self.expert_load.record(topk.ids)
        return self._run_experts(x_TH, topk)

    def _run_experts(self, x_TH: torch.Tensor, topk: TopKOutput) -> torch.Tensor:
        """Dispatch, run the experts, combine: x [T, H] -> [T, H]."""
        dispatched = self.dispatcher.dispatch(x_TH, topk)
        result = run_experts(dispatched, self.expert_weights, self.act, self.runners)
        return self.dispatcher.combine(result, dispatched)

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        layer: int,
        parallel: ParallelConfig = ParallelConfig(),
        runner: RunnerConfig = RunnerConfig(),
        *,
        tp_rank: int = 0,
        device: torch.device | str | None = None,
        weight_format: str | QuantSpec | None = None,
        prefix: str | None = None,
        state: ParallelState | None = None,
        placement: ExpertPlacement | None = None,
        **config_overrides,
    ) -> MoE:
        """MoE layer `layer` of a Hugging Face checkpoint directory (config.json and safetensors
        shards), as rank `tp_rank` of `parallel` holds it: only its experts' tensors are read
        (`moekit.pretrained`). The experts keep the checkpoint's format (the one its config
        declares; `weight_format`: convert them to another quantized format, or 'unquantized':
        dequantize them to the layer's dtype). The routed
        experts only (shared experts are left to the caller, as `moekit.hf_config` says), with
        the router's correction bias. `prefix`: the block's name prefix, when it is not found
        from the layer's expert tensors; `state` (ranks and groups of
        moekit.parallel.init_parallel, which then give the config and rank) and `placement` (an
        EPLB placement: the experts of this rank's slots are read) as for the constructor;
        `config_overrides`: MoEConfig fields (dtype, ...)."""
        from moekit.hf_config import load_hf_config
        from moekit.pretrained import CheckpointFiles, layer_prefix, layer_tensors

        hf = load_hf_config(model)
        files = CheckpointFiles.of(model)
        prefix = layer_prefix(files, layer) if prefix is None else prefix
        moe = cls(replace(hf.config, **config_overrides), parallel, runner, tp_rank=tp_rank,
                  device=device, weight_format=weight_format, state=state, placement=placement,
                  init_weights=False)  # fmt: skip
        sd, rows = layer_tensors(files, prefix, moe.local_experts.tolist(), moe.config.num_experts,
                                 shared=moe.config.num_shared_experts > 0)  # fmt: skip
        moe.load_hf_state_dict(sd, prefix, quantization_config=hf.quantization,
                               fused_experts=rows)  # fmt: skip
        if weight_format is not None and make_spec(weight_format) is None:
            moe.dequantize_weights_()  # asked for unquantized experts of a quantized checkpoint
        return moe

    @torch.no_grad()
    def load_hf_state_dict(
        self,
        state_dict: Mapping[str, torch.Tensor],
        prefix: str = "",
        *,
        experts_prefix: str = "experts.",
        shared_prefix: str = "shared_experts.",
        correction_bias_key: str = "gate.e_score_correction_bias",
        quantization_config: Mapping | CheckpointFormat | None = None,
        fused_experts: Sequence[int] | None = None,
    ) -> None:
        """Load this rank's experts from a Hugging Face style state dict (see moekit.loading).

        Unquantized experts are copied (and quantized when the layer has a weight format).
        Quantized experts (fp8 / int8 / GPTQ / AWQ / compressed-tensors / nvfp4 / gpt-oss mxfp4
        checkpoints) are held as stored, static fp8 `input_scale`s included; the layer takes on
        their format. A layer made with another weight format converts them (dequantize, then
        quantize).
        `quantization_config`: the checkpoint's (config.json's, or its `checkpoint_format`),
        which says what the tensors cannot (GPTQ v2 zero points, an fp8 activation scheme,
        weight-only int8) and which the experts must match (`moekit.quant.checkpoint`).
        `fused_experts`: the logical experts whose rows fused expert tensors ([E, ...]) hold, in
        order, when they hold only some (moekit.pretrained reads a rank's rows); default all."""
        checkpoint = quantization_config
        if quantization_config is not None and not isinstance(checkpoint, CheckpointFormat):
            checkpoint = checkpoint_format(quantization_config)
        loaded = load_hf_experts(
            state_dict,
            self.config,
            self.local_experts.tolist(),
            prefix=prefix + experts_prefix,
            shared_prefix=prefix + shared_prefix,
            moe_tp_size=self.parallel.moe_tp_size,
            moe_tp_rank=self.moe_tp_rank,
            checkpoint=checkpoint,
            fused_experts=fused_experts,
        )
        # the biases first: static activation scales calibrated here depend on them
        for name in ("b13", "b2"):
            param, value = getattr(self, name), getattr(loaded, name)
            if (param is None) != (value is None):
                raise ValueError(
                    f"{name}: config has_bias={self.config.has_bias} but the state dict "
                    f"{'has' if value is not None else 'has no'} expert biases"
                )
            if param is not None:
                param.copy_(value)
        device = self._device
        if loaded.spec is not None:
            self._hold_loaded(loaded.quantized())
        elif self.quant_spec is None:
            for name in ("w13", "w2"):
                self._copy_in(name, getattr(loaded, name))
        else:
            self._requantize(loaded.w13.to(device), loaded.w2.to(device))
        if self._standard_normal_scales:
            log_once(logging.WARNING, "static fp8 activation scales of loaded experts calibrated "
                     "for N(0, 1) inputs: none were given; calibrate them on real activations "
                     "(moekit.quant.calibrate_static_scales) and pass them to quantize_weights_")
        if self.correction_bias is not None:
            key = prefix + correction_bias_key
            if key not in state_dict:
                raise KeyError(f"use_correction_bias=True but the state dict has no {key!r}")
            self.correction_bias.copy_(state_dict[key])
        self.runners.refresh(self.expert_weights, self.act)

    def _copy_in(self, name: str, value: torch.Tensor) -> None:
        """Copy unquantized `value` into expert parameter `name` (w13 / w2), or make it there
        when the layer has none yet (init_weights=False)."""
        param = getattr(self, name)
        if value.shape != param.shape:
            raise ValueError(f"{name}: the layer holds {list(param.shape)}, the load gives "
                             f"{list(value.shape)}")  # fmt: skip
        if param.is_meta:
            value = value.to(device=self._load_device, dtype=param.dtype, copy=True)
            setattr(self, name, nn.Parameter(value, requires_grad=False))
        else:
            param.copy_(value)

    def _hold_loaded(self, q: ExpertWeights) -> None:
        """Hold quantized experts read from a checkpoint (on this layer's device): in their own
        format, or converted to the layer's when it has another."""
        device = self._device
        names = [n for n in ("w13", "w2", *QUANT_TENSORS) if getattr(q, n) is not None]
        q = replace(q, **{n: getattr(q, n).to(device) for n in names})
        held, spec = self.quant_spec, q.spec
        if held is not None and {held.name, spec.name} == {"int8_w8a8", "int8_w8a16"}:
            q = replace(q, format=held.name, spec=held)  # the same int8 data and scales
        elif held is not None and held.name != spec.name:
            log_once(logging.INFO, f"converting the state dict's {spec.describe()} experts to "
                     f"{held.describe()}")  # fmt: skip
            w = q.dequantized(torch.float32)
            self._requantize(w.w13, w.w2)
            return
        log_once(logging.INFO, f"holding the state dict's experts as {spec.describe()}")
        self._set_experts(q)
        self._standard_normal_scales = False


def fused_moe(
    x_TH: torch.Tensor,
    w13: torch.Tensor | QuantizedTensor,
    w2: torch.Tensor | QuantizedTensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    interleaved: bool = False,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    moe_runner_backend: str = "auto",
) -> torch.Tensor:
    """Functional MoE on one rank: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (x's dtype, or
    QuantizedTensors of one format with those logical shapes), topk_weights [T, K] float,
    topk_ids [T, K] int -> out [T, H] in x's dtype. Ids outside [0, E) add nothing: -1 marks an
    unused slot, and an expert parallel rank passes the ids of experts it does not hold that way
    (the kernels read ids on the device, so they are not range-checked)."""
    if isinstance(w13, QuantizedTensor) != isinstance(w2, QuantizedTensor):
        raise ValueError("fused_moe: w13 and w2 must both be QuantizedTensors or both tensors")
    if isinstance(w13, QuantizedTensor):
        weights = from_quantized(w13, w2, b13, b2)
    else:
        weights = ExpertWeights(w13, w2, b13, b2)
    act = ActivationSpec(activation, interleaved, swiglu_alpha, swiglu_limit)
    # the runners' dtypes; other dtypes pass through for input_problem to name
    if topk_weights.dtype.is_floating_point:
        topk_weights = topk_weights.float()
    if topk_ids.dtype in INT_DTYPES:
        topk_ids = topk_ids.to(torch.int32)
    topk = TopKOutput(topk_weights, topk_ids)
    runners = _functional_runners(moe_runner_backend)
    return run_experts(StandardDispatchOutput(x_TH, topk), weights, act, runners).out


_FUNCTIONAL: dict[str, RunnerCache] = {}


def _functional_runners(backend: str) -> RunnerCache:
    if backend not in _FUNCTIONAL:
        _FUNCTIONAL[backend] = RunnerCache(RunnerConfig(moe_runner_backend=backend))
    return _FUNCTIONAL[backend]
