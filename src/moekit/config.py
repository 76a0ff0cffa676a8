"""Frozen configuration: the model's MoE shape (`MoEConfig`), parallelism (`ParallelConfig`) and
backend choice (`RunnerConfig`), with the option names of the serving engines.

Each dataclass checks itself on construction; `validate()` checks the combinations. Errors are
`ConfigError`s that name the option (as its command-line flag) and what is allowed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from moekit.log import logger

RUNNER_BACKENDS = (
    "auto",
    "triton",
    "triton_kernel",
    "deep_gemm",
    "cutlass",
    "flashinfer_trtllm",
    "flashinfer_cutlass",
    "flashinfer_mxfp4",
    "flashinfer_cutedsl",
    "w4a16",
    "torch",
)
A2A_BACKENDS = ("none", "alltoall", "deepep", "mooncake", "flashinfer", "ascend_fuseep")
DEEPEP_MODES = ("auto", "normal", "low_latency")
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
SCORING_FUNCS = ("softmax", "sigmoid")
WEIGHT_FORMATS = (
    "unquantized",
    "fp8_w8a8",
    "int8_w8a8",
    "int8_w8a16",
    "int4_w4a16",
    "mxfp4",
    "nvfp4",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# integer dtypes that expert ids and placements may come in
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class ConfigError(ValueError):
    """A configuration value or combination that cannot work; the message says which and why."""


# Config fields whose command-line option has another name.
CLI_NAMES = {"weight_format": "quantization"}


def _flag(option: str) -> str:
    return "--" + CLI_NAMES.get(option, option).replace("_", "-")


def check_choice(option: str, value: object, allowed: tuple[str, ...] | set[str]) -> None:
    """Raise a ConfigError naming `option` and the allowed values unless `value` is one of them."""
    if value not in allowed:
        raise ConfigError(
            f"{_flag(option)}: unknown value {value!r}; allowed: {', '.join(sorted(allowed))}"
        )


def _check_positive(option: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_flag(option)} must be a positive integer, got {value!r}")


def _check_bools(config: object, *options: str) -> None:
    """ConfigError unless each option of `config` is a bool ('no' would read as true)."""
    for option in options:
        value = getattr(config, option)
        if not isinstance(value, bool):
            raise ConfigError(f"{_flag(option)} must be True or False, got {value!r}")


def check_routing(
    num_experts: int,
    top_k: int,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    num_shared_experts: int = 0,
) -> None:
    """Raise a ConfigError unless top_k of num_experts (in the topk_group best of
    num_expert_group groups, given both) plus num_shared_experts fused ones can be picked."""
    _check_positive("top_k", top_k)
    if top_k > num_experts:
        raise ConfigError(f"--top-k ({top_k}) must be at most --num-experts ({num_experts})")
    if not isinstance(num_shared_experts, int) or num_shared_experts < 0:
        raise ConfigError(
            f"--num-shared-experts must be an integer >= 0, got {num_shared_experts!r}"
        )
    if (num_expert_group is None) != (topk_group is None):
        raise ConfigError("--num-expert-group and --topk-group must be given together")
    if num_expert_group is None:
        return
    _check_positive("num_expert_group", num_expert_group)
    _check_positive("topk_group", topk_group)
    if num_experts % num_expert_group:
        raise ConfigError(
            f"--num-expert-group ({num_expert_group}) must divide --num-experts ({num_experts})"
        )
    if topk_group > num_expert_group:
        raise ConfigError(
            f"--topk-group ({topk_group}) must be at most --num-expert-group ({num_expert_group})"
        )
    if top_k > topk_group * (num_experts // num_expert_group):
        raise ConfigError(
            f"--top-k ({top_k}) exceeds the experts in --topk-group ({topk_group}) groups of "
            f"{num_experts // num_expert_group}"
        )


@dataclass(frozen=True)
class MoEConfig:
    """The MoE block of one model layer (global, unsharded sizes).

    num_experts E, top_k K, hidden_size H, intermediate_size I (per expert, before TP slicing).
    activation: 'silu' (SwiGLU), 'gelu' (GeGLU, exact erf) or 'swiglu_oai' (gpt-oss: clamp to
    `swiglu_limit`, gate * sigmoid(alpha * gate) * (up + 1)).
    interleaved: w13 rows alternate gate/up instead of all gate rows then all up rows.
    num_shared_experts: shared experts fused as extra routed columns with weight 1 (their
    intermediate size must equal I).
    dtype: of activations and unquantized weights, 'bfloat16', 'float16' or 'float32' (or the
    torch dtype, kept as its name).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved: bool = False
    has_bias: bool = False
    scoring_func: str = "softmax"
    renormalize: bool = True
    num_expert_group: int | None = None
    topk_group: int | None = None
    use_correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    dtype: str = "bfloat16"
    weight_format: str = "unquantized"

    def __post_init__(self) -> None:
        for option in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            _check_positive(option, getattr(self, option))
        check_routing(self.num_experts, self.top_k, self.num_expert_group, self.topk_group,
                      self.num_shared_experts)  # fmt: skip
        _check_bools(self, "interleaved", "has_bias", "renormalize", "use_correction_bias")
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("scoring_func", self.scoring_func, SCORING_FUNCS)
        if isinstance(self.dtype, torch.dtype):  # torch.bfloat16 -> 'bfloat16'
            name = {d: n for n, d in DTYPES.items()}.get(self.dtype, self.dtype)
            object.__setattr__(self, "dtype", name)
        check_choice("dtype", self.dtype, set(DTYPES))
        check_choice("weight_format", self.weight_format, WEIGHT_FORMATS)
        if self.swiglu_limit <= 0:
            raise ConfigError(f"--swiglu-limit must be > 0, got {self.swiglu_limit}")

    @classmethod
    def from_hf(cls, path) -> "MoEConfig":
        """The MoE block of a Hugging Face config.json (the file or the model directory): the
        routed experts' shape and routing (`moekit.hf_config`; what it leaves out is logged)."""
        from moekit.hf_config import load_hf_config

        return load_hf_config(path).config

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_experts(self) -> int:
        """Routed plus fused shared experts: the expert slots a layer holds weights for."""
        return self.num_experts + self.num_shared_experts

    @property
    def total_top_k(self) -> int:
        """Columns of the routing output: top_k routed plus the fused shared experts."""
        return self.top_k + self.num_shared_experts


@dataclass(frozen=True)
class ParallelConfig:
    """How one MoE layer is spread over ranks (the serving engines' flags).

    moe_tp_size = tp_size / ep_size: each expert's intermediate size is split over moe_tp ranks,
    and the experts over ep ranks. A `moe_a2a_backend` other than 'none' sets ep_size = tp_size.
    enable_eplb: each layer records its expert load from the start (`MoE.record_expert_load`;
    the placement changes only when `moekit.eplb.rebalance_` is called, or every
    eplb_rebalance_num_iterations steps of a `moekit.eplb.ExpertBalancer`).
    """

    tp_size: int = 1
    ep_size: int = 1
    moe_dense_tp_size: int | None = None
    moe_a2a_backend: str = "none"
    deepep_mode: str = "auto"
    ep_num_redundant_experts: int = 0
    max_dispatch_tokens_per_rank: int = 128
    enable_eplb: bool = False
    eplb_rebalance_num_iterations: int = 1000

    def __post_init__(self) -> None:
        _check_positive("tp_size", self.tp_size)
        _check_positive("ep_size", self.ep_size)
        _check_bools(self, "enable_eplb")
        check_choice("moe_a2a_backend", self.moe_a2a_backend, A2A_BACKENDS)
        check_choice("deepep_mode", self.deepep_mode, DEEPEP_MODES)
        if self.moe_dense_tp_size not in (None, 1):
            raise ConfigError(
                f"--moe-dense-tp-size: only 1 (or unset) is supported, got {self.moe_dense_tp_size}"
            )
        if not isinstance(self.ep_num_redundant_experts, int) or self.ep_num_redundant_experts < 0:
            raise ConfigError(
                f"--ep-num-redundant-experts must be an integer >= 0, got "
                f"{self.ep_num_redundant_experts!r}"
            )
        _check_positive("max_dispatch_tokens_per_rank", self.max_dispatch_tokens_per_rank)
        _check_positive("eplb_rebalance_num_iterations", self.eplb_rebalance_num_iterations)
        if self.moe_a2a_backend != "none" and self.ep_size != self.tp_size:
            logger.log(
                logging.WARNING,
                f"--moe-a2a-backend {self.moe_a2a_backend} sets --ep-size to --tp-size "
                f"({self.ep_size} -> {self.tp_size})",
            )
            object.__setattr__(self, "ep_size", self.tp_size)
        if self.tp_size % self.ep_size:
            raise ConfigError(
                f"--ep-size ({self.ep_size}) must divide --tp-size ({self.tp_size}): "
                "moe_tp_size = tp_size / ep_size"
            )

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size


@dataclass(frozen=True)
class RunnerConfig:
    """Which runner backend runs the experts.

    moe_runner_backend 'auto' lets `moekit.select` decide. With enable_adaptive_moe, batches of
    fewer than adaptive_moe_batch_threshold tokens run on 'triton' and larger ones on
    'triton_kernel'.
    """

    moe_runner_backend: str = "auto"
    enable_adaptive_moe: bool = False
    adaptive_moe_batch_threshold: int = 1024

    def __post_init__(self) -> None:
        check_choice("moe_runner_backend", self.moe_runner_backend, RUNNER_BACKENDS)
        _check_bools(self, "enable_adaptive_moe")
        _check_positive("adaptive_moe_batch_threshold", self.adaptive_moe_batch_threshold)
        if self.enable_adaptive_moe and self.moe_runner_backend not in ("auto", "triton"):
            raise ConfigError(
                "--enable-adaptive-moe switches between triton and triton_kernel; it needs "
                f"--moe-runner-backend auto or triton, got {self.moe_runner_backend!r}"
            )


def validate(
    moe: MoEConfig, parallel: ParallelConfig = ParallelConfig(), runner: RunnerConfig = RunnerConfig()
) -> None:
    """Check the combination of the three configs; raise ConfigError naming the options."""
    if moe.intermediate_size % parallel.moe_tp_size:
        raise ConfigError(
            f"--intermediate-size ({moe.intermediate_size}) must be divisible by moe_tp_size = "
            f"--tp-size / --ep-size = {parallel.tp_size} / {parallel.ep_size} = "
            f"{parallel.moe_tp_size}"
        )
    slots = moe.total_experts + parallel.ep_num_redundant_experts
    if slots % parallel.ep_size:
        raise ConfigError(
            f"experts ({moe.num_experts} routed + {moe.num_shared_experts} shared + "
            f"{parallel.ep_num_redundant_experts} redundant = {slots}) must be divisible by "
            f"--ep-size ({parallel.ep_size})"
        )
    if moe.num_shared_experts and parallel.ep_size > 1:
        raise ConfigError(
            "--num-shared-experts > 0 (shared experts fused as routed columns) needs --ep-size 1: "
            "a fused shared expert on one rank would take every token"
        )
    backend = runner.moe_runner_backend
    if backend == "flashinfer_cutlass":
        if moe.weight_format not in ("unquantized", "nvfp4"):
            raise ConfigError(
                "--moe-runner-backend flashinfer_cutlass needs --quantization unquantized "
                f"(SM90+) or nvfp4 (SM100), got {moe.weight_format!r}"
            )
        if parallel.ep_size not in (1, parallel.tp_size):
            raise ConfigError(
                "--moe-runner-backend flashinfer_cutlass needs --ep-size 1 or --ep-size equal "
                f"to --tp-size ({parallel.tp_size}), got {parallel.ep_size}"
            )
    if backend == "cutlass" and moe.weight_format == "fp8_w8a8" and parallel.ep_size != 1:
        raise ConfigError(
            f"--moe-runner-backend cutlass with fp8 weights needs --ep-size 1, got {parallel.ep_size}"
        )


def per_rank(moe: MoEConfig, parallel: ParallelConfig) -> MoEConfig:
    """The shape one rank computes: I / moe_tp_size. (Experts per rank come from the placement.)"""
    validate(moe, parallel)
    return replace(moe, intermediate_size=moe.intermediate_size // parallel.moe_tp_size)
