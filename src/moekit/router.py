"""Top-k routing: router logits -> `TopKOutput` (weights float32, ids int32).

Pure tensor code with no host synchronisation, so it can be captured in a CUDA graph:
`select_experts` in PyTorch ops (the reference), `select_experts_fused` as one Triton kernel
(a layer takes it for CUDA logits unless built with MOEKIT_FUSED_ROUTER=0; under torch.compile
as the custom op `moekit::route`). `route` can also count the routed pairs per expert (EPLB's
load recorder): inside the kernel, else with `count_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from moekit import envs, hardware
from moekit._triton_host import cdiv, interpret_mode, next_pow2, pdl_capable
from moekit.config import INT_DTYPES, ConfigError, MoEConfig, check_routing

# the fused kernel's widest row: E experts rounded up to a power of two
FUSED_MAX_EXPERTS = 1024
# where `route` takes the fused kernel: CUDA logits / also the CPU interpreter / never
FUSED_MODES = ("auto", "on", "off")


class TopKOutput(NamedTuple):
    """weights [T, K] float32 and ids [T, K] int32; an id of -1 marks a masked (unused) slot."""

    weights: torch.Tensor
    ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


# (router_logits [T, E], top_k, renormalize) -> (weights [T, K], ids [T, K])
CustomRoutingFunction = Callable[[torch.Tensor, int, bool], "tuple[torch.Tensor, torch.Tensor]"]


def _scores(logits_TE: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = logits_TE.float()
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"scoring_func: unknown {scoring_func!r}; allowed: softmax, sigmoid")


def _group_keep(choice_TE: torch.Tensor, num_groups: int, topk_group: int, biased: bool):
    """[T, G] bool: the `topk_group` best of each token's `num_groups` expert groups.

    A group's score is its best expert (or, with a correction bias, the sum of its best two, as
    in DeepSeek-V3)."""
    T, E = choice_TE.shape
    grouped = choice_TE.view(T, num_groups, E // num_groups)
    if biased and E // num_groups >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best_groups = group_scores.topk(topk_group, dim=-1).indices
    return torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)


def _check_arguments(router_logits_TE, top_k, scoring_func, num_expert_group, topk_group,
                     correction_bias_E, num_fused_shared_experts) -> None:
    """The checks of select_experts and select_experts_fused: ValueError naming the option."""
    if router_logits_TE.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {list(router_logits_TE.shape)}")
    E = router_logits_TE.shape[1]
    check_routing(E, top_k, num_expert_group, topk_group, num_fused_shared_experts)
    if correction_bias_E is not None and correction_bias_E.shape != (E,):
        raise ValueError(
            f"correction_bias must be [E] = [{E}], got {list(correction_bias_E.shape)}"
        )
    if scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring_func: unknown {scoring_func!r}; allowed: softmax, sigmoid")


def select_experts(
    router_logits_TE: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias_E: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    num_fused_shared_experts: int = 0,
    custom_routing_function: CustomRoutingFunction | None = None,
) -> TopKOutput:
    """Pick top_k experts per token.

    router_logits_TE [T, E] any float dtype. Scores are softmax or sigmoid of the logits; the
    choice uses scores + correction_bias_E (DeepSeek-V3) but the weights are the unbiased scores.
    Grouped top-k first keeps the `topk_group` best of `num_expert_group` groups. Weights are
    renormalised to sum to 1 (if asked), then multiplied by routed_scaling_factor. Fused shared
    experts are appended as columns with ids E, E+1, ... and weight 1.
    Returns TopKOutput with K = top_k + num_fused_shared_experts columns.
    """
    _check_arguments(router_logits_TE, top_k, scoring_func, num_expert_group, topk_group,
                     correction_bias_E, num_fused_shared_experts)  # fmt: skip
    return _select(router_logits_TE, top_k, scoring_func, renormalize, num_expert_group,
                   topk_group, correction_bias_E, routed_scaling_factor,
                   num_fused_shared_experts, custom_routing_function)  # fmt: skip


def _select(
    router_logits_TE: torch.Tensor,
    top_k: int,
    scoring_func: str,
    renormalize: bool,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias_E: torch.Tensor | None,
    routed_scaling_factor: float,
    num_fused_shared_experts: int,
    custom_routing_function: CustomRoutingFunction | None,
) -> TopKOutput:
    """`select_experts` on options already checked (a MoEConfig's, or select_experts' own)."""
    T, E = router_logits_TE.shape
    if custom_routing_function is not None:
        weights, ids = custom_routing_function(router_logits_TE, top_k, renormalize)
        if (
            weights.shape != (T, top_k) or ids.shape != (T, top_k)
            or not weights.dtype.is_floating_point or ids.dtype not in INT_DTYPES
        ):  # fmt: skip
            raise ValueError(
                f"custom_routing_function must return (weights [T, top_k] = [{T}, {top_k}] "
                f"float, ids [T, top_k] int), got {weights.dtype} {list(weights.shape)} and "
                f"{ids.dtype} {list(ids.shape)}"
            )
        weights, ids = weights.float(), ids.to(torch.int32)
    else:
        scores = _scores(router_logits_TE, scoring_func)
        choice = scores if correction_bias_E is None else scores + correction_bias_E.float()
        if num_expert_group is not None and num_expert_group > 1:
            keep_TG = _group_keep(choice, num_expert_group, topk_group,
                                  correction_bias_E is not None)  # fmt: skip
            grouped = choice.view(T, num_expert_group, E // num_expert_group)
            choice = torch.where(keep_TG.unsqueeze(-1), grouped, float("-inf")).view(T, E)
        picked = choice.topk(top_k, dim=-1)
        # the chosen scores: topk's own values where the choice is the scores (one op less)
        weights = picked.values if choice is scores else scores.gather(1, picked.indices)
        ids = picked.indices.to(torch.int32)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    if num_fused_shared_experts:
        shared_ids = torch.arange(
            E, E + num_fused_shared_experts, device=ids.device, dtype=torch.int32
        ).expand(T, num_fused_shared_experts)
        ids = torch.cat([ids, shared_ids], dim=1)
        weights = torch.cat([weights, weights.new_ones(T, num_fused_shared_experts)], dim=1)
    return TopKOutput(weights.contiguous(), ids.contiguous())


def count_experts(ids_TK: torch.Tensor, counts_N: torch.Tensor) -> None:
    """Add the pairs of ids [T, K] per expert to counts [N] int64, in place (no host
    synchronisation); ids outside [0, N) (-1: a masked slot) are not counted."""
    ids = ids_TK.reshape(-1).to(torch.int64)
    inside = (ids >= 0) & (ids < counts_N.shape[0])
    counts_N.index_add_(0, ids.clamp(0, counts_N.shape[0] - 1), inside.to(torch.int64))


def fused_mode(value: str) -> str:
    """A MOEKIT_FUSED_ROUTER value as one of FUSED_MODES."""
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    if v in ("1", "true", "yes", "on"):
        return "on"
    if v in ("0", "false", "no", "off"):
        return "off"
    raise ConfigError(
        f"{envs.MOEKIT_FUSED_ROUTER.name}={value!r}; allowed: auto (the fused routing kernel for "
        f"CUDA logits), 1 / on (also under the CPU interpreter), 0 / off (PyTorch ops)"
    )


def fused_problem(router_logits_TE: torch.Tensor, custom_routing_function=None) -> str | None:
    """Why `select_experts_fused` cannot route these logits (None: it can)."""
    if custom_routing_function is not None:
        return "a custom routing function runs as it is"
    return _fused_problem(router_logits_TE.device.type, router_logits_TE.dtype,
                          router_logits_TE.shape[-1], _has_triton)


@torch.compiler.assume_constant_result
def _has_triton() -> bool:
    """Triton is importable and not turned off (a constant of a compiled graph)."""
    return hardware.detect().has("triton")


def _fused_problem(device: str, dtype: torch.dtype, num_experts: int,
                   has_triton: Callable[[], bool]) -> str | None:
    if device != "cuda" and not interpret_mode():
        return "needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)"
    if not has_triton():
        return f"needs Triton (not importable, or {envs.MOEKIT_DISABLE_TRITON.name}=1)"
    if not dtype.is_floating_point:
        return f"needs float logits, got {dtype}"
    if num_experts > FUSED_MAX_EXPERTS:
        return f"at most {FUSED_MAX_EXPERTS} experts, got {num_experts}"
    return None


def explain_routing(mode: str, platform: hardware.Platform, num_experts: int,
                    num_tokens: int | None = None, top_k: int = 1) -> str:
    """Which routing a layer built under `mode` (one of FUSED_MODES) takes for float logits of
    `num_experts` experts on `platform`'s device, and why (`moekit env --explain`); with
    num_tokens, also how the kernel runs them (bf16 and float32 logits, top_k picked)."""
    name = envs.MOEKIT_FUSED_ROUTER.name
    if mode == "off":
        return f"PyTorch ops (select_experts): {name}=0"
    if mode == "auto" and not platform.is_cuda:
        return f"PyTorch ops (select_experts): {name}=auto takes the kernel for CUDA logits only"
    problem = _fused_problem(platform.device, torch.float32, num_experts,
                             lambda: platform.has("triton"))  # fmt: skip
    if problem:
        return f"PyTorch ops (select_experts): the fused kernel {problem}"
    said = (f"one Triton kernel (select_experts_fused; {name}={mode}; under torch.compile the "
            f"op moekit::route); the PyTorch ops with a custom routing function")
    if not num_tokens:
        return said
    bf16, fp32 = (route_launch(num_tokens, num_experts, top_k, b).describe() for b in (2, 4))
    return f"{said}; at T = {num_tokens}: bf16 logits {bf16}; float32 logits {fp32}"


def select_experts_fused(
    router_logits_TE: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias_E: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    num_fused_shared_experts: int = 0,
) -> TopKOutput:
    """`select_experts` (its twin, same arguments but a custom routing function) in one Triton
    launch: a program routes a block of tokens, its [tokens, E] scores in registers. Ties in the
    choice may pick another of the tied experts than torch.topk."""
    _check_arguments(router_logits_TE, top_k, scoring_func, num_expert_group, topk_group,
                     correction_bias_E, num_fused_shared_experts)  # fmt: skip
    problem = fused_problem(router_logits_TE)
    if problem:
        raise ValueError(f"select_experts_fused: {problem}")
    return _select_fused(router_logits_TE, top_k, scoring_func, renormalize, num_expert_group,
                         topk_group, correction_bias_E, routed_scaling_factor,
                         num_fused_shared_experts)  # fmt: skip


@dataclass(frozen=True)
class RouteKernelConfig:
    """Launch choices of the fused routing kernel that do not change its result, as timed on
    the H100 (session 75, benchmarks/integration_notes.md).

    num_warps: warps a program; 0: one for a one-token program (its row reductions then stay
    inside the warp: deepseek-v3 at T = 1 9.6 -> 5.9 us), else 4. group_tile: grouped top-k
    (G > 1) scores the groups from a [tokens, G, E / G] view of the row, three reductions in
    all, instead of three per group over the whole row, where E and G are powers of two
    (deepseek-v3: 1.3-1.8x at every T). count: how the EPLB load is added (with counts): 1 an
    atomic add per pair (a program's pairs in one vector add after its top-k); 2 one add per
    expert a program picked (fewer adds where a program's pairs share experts: mixtral, qwen3),
    its picks summed over the program's tokens; 3 the same adds, counted by a histogram of the
    program's ids (qwen3's sm_90 build at 8 tokens a program: 6 barriers against mode 2's 13;
    not yet timed on a GPU, so never chosen by default); 0: `count_mode`'s choice."""

    num_warps: int = 0
    group_tile: bool = True
    count: int = 0

    def __post_init__(self):
        if self.count not in (0, 1, 2, 3):
            raise ValueError(f"RouteKernelConfig.count must be 0 (count_mode's choice), 1 (per "
                             f"pair), 2 or 3 (per expert a program), got {self.count!r}")
        if self.num_warps not in (0, 1, 2, 4, 8):
            raise ValueError(f"RouteKernelConfig.num_warps must be 0 (the default rule), 1, 2, "
                             f"4 or 8, got {self.num_warps!r}")


ROUTE_KERNEL = RouteKernelConfig()


def _select_fused(logits_TE, top_k, scoring_func, renormalize, num_expert_group, topk_group,
                  correction_bias_E, routed_scaling_factor, num_shared,
                  counts=None) -> TopKOutput:
    """`select_experts_fused` on checked options; with counts [E + S] int64 (on the logits'
    device) the kernel also adds its pairs per expert to them (what `count_experts` adds)."""
    from moekit import _router_kernels as k

    T, E = logits_TE.shape
    width = top_k + num_shared
    weights = torch.empty(T, width, dtype=torch.float32, device=logits_TE.device)
    ids = torch.empty(T, width, dtype=torch.int32, device=logits_TE.device)
    if T == 0:
        return TopKOutput(weights, ids)
    logits = logits_TE if logits_TE.stride(1) == 1 else logits_TE.contiguous()
    bias = None if correction_bias_E is None else correction_bias_E.float().contiguous()
    groups = num_expert_group if num_expert_group and num_expert_group > 1 else 1
    EP = next_pow2(E)
    launch = route_launch(T, E, top_k, logits.element_size())
    block_t = launch.tokens_per_program
    k._route_kernel[(cdiv(T, block_t),)](
        logits, logits if bias is None else bias, weights, ids,
        weights if counts is None else counts, T, E, logits.stride(0),
        float(routed_scaling_factor), K=top_k, S=num_shared,
        SCORE=k.SCORE_SOFTMAX if scoring_func == "softmax" else k.SCORE_SIGMOID,
        HAS_BIAS=bias is not None, RENORM=bool(renormalize), G=groups,
        TOPK_GROUP=topk_group if groups > 1 else 1,
        TOP2=bias is not None and E // groups >= 2,
        COUNT=0 if counts is None else launch.count,
        GROUP_TILE=ROUTE_KERNEL.group_tile and groups > 1 and E == EP,  # G divides E: a power of 2
        GDC_LAUNCH=pdl_capable(logits.device), BLOCK_T=block_t, EP=EP,
        KP=next_pow2(top_k), SP=next_pow2(max(num_shared, 1)), GP=next_pow2(groups),
        num_warps=launch.num_warps,
    )  # fmt: skip
    return TopKOutput(weights, ids)


class RouteLaunch(NamedTuple):
    """How the routing kernel runs T tokens: tokens and warps a program, and the EPLB count
    mode where it counts (1 an add per pair, 2 / 3 per expert a program). A tuple: made on every
    routing call, at half a frozen dataclass's host cost."""

    tokens_per_program: int
    num_warps: int
    count: int

    def describe(self) -> str:
        n = self.tokens_per_program
        return (f"{n} token{'s' if n > 1 else ''} a program, {self.num_warps} "
                f"warp{'s' if self.num_warps > 1 else ''}, a recorded load counted "
                f"{'per pair' if self.count == 1 else 'per expert a program'}"
                f"{' (histogram)' if self.count == 3 else ''}")


def route_launch(T: int, E: int, K: int, score_bytes: int) -> RouteLaunch:
    """The routing kernel's launch for T tokens of E experts' logits (score_bytes each), K
    picked: `ROUTE_KERNEL`'s choices, else the measured rules below."""
    EP = next_pow2(E)
    block_t = tokens_per_program(T, EP, score_bytes)
    cfg = ROUTE_KERNEL
    return RouteLaunch(block_t, cfg.num_warps or (1 if block_t == 1 else 4),
                       cfg.count or count_mode(T, EP, K, block_t))


def tokens_per_program(T: int, EP: int, score_bytes: int = 2) -> int:
    """Tokens one program of the fused routing kernel takes: at most 8, and its [tokens, EP]
    tile at most 2 KiB of logits (EP: the experts rounded up to a power of two), so that each
    of its 4 warps holds whole rows (a warp's 16-byte loads cover 512 bytes); one token (and
    warp) where a row is wider than that (512+ experts in bf16, 256+ in float32), whose row
    reductions would otherwise cross warps. Measured on an H200 and an H100 (sessions 74-76):
    the top-k is a chain of row reductions, so many small programs beat few wide ones
    (deepseek-v3 at T = 16: 5.9 us with 4 tokens a program, 23 with 16), down to that tile
    (qwen3 at T = 16384, H100: 18.4 us with 8, 22.5 with 4); kimi-k2's 384 experts route
    1.04-1.07x faster one token a program than two; on float32 logits, deepseek-v3 1.3-1.8x
    faster one token a program than four, qwen3 and gpt-oss 1.3-1.4x (T = 16) four than
    eight."""
    row = EP * score_bytes
    if row > 512:
        return 1
    return max(1, min(next_pow2(T), 8, 2048 // row))


def count_mode(T: int, EP: int, K: int, block_t: int) -> int:
    """The routing kernel's EPLB counting for T tokens of K routed pairs over EP experts (a
    power of two), block_t tokens a program: for at most 128 experts, 2 (one add per expert a
    program picked) where a program takes one token or where the counters contend (64+ pairs
    each on average), else 1 (an add per pair: no [tokens, EP] sum across warps); 1 for wider
    rows. On the H100 (session 77, the per-expert sum in int32), qwen3 at T = 16 ... 256
    counted 0.3-0.5 us faster per pair (gpt-oss within 0.2 us either way); per expert, qwen3
    at T = 1024 0.4 us faster, at T = 4096 / 16384 1.36x / 1.61x, mixtral 1.2x / 2.2x and
    gpt-oss 1.03x / 1.11x."""
    if EP > 128:
        return 1
    return 2 if block_t == 1 or T * K >= 64 * EP else 1


def route(
    router_logits_TE: torch.Tensor,
    config: MoEConfig,
    correction_bias_E: torch.Tensor | None = None,
    custom_routing_function: CustomRoutingFunction | None = None,
    fused: str = "off",
    counts_N: torch.Tensor | None = None,
) -> TopKOutput:
    """`select_experts` with the routing options of a `MoEConfig`, which checked them when it
    was made (the layer's forward checks the logits' shape, so nothing is checked twice a call):
    router_logits [T, config.num_experts], correction_bias [config.num_experts]. `fused` (one of
    FUSED_MODES; a layer's MOEKIT_FUSED_ROUTER): `select_experts_fused` for CUDA logits ('auto')
    or wherever it can run ('on'); under torch.compile as one custom op, `moekit::route`.
    counts [config.total_experts] int64 on the logits' device: the routed pairs per expert are
    added to it (by the kernel itself where it runs, else by `count_experts`)."""
    if fused not in FUSED_MODES:
        raise ValueError(f"route: fused must be one of {', '.join(FUSED_MODES)}, got {fused!r}")
    c = config
    if (
        (fused == "on" or (fused == "auto" and router_logits_TE.is_cuda))
        and fused_problem(router_logits_TE, custom_routing_function) is None
    ):  # fmt: skip
        if not torch.compiler.is_compiling():
            return _select_fused(router_logits_TE, c.top_k, c.scoring_func, c.renormalize,
                                 c.num_expert_group, c.topk_group, correction_bias_E,
                                 c.routed_scaling_factor, c.num_shared_experts,
                                 counts_N)  # fmt: skip
        weights, ids = route_op(
            router_logits_TE, correction_bias_E, c.top_k, c.scoring_func, c.renormalize,
            c.num_expert_group or 1, c.topk_group or 1, float(c.routed_scaling_factor),
            c.num_shared_experts, counts_N,
        )  # fmt: skip
        return TopKOutput(weights, ids)
    out = _select(router_logits_TE, c.top_k, c.scoring_func, c.renormalize, c.num_expert_group,
                  c.topk_group, correction_bias_E, c.routed_scaling_factor, c.num_shared_experts,
                  custom_routing_function)  # fmt: skip
    if counts_N is not None:
        count_experts(out.ids, counts_N)
    return out


@torch.library.custom_op("moekit::route", mutates_args=("counts_N",))
def route_op(
    router_logits_TE: torch.Tensor,
    correction_bias_E: Optional[torch.Tensor],
    top_k: int,
    scoring_func: str,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    num_shared: int,
    counts_N: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused routing as a custom op, for torch.compile: (weights [T, K + S] float32, ids
    [T, K + S] int32); num_expert_group / topk_group 1 where the routing has no groups; the
    pairs per expert added to counts [E + S] int64 when given."""
    out = _select_fused(router_logits_TE, top_k, scoring_func, renormalize, num_expert_group,
                        topk_group, correction_bias_E, routed_scaling_factor, num_shared,
                        counts_N)  # fmt: skip
    return out.weights, out.ids


@route_op.register_fake
def _route_op_fake(router_logits_TE, correction_bias_E, top_k, scoring_func, renormalize,
                   num_expert_group, topk_group, routed_scaling_factor, num_shared, counts_N):
    shape = (router_logits_TE.shape[0], top_k + num_shared)
    return (router_logits_TE.new_empty(shape, dtype=torch.float32),
            router_logits_TE.new_empty(shape, dtype=torch.int32))  # fmt: skip
