"""`moekit tune`: sweep the `triton` runner's kernel configs on this device and write the tables
the runner looks up (`moekit.runners.triton.configs`).

For each batch size T: draw uniform random top-k routings over this rank's experts (as many as
the bench times the point on, `rotations`), time every candidate config of the gate_up GEMM
(CUDA-graph replay, `moekit.bench.time_ms`), then every candidate of the down GEMM (+ its
reduction over K) on the best gate_up output, check the chosen pair against the torch
reference, time the whole layer in turns with it, with the pairs of configs that tie with it
alone (`near_ties`) and with the pair the runner ran before the tune (its incumbent: the
existing entry, another Triton version's table, the nearest tuned shape's or the heuristic)
and keep the fastest, time the layer's roofline floor, and save both tables. Results are
written after each batch size, so an interrupted run resumes where it stopped (batch sizes
already in the output files are skipped unless `force`).

The search is two rounds per GEMM: tile shapes (block_m/n/k, swap_ab, TMA or pointer loads) at
a schedule typical of the regime (tiles sized by the weight format's bytes: `tile_bytes`), then
warps (also 2 for small weight-only tiles) / stages / group_m for the two best tile shapes; for
`down` the reduction 'atomic' is tried on the three best; at decode batches split-K on the two
best (down: the two best atomic ones; `SPLIT_K_TRIES`). Kernels are compiled in parallel
threads before they are timed. `measure` times the runner as shipped (the configs it looks up)
against the floor, with uniform or Zipf-skewed routing.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from moekit._triton_host import interpret_mode
from moekit.config import DTYPES, ConfigError
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.router import TopKOutput
from moekit.runners._tables import device_key, quant_tag, table_key, triton_version
from moekit.runners.triton import configs as tcfg
from moekit.runners.triton.configs import GemmConfig, TableKey

BATCH_SIZES = (1, 4, 16, 64, 256, 1024, 4096, 16384)
SMEM_LIMIT = 220 * 1024  # bytes; configs estimated above it are not tried (H100: 227 KB)
# A point is timed over as many routings as `moekit bench` times it on (`bench.routings_for`),
# and over at least this many: an expert's rows differ from draw to draw, and a config that wins
# by 2% on one routing can lose on others (mixtral TP2 T = 256: benchmarks/triton_notes.md,
# session 32; deepseek-v3 EP8 T = 4, session 51)
MIN_ROUTINGS = 4


@dataclass(frozen=True)
class TuneShape:
    """One rank's MoE shape: E local experts, K top-k (<= E), H hidden, I intermediate.
    local_share: the share of a token's pairs that are local (1 / ep on an EP rank that sees
    every token: the routing is then drawn over E / local_share experts, the other ranks' ids
    -1, and T tokens are stored under the key T * local_share, `_tables.table_key`)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    dtype: str = "bfloat16"
    act: ActivationSpec = ActivationSpec()
    has_bias: bool = False
    label: str = ""
    local_share: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.local_share <= 1:
            raise ConfigError(f"TuneShape.local_share must be in (0, 1], got {self.local_share}")

    @property
    def routed_experts(self) -> int:
        """Experts the routing draws from (E on all ranks)."""
        return round(self.num_experts / self.local_share)

    def describe(self) -> str:
        bias = " +bias" if self.has_bias else ""
        inter = " interleaved" if self.act.interleaved else ""
        share = f" local {self.local_share:g}" if self.local_share < 1 else ""
        return (
            f"{self.label or 'custom'}: E={self.num_experts} K={self.top_k} H={self.hidden} "
            f"I={self.intermediate} {self.dtype} {self.act.name}{inter}{bias}{share}"
        )


def shape_for(model: str, tp_size: int = 1, ep_size: int = 1, dtype: str = "bfloat16"):
    """The per-rank shape of preset `model` at --tp-size/--ep-size: E_local = E / ep,
    I_local = I / (tp / ep), K = min(top_k + shared experts, E_local), local share 1 / ep (the
    rank sees every token, as with `--moe-a2a-backend none`)."""
    from moekit.presets import model_config

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown value {dtype!r}; allowed: {', '.join(DTYPES)}")
    cfg = model_config(model, dtype=dtype)
    if tp_size < 1 or ep_size < 1:
        raise ConfigError("--tp-size and --ep-size must be positive integers")
    if tp_size % ep_size:
        raise ConfigError(f"--ep-size ({ep_size}) must divide --tp-size ({tp_size})")
    moe_tp = tp_size // ep_size
    experts = cfg.num_experts + cfg.num_shared_experts
    if experts % ep_size:
        raise ConfigError(f"--ep-size ({ep_size}) must divide the experts ({experts})")
    if cfg.intermediate_size % moe_tp:
        raise ConfigError(
            f"--tp-size / --ep-size ({moe_tp}) must divide the intermediate size "
            f"({cfg.intermediate_size})"
        )
    e_local = experts // ep_size
    return TuneShape(
        num_experts=e_local,
        top_k=min(cfg.top_k + cfg.num_shared_experts, e_local),
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size // moe_tp,
        dtype=dtype,
        act=ActivationSpec.from_config(cfg),
        has_bias=cfg.has_bias,
        label=f"{model} tp{tp_size} ep{ep_size}",
        local_share=e_local / experts,
    )


# ---------------------------------------------------------------------------------------------
# Search space
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileBytes:
    """What one K step of a GEMM main loop loads, per element, for one weight format (the
    shared-memory estimate `smem_bytes` and the round-2 warp choice read it).

    act: bytes per activation element of the A tile [BM, BK] (the activation dtype; 1 for
    w8a8 formats, whose GEMMs read pre-quantized fp8 / int8 activations, except fp8
    'token_group', which may quantize its bf16 / fp16 input tile itself at tiny batches).
    weight: bytes per weight element of the weight tile(s) [BK, BN] (0.5 for packed 4-bit).
    scale: bytes per weight row of the scales (+ zero points) read per K step and scale group
    of `group` K columns (None: one group per step); act_scale: bytes per A row of the
    activation scales read per K step (w8a8 per-token-group).
    packed: the weight tile is dequantized in registers (int4_w4a16, mxfp4, nvfp4).
    weight_only: activations stay in the activation dtype (w8a16, w4a16, mxfp4, nvfp4)."""

    act: float = 2
    weight: float = 2
    scale: float = 0
    group: int | None = None
    act_scale: float = 0
    packed: bool = False
    weight_only: bool = False

    def scale_groups(self, block_k: int) -> int:
        """Scale groups a weight row reads per K step of block_k columns."""
        if not self.scale:
            return 0
        return 1 if self.group is None else max(1, block_k // self.group)


def tile_bytes(spec, act_bytes: int = 2) -> TileBytes:
    """The per-step loads of weight format `spec` (a QuantSpec, or None: unquantized) with
    activations of `act_bytes` bytes (as `runners.triton.ops.WeightQuant` reads them):
    packed 4-bit: half a byte per weight, their group scales (+ uint8 zero points when
    asymmetric) every step; int8_w8a16: one float32 scale per row every step (`_w_tile`);
    w8a8: one byte per weight and activation, float32 weight-block / activation-group scales
    every step where they are per group (per-tensor / per-row ones only in the epilogue)."""
    if spec is None:
        return TileBytes(act=act_bytes, weight=act_bytes)
    if spec.pack_factor == 2:
        zero = 1 if spec.has_zero else 0
        return TileBytes(act=act_bytes, weight=0.5, scale=spec.scale_dtype.itemsize + zero,
                         group=spec.group_size, packed=True, weight_only=True)  # fmt: skip
    if spec.weight_only:  # int8_w8a16
        return TileBytes(act=act_bytes, weight=1, scale=4, weight_only=True)
    token_group = spec.act_scheme == "token_group"
    block = getattr(spec, "weight_scale", "channel") == "block"
    return TileBytes(
        act=act_bytes if token_group and spec.name == "fp8_w8a8" else 1,
        weight=1,
        scale=4 if block else 0,
        act_scale=4 if token_group else 0,
    )


def _tile_bytes(elem: TileBytes | int) -> TileBytes:
    return elem if isinstance(elem, TileBytes) else tile_bytes(None, elem)


# Rows of a weight tile a warp must hold for Triton to feed packed bytes to the MMA through
# ldmatrix; with fewer, the dequantized tile goes through shared memory once more (SASS of the
# H100 int4 gate_up, benchmarks/triton_notes.md).
LDMATRIX_ROWS_PER_WARP = 32


def smem_bytes(gemm: str, c: GemmConfig, elem: TileBytes | int = 2) -> int:
    """Estimated shared memory of one program (bytes): num_stages x one K step's loads (A tile
    [BM, BK], the weight tile(s) [BK, BN] (two for gate_up: gate and up), the scales read in
    the step), plus, for packed formats with fewer than LDMATRIX_ROWS_PER_WARP rows of a
    weight tile per warp, one dequantized tile [BK, BN] in the activation dtype. `elem`: a
    `TileBytes`, or the bytes of an unquantized element.

    An upper bound at the two points measured (ncu, H100, Triton 3.6, deepseek int4 T = 16):
    gate_up 16x64x128 / 4 warps / 3 stages 54016 estimated vs 40960 allocated; down
    16x128x128 / 4 warps / 5 stages 62720 vs 49408. Both allocations match num_stages - 1
    step buffers (+ the 16 KB dequantized tile for that gate_up); counting num_stages, and
    the scales, which the kernels load one step ahead into registers, keeps it on the safe
    side (a config over the real limit only fails to compile, and is skipped)."""
    tb = _tile_bytes(elem)
    tiles = 2 if gemm == "gate_up" else 1
    rows = tiles * c.block_n
    step = (
        c.block_m * c.block_k * tb.act
        + rows * c.block_k * tb.weight
        + rows * tb.scale_groups(c.block_k) * tb.scale
        + c.block_m * tb.act_scale
    )
    total = c.num_stages * step
    if tb.packed and c.block_n < LDMATRIX_ROWS_PER_WARP * c.num_warps:
        total += c.block_k * c.block_n * tb.act
    return math.ceil(total)


def fits(gemm: str, c: GemmConfig, n: int, k: int, elem: TileBytes | int = 2) -> bool:
    """Whether config `c` is worth compiling for GEMM `gemm` [N=n, K=k]: within the TMA box
    limit, its estimated shared memory (`smem_bytes`) within SMEM_LIMIT, blocks no larger
    than the GEMM (`configs.clamp`)."""
    box_rows = 2 * c.block_n if gemm == "gate_up" else max(c.block_n, c.block_m)
    if c.tma and box_rows > 256:
        return False  # a TMA box has at most 256 rows (interleaved gate_up: 2 * block_n)
    return smem_bytes(gemm, c, elem) <= SMEM_LIMIT and c == tcfg.clamp(gemm, c, n, k)


def tile_candidates(gemm: str, rows_per_expert: float, n: int, k: int,
                    elem: TileBytes | int = 2, quant: str = "unquantized"):  # fmt: skip
    """Round 1: tile shapes for the regime of `rows_per_expert` (mean rows per used expert),
    with and without TMA, 8 warps where the accumulators need them, within the shared memory
    (`fits`; `elem`: the format's `tile_bytes`, or the bytes of an unquantized element,
    so packed 4-bit tiles can be wider than bf16 ones). `quant` (a
    `_tables.quant_tag`): w8a8 formats take K steps of 128 (and 256 unless their scales are
    per group of 128) and, with group scales, half the accumulator area (each K step keeps a
    partial product beside the accumulator); weight-only formats load through pointers only,
    and at decode batches also try one pair per program (`ROW1_TILES`)."""
    m = rows_per_expert
    w8a8 = quant.startswith(("fp8_w8a8", "int8_w8a8"))
    grouped = w8a8 and ("block" in quant or "token_group" in quant)
    weight_only = quant != "unquantized" and not w8a8
    if m <= 12:  # weight-bandwidth bound: 16-row blocks, long K steps
        groups = [((16,), (16, 32, 64, 128), (128, 256), (False, True), 4)]
    elif m <= 48:
        groups = [((16, 32), (64, 128), (128,), (False, True), 4),
                  ((64,), (64, 128), (64,), (False,), 4)]  # fmt: skip
    elif m <= 384:
        groups = [((32, 64, 128), (64, 128), (64, 128), (False,), 3)]
    else:  # MMA / L2 bound: the largest tiles the registers allow
        groups = [((64, 128, 256), (64, 128, 256), (64,), (False,), 3)]
    if w8a8:
        steps = (128,) if grouped else (128, 256)
        groups = [(bms, bns, steps, swaps, stages) for bms, bns, _, swaps, stages in groups]
    area = 128 * 128 if grouped else 256 * 128
    group = 1 if m <= 12 else 8
    out = []
    for bms, bns, bks, swaps, stages in groups:
        for bm in bms:
            for bn in bns:
                for bk in bks:
                    for swap in swaps:
                        cols = 2 * bn if gemm == "gate_up" else bn
                        if bm * cols > area:
                            continue  # accumulators over 128 registers a thread at 8 warps
                        warps = 8 if bm * cols > area // 4 else 4
                        for tma in (False,) if weight_only else (False, True):
                            c = GemmConfig(bm, bn, bk, group, warps, stages, swap, tma=tma)
                            c = tcfg.clamp(gemm, c, n, k)
                            if fits(gemm, c, n, k, elem) and c not in out:
                                out.append(c)
    if weight_only and m <= ROW1_MAX_ROWS:
        for bn, bk, stages in ROW1_TILES:
            c = tcfg.clamp(gemm, GemmConfig(1, bn, bk, 1, 4, stages), n, k)
            if fits(gemm, c, n, k, elem) and c not in out:
                out.append(c)
    return out


# Weight-only formats at decode batches (at most ROW1_MAX_ROWS rows per used expert) also try
# one pair per program (block_m 1: products on the CUDA cores, no MMA padded to 16 rows) with
# these (block_n, block_k, stages): on the H100 they won 4-87% at T = 1 / 4 for mxfp4 and
# nvfp4 (gpt-oss, qwen3, deepseek-v3 EP8) and int4 on deepseek-v3 EP8 (triton_notes.md).
ROW1_MAX_ROWS = 1.0
ROW1_TILES = ((16, 256, 3), (32, 256, 3), (16, 512, 2), (32, 512, 2), (16, 1024, 2))


# Round 2 also tries 2 warps for weight-only formats on tiles of at most this many accumulator
# elements per weight tile (block_m x block_n): 32 rows of each weight tile per warp at
# block_n 64 (gate_up 16 x 64 / 2 warps: packed bytes through ldmatrix, triton_notes.md).
TWO_WARPS_MAX_TILE = 16 * 64

# Both searches also try these split_k (on their two best configs; down: the two best atomic
# ones) when a used expert gets at most SPLIT_K_MAX_ROWS rows: decode batches, where a GEMM has
# only a few hundred weight tiles for 132 SMs and each program streams its tile's K steps one
# by one (an EP rank at T = 1 touches one expert: 32-64 gate_up tiles).
SPLIT_K_TRIES = (2, 4)
SPLIT_K_MAX_ROWS = 16
# GEMM configs timed alone within NEAR_TIE of the fastest tie with it, and the layer decides
# between them (`_confirm`): deepseek-v3 EP8 bf16 T = 1 timed down split over K in 2 and unsplit
# at 15.04 / 15.08 us alone; through the layer unsplit is 2.8-5.0% faster (session 51,
# benchmarks/triton_notes.md). At most NEAR_TIE_MAX configs of each GEMM go into that timing.
NEAR_TIE = 1.02
NEAR_TIE_MAX = 2

# Round 2 also tries folding this many rows of a short last block into the block before (the
# pipeline folds 16): at mixtral-8x7b TP2 T = 1024 on the H100, 32 took the layer 8% further
# (benchmarks/triton_notes.md, session 37), and lost elsewhere.
FOLD_TRY = 32


def schedule_variants(gemm: str, tile: GemmConfig, n: int, k: int, elem: TileBytes | int = 2,
                      fold_rows_per_expert: float | None = None):  # fmt: skip
    """Round 2: warps and pipeline stages around one tile, and the other group_m. Warps 4
    and 8, and 2 for small tiles (block_m x block_n <= TWO_WARPS_MAX_TILE) of weight-only
    formats (`elem` a `TileBytes` with weight_only). fold_rows_per_expert: the rows per expert
    where short last blocks can fold (unquantized weights; None: they cannot): then also the
    tile folding FOLD_TRY rows instead of the pipeline's 16, for a tile that folds at all."""
    tb = _tile_bytes(elem)
    warps_options = (4, 8)
    if tb.weight_only and tile.block_m * tile.block_n <= TWO_WARPS_MAX_TILE:
        warps_options = (2, 4, 8)
    out = [replace(tile, group_m=1 if tile.group_m != 1 else 8)]
    for warps in warps_options:
        for stages in (3, 4, 5):
            out.append(replace(tile, num_warps=warps, num_stages=stages))
    folds = (fold_rows_per_expert is not None and fold_rows_per_expert >= tile.block_m
             and FOLD_TRY < tile.block_m and not tile.swap_ab and tile.split_k == 1)  # fmt: skip
    if folds:
        out.append(replace(tile, fold_rows=FOLD_TRY))
    return [c for c in out if c != tile and fits(gemm, c, n, k, tb)]


# ---------------------------------------------------------------------------------------------
# Inputs and timing
# ---------------------------------------------------------------------------------------------


def random_weights(shape: TuneShape, device) -> ExpertWeights:
    """Weights like nn.Linear's init (uniform in +-1/sqrt(fan_in)), biases small."""
    E, H, I = shape.num_experts, shape.hidden, shape.intermediate
    dt = DTYPES[shape.dtype]

    def uniform(*size, fan_in):
        return torch.empty(*size, device=device, dtype=dt).uniform_(-1, 1) / math.sqrt(fan_in)

    w13, w2 = uniform(E, 2 * I, H, fan_in=H), uniform(E, H, I, fan_in=I)
    b13 = b2 = None
    if shape.has_bias:
        b13 = torch.empty(E, 2 * I, device=device, dtype=dt).uniform_(-0.05, 0.05)
        b2 = torch.empty(E, H, device=device, dtype=dt).uniform_(-0.05, 0.05)
    return ExpertWeights(w13, w2, b13, b2)


def uniform_topk(T: int, E: int, K: int, device, generator=None) -> TopKOutput:
    """K distinct experts per token, uniformly at random; softmax-like weights summing to 1."""
    scores = torch.rand(T, E, device=device, generator=generator)
    ids = scores.topk(K, dim=1).indices.to(torch.int32)
    weights = torch.rand(T, K, device=device, generator=generator) + 0.1
    return TopKOutput((weights / weights.sum(1, keepdim=True)).contiguous(), ids.contiguous())


def seeded_batch(shape: TuneShape, T: int, device,
                 dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, TopKOutput]:  # fmt: skip
    """x [T, H] and uniform routing for a batch of T tokens of `shape`, seeded by T: the same
    inputs in every run and for every variant timed on them."""
    gen = torch.Generator(device=device).manual_seed(T)
    topk = uniform_topk(T, shape.num_experts, shape.top_k, device, gen)
    x = torch.randn(T, shape.hidden, device=device, dtype=dtype, generator=gen)
    return x, topk


def rotations(shape: TuneShape, T: int, bytes_per_expert: float | None,
              l2_bytes: int) -> int:  # fmt: skip
    """How many routings to time a point on a GPU with `l2_bytes` of L2: as many as the bench
    times it on (`bench.routings_for`, for the weights a routing is expected to touch;
    `bytes_per_expert`: of quantized weights, default: the shape's dtype), at least
    MIN_ROUTINGS."""
    from moekit.bench import routings_for

    elem = DTYPES[shape.dtype].itemsize
    touched = max(1, min(shape.num_experts, round(T * shape.top_k * shape.local_share)))
    if bytes_per_expert is None:
        bytes_per_expert = 3 * shape.hidden * shape.intermediate * elem
    return max(MIN_ROUTINGS, routings_for(T, touched * bytes_per_expert, l2_bytes))


@dataclass
class PointResult:
    """Timings (microseconds) of one batch size."""

    num_tokens: int
    gate_up: GemmConfig
    down: GemmConfig
    gate_up_us: float | None  # the chosen GEMM alone (None: an incumbent the search did not run)
    down_us: float | None
    layer_us: float
    floor_us: float
    rel_err: float
    tried: dict = field(default_factory=dict)
    confirm: dict | None = None  # the layer timed in turns: ties, incumbent (`_confirm`)
    routings: int = 1  # the routings every timing ran over (`rotations`)

    @property
    def ratio(self) -> float:
        return self.layer_us / self.floor_us

    def summary(self) -> str:
        """The configs kept, with their times alone or the layer comparison that kept the
        runner's own, and the layer against its floor."""
        c = self.confirm
        if c and c["kept"] != "tuned":
            whose = "the runner's" if c["kept"] == "incumbent" else "a near tie's"
            picked = (f"kept {whose} gate_up {self.gate_up.code()}, down {self.down.code()} "
                      f"(layer {c['us'][c['kept']]:.1f}us against the tuned pair's "
                      f"{c['us']['tuned']:.1f}us)")  # fmt: skip
        else:
            picked = (f"gate_up {self.gate_up.code()} {self.gate_up_us:.1f}us, down "
                      f"{self.down.code()} {self.down_us:.1f}us")  # fmt: skip
        return f"{picked}, layer {self.layer_us:.1f}us = {self.ratio:.2f}x floor"

    def meta(self) -> dict:
        return {
            "gate_up_us": None if self.gate_up_us is None else round(self.gate_up_us, 2),
            "down_us": None if self.down_us is None else round(self.down_us, 2),
            "layer_us": round(self.layer_us, 2),
            "floor_us": round(self.floor_us, 2),
            "time_over_floor": round(self.ratio, 3),
            "rel_err": float(f"{self.rel_err:.3g}"),
            "routings": self.routings,
            "tried": self.tried,
            **({"confirm": self.confirm} if self.confirm else {}),
        }


def precompile(launches: Sequence[Callable[[], object]], workers: int = 16) -> None:
    """Compile kernels in parallel threads: each callable launches its kernel with
    warmup=True. Errors are ignored here (the timed launch reports them)."""
    if interpret_mode() or not launches:
        return
    from triton.runtime._async_compile import AsyncCompileMode

    with ThreadPoolExecutor(max_workers=workers) as pool:
        with AsyncCompileMode(pool, ignore_errors=True):
            for launch in launches:
                try:
                    launch()
                except Exception:  # noqa: BLE001 - a config the compiler rejects is skipped
                    pass


class _Point:
    """The inputs of one batch size: R routings, their alignments per block_m, buffers."""

    def __init__(self, shape, w, T, device, seed: int, routing: str = "uniform"):
        from moekit.bench import l2_cache_bytes
        from moekit.runners._align import align_block_size

        self._align = align_block_size
        gen = torch.Generator(device=device).manual_seed(seed)
        dt = DTYPES[shape.dtype]
        self.shape, self.w, self.T, self.device = shape, w, T, torch.device(device)
        per_expert = _weight_bytes_per_expert(w) if w.is_quantized else None
        l2 = l2_cache_bytes(self.device)  # 0 on the CPU: one routing
        self.R = rotations(shape, T, per_expert, l2) if l2 else 1
        self.x = torch.randn(T, shape.hidden, device=device, dtype=dt, generator=gen)
        E, K, G = shape.num_experts, shape.top_k, shape.routed_experts
        if routing == "uniform":
            self.topks = [uniform_topk(T, G, K, device, gen) for _ in range(self.R)]
        else:  # the bench's draw (sweep.make_routing), which also rejects unknown routings
            from moekit.sweep import make_routing

            cpu_gen = torch.Generator().manual_seed(seed)
            self.topks = [make_routing(T, G, K, routing=routing, generator=cpu_gen, device=device)
                          for _ in range(self.R)]  # fmt: skip
        if G > E:  # this rank holds experts 0 .. E-1; the other ranks' pairs are masked
            self.topks = [TopKOutput(t.weights, torch.where(t.ids < E, t.ids, -1))
                          for t in self.topks]  # fmt: skip
        self._aligns: dict[int, list] = {}
        self.h = None

    def rows(self, block_m: int):
        """The GEMMs' row description for each routing (as `ops.fused_moe` builds it)."""
        from moekit.runners.triton import ops
        from moekit.runners.triton.configs import PIPELINE

        E = self.shape.num_experts
        if block_m not in self._aligns:
            if self.T <= PIPELINE.direct_max_tokens:
                self._aligns[block_m] = [ops.Rows.direct(t.ids.view(-1), E) for t in self.topks]
            else:
                per_expert = ops.rows_per_expert(self.T * self.shape.local_share,
                                                 self.shape.top_k, E)  # fmt: skip
                self._aligns[block_m] = [
                    ops.Rows.sorted(self._align(t.ids, E, block_m), E, per_expert,
                                    t.ids.view(-1))  # (static scales read the pairs' experts)
                    for t in self.topks
                ]
        return self._aligns[block_m]


def _time_us(fn, device, R: int, warmup: int = 2, samples: int = 7) -> float:
    from moekit.bench import time_ms

    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        ms = time_ms(fn, device, cuda_graph=True, warmup=warmup, samples=samples)
    else:  # CPU (Triton interpreter): one warm-up call, one timed call
        ms = time_ms(fn, device, cuda_graph=False, warmup=1, samples=1)
    return ms * 1e3 / R


def _gate_up_fn(p: _Point, cfg: GemmConfig, warmup: bool = False):
    """The gate_up GEMM over the point's routings, with what the layer runs after it before
    down: for the w8a8 formats h's quantization, in gate_up's epilogue where
    `ops.h_quant_dtype` takes it, else by `ops.quantize_h`, so that configs with and
    without it compare as the layer runs them. Returns (fn, hs): hs[i] after fn() is h of
    routing i, (q, scales) for the w8a8 formats."""
    from moekit.runners.triton import ops

    w, K = p.w, p.shape.top_k
    rows = p.rows(cfg.block_m)
    quant_h = ops.h_quant_dtype(w, cfg, p.x)
    w8a8 = w.is_quantized and not w.spec.weight_only
    outs = [
        torch.empty(r.slots(), p.shape.intermediate, device=p.device, dtype=p.x.dtype)
        for r in rows
    ]
    hs: list = list(outs)

    def fn():
        for i, (r, o) in enumerate(zip(rows, outs)):
            if quant_h is not None:
                hs[i] = ops.gate_up(p.x, r, w, p.shape.act, cfg, K, warmup=warmup, quant_h=quant_h)
            else:
                ops.gate_up(p.x, r, w, p.shape.act, cfg, K, o, warmup=warmup)
                if w8a8 and not warmup:
                    hs[i] = ops.quantize_h(o, r, w, K)

    return fn, hs


def _down_fn(p: _Point, h_cfg: GemmConfig, hs, cfg: GemmConfig, warmup: bool = False):
    """The down GEMM on gate_up outputs `hs` (aligned for h_cfg.block_m; (q, scales) for the
    w8a8 formats, whose quantization `_gate_up_fn` times) plus the reduction. Its block_m must
    divide h_cfg's alignment block; otherwise it gets its own alignment and the first rows of
    hs are reused (timing only)."""
    from moekit.runners.triton import ops

    T, H, K = p.T, p.shape.hidden, p.shape.top_k
    bm = max(cfg.block_m, h_cfg.block_m)
    rows = p.rows(bm)
    ins = []
    for h, r in zip(hs, rows):
        q, s = (h, None) if isinstance(h, torch.Tensor) else h
        if bm != h_cfg.block_m:
            q = _padded_rows(q, r.slots())
            if s is not None and s.dim() == 2:  # per-row scales follow their rows
                s = _padded_rows(s, r.slots())
        ins.append((q, s))
    atomic = cfg.reduce == "atomic"
    out = torch.empty(T, H, device=p.device, dtype=p.x.dtype)
    y = None if atomic else torch.empty(T * K, H, device=p.device, dtype=p.x.dtype)

    def fn():
        for r, (h, s), t in zip(rows, ins, p.topks):
            if atomic:
                out.zero_()  # (in the layer, the gate_up launch zeroes it)
                ops.down(h, r, p.w, cfg, out, t.weights, K, warmup, h_scales=s)
            else:
                ops.down(h, r, p.w, cfg, y, t.weights, K, warmup, h_scales=s)
                if not warmup:
                    ops.sum_topk(y, t.ids, p.shape.num_experts, out)

    return fn


def _padded_rows(h: torch.Tensor, rows: int) -> torch.Tensor:
    """h with `rows` rows (timing only: extra rows repeat the first ones)."""
    if h.shape[0] >= rows:
        return h[:rows]
    return h.repeat(math.ceil(rows / h.shape[0]), 1)[:rows].contiguous()


def _ranked(tried: dict) -> list[tuple[float, GemmConfig]]:
    """(time, config) of the configs that ran, fastest first (ties keep trial order)."""
    ok = [(t, c) for c, t in tried.items() if isinstance(t, float)]
    return sorted(ok, key=lambda tc: tc[0])


def _search(
    gemm: str,
    p: _Point,
    make_fn: Callable[[GemmConfig, bool], Callable[[], object]],
    tiles: list[GemmConfig],
    variants: Callable[[GemmConfig], list[GemmConfig]],
    advance: Callable[[int], None],
    limit: int | None = None,
    split_ks: tuple[int, ...] = (),
) -> tuple[GemmConfig, float, dict]:
    """Two-round search; returns (best config, its time in us, {config: us or error}).
    down also tries the atomic reduction on the three best. Then each of `split_ks` on the two
    best configs (down: the two best atomic ones). `limit` (tests): only the first `limit`
    tiles, and no later round."""
    tried: dict[GemmConfig, float | str] = {}

    def run(cands):
        cands = [c for c in cands if c not in tried]
        precompile([(lambda c=c: make_fn(c, True)()) for c in cands])
        for c in cands:
            try:
                tried[c] = _time_us(make_fn(c, False), p.device, p.R)
            except Exception as err:  # noqa: BLE001 - compile / resource failures skip the config
                tried[c] = f"{type(err).__name__}: {str(err)[:120]}"
            advance(1)

    run(tiles[:limit])
    ok = _ranked(tried)
    if not ok:
        raise RuntimeError(f"{gemm}: every candidate config failed: {tried}")
    second = []
    for c in best_shapes(ok):
        second += variants(c)
    run(second if limit is None else [])
    if limit is None:
        best2 = [c for _, c in _ranked(tried)][:2]
        if gemm == "down":
            run([replace(c, reduce="atomic") for _, c in _ranked(tried)[:3]])
            best2 = [c for _, c in _ranked(tried) if c.reduce == "atomic"][:2]
        run([replace(c, split_k=s) for c in best2 for s in split_ks])
    ok = _ranked(tried)
    best_t, best = ok[0]
    summary = {
        c.code(): (round(t, 2) if isinstance(t, float) else t) for c, t in tried.items()
    }
    return best, best_t, summary


def best_shapes(ranked: list[tuple[float, GemmConfig]], n: int = 2) -> list[GemmConfig]:
    """The fastest config of each of the `n` fastest tile shapes (block_m, block_n, block_k,
    swap_ab) in `ranked` (fastest first). Round 1 times every shape with and without TMA at
    one schedule, so the two fastest configs are often one shape twice, and the runner-up
    shape then never gets round 2's deeper pipelines (what made 128x128x64 win for H100
    mixtral-8x7b TP2 gate_up at T = 1024: 627 us at round 1's 3 stages, 545 us at 4)."""
    seen, out = set(), []
    for _, c in ranked:
        shape = (c.block_m, c.block_n, c.block_k, c.swap_ab)
        if shape not in seen:
            seen.add(shape)
            out.append(c)
            if len(out) == n:
                break
    return out


def tune_point(
    shape, w, T, device, ceilings, advance=lambda n: None, seed=0, limit=None, incumbent=None
) -> PointResult:
    """Tune both GEMMs for batch size T; returns the result (configs + timings). `w` may be
    quantized (`tune(..., quantization=...)`): the floor then counts its packed bytes.
    `incumbent`: the (gate_up, down) pair the runner ran before; the tuned pair, or a pair of
    configs that tie with it alone, replaces it only if the layer runs faster (`_confirm`)."""
    from moekit.bench import moe_cost
    from moekit.runners.torch import TorchRunner
    from moekit.runners.triton import ops
    from moekit.stages import StandardDispatchOutput

    p = _Point(shape, w, T, device, seed)
    E, H, I, K = shape.num_experts, shape.hidden, shape.intermediate, shape.top_k
    elem = DTYPES[shape.dtype].itemsize
    tile_elem = tile_bytes(w.spec if w.is_quantized else None, elem)  # per-step loads
    rows = max(1.0, T * K * shape.local_share / E)
    quant = quant_tag(w.spec)
    n1, k1 = tcfg.gemm_shape("gate_up", H, I)
    n2, k2 = tcfg.gemm_shape("down", H, I)

    def gate_fn(c, warmup):
        return _gate_up_fn(p, c, warmup)[0]

    split_ks = SPLIT_K_TRIES if rows <= SPLIT_K_MAX_ROWS else ()
    fold_rows = None if w.is_quantized else rows  # folding is for unquantized weights
    best1, t1, tried1 = _search(
        "gate_up", p, gate_fn, tile_candidates("gate_up", rows, n1, k1, tile_elem, quant),
        lambda c: schedule_variants("gate_up", c, n1, k1, tile_elem, fold_rows), advance, limit,
        split_ks,
    )  # fmt: skip
    fn, hs = _gate_up_fn(p, best1)
    fn()

    def down_fn(c, warmup):
        return _down_fn(p, best1, hs, c, warmup)

    best2, t2, tried2 = _search(
        "down", p, down_fn, tile_candidates("down", rows, n2, k2, tile_elem, quant),
        lambda c: schedule_variants("down", c, n2, k2, tile_elem, fold_rows), advance, limit,
        split_ks,
    )  # fmt: skip

    ref = TorchRunner().run(StandardDispatchOutput(p.x, p.topks[0]), w, shape.act).out.double()

    def checked(pair):  # relative error of the layer with `pair` (raises above 3e-2)
        got = ops.fused_moe(p.x, p.topks[0], w, shape.act, configs=pair,
                            local_share=shape.local_share).double()
        e = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not e < 3e-2:
            raise RuntimeError(f"T={T}: configs {pair} give relative error {e:.3g}")
        return e

    cfgs = (best1, best2)
    err = checked(cfgs)
    ties = [(g, d) for g in near_ties(tried1) for d in near_ties(tried2)][1:]
    cfgs, confirm = _confirm(p, w, cfgs, ties, incumbent)
    if confirm is not None and confirm["kept"] != "tuned":  # its GEMMs' times alone, if run
        err = checked(cfgs)
        t1, t2 = (tried.get(c.code()) for tried, c in zip((tried1, tried2), cfgs))
        t1, t2 = (v if isinstance(v, float) else None for v in (t1, t2))
    layer_us = _time_us(_layer_fn(p, w, cfgs), device, p.R)
    per_expert = _weight_bytes_per_expert(w)
    floors = [
        moe_cost(t.ids, E, H, I, act_bytes=elem, weight_bytes_per_expert=per_expert).floor_s(
            ceilings
        ) * 1e6
        for t in p.topks
    ]
    return PointResult(
        T, cfgs[0], cfgs[1], t1, t2, layer_us, sum(floors) / len(floors), err,
        {"gate_up": tried1, "down": tried2}, confirm, p.R,
    )  # fmt: skip


def _layer_fn(p: _Point, w: ExpertWeights, cfgs) -> Callable[[], None]:
    """The runner's call over the point's routings with the (gate_up, down) configs `cfgs`."""
    from moekit.runners.triton import ops

    def layer():
        for t in p.topks:
            ops.fused_moe(p.x, t, w, p.shape.act, configs=cfgs, local_share=p.shape.local_share)

    return layer


def _layers_in_turns(fns: dict, device, R: int) -> dict[str, float]:
    """us per routing of each layer in `fns`, timed in alternating rounds."""
    from moekit.bench import time_ms_interleaved

    on_gpu = torch.device(device).type == "cuda"
    timing = dict(warmup=2, samples=10) if on_gpu else dict(warmup=1, samples=1, rounds=1)
    ms = time_ms_interleaved(fns, device, cuda_graph=on_gpu, **timing)
    return {name: v * 1e3 / R for name, v in ms.items()}


def near_ties(tried: dict) -> list[GemmConfig]:
    """The configs of a search's `tried` ({code: us or error}) timed within NEAR_TIE of the
    fastest, fastest first, at most NEAR_TIE_MAX."""
    ok = _ranked({GemmConfig.from_code(c): t for c, t in tried.items()})
    return [c for t, c in ok if t <= ok[0][0] * NEAR_TIE][:NEAR_TIE_MAX] if ok else []


def _confirm(p: _Point, w: ExpertWeights, tuned, ties=(),
             incumbent=None) -> tuple[tuple, dict | None]:  # fmt: skip
    """The fastest through the layer, timed in turns, of the tuned pair, the pairs of GEMM
    configs that tie with it alone (`near_ties`) and the incumbent (the pair the runner ran
    before). Each GEMM is tuned alone, and a pair of winners alone can lose to a pair chosen
    on the layer: under Triton 3.9, the fp8 decode entries re-tuned this way made deepseek-v3
    EP8 T = 1 8% slower than the shipped Triton 3.6 entries (benchmarks/triton_notes.md,
    session 49). Returns (pair, what was timed), or (tuned, None) with nothing to compare."""
    pairs = {"tuned": tuple(tuned)}
    if incumbent is not None and tuple(incumbent) != pairs["tuned"]:
        pairs["incumbent"] = tuple(incumbent)
    for i, pair in enumerate(ties, 1):
        if tuple(pair) not in pairs.values():
            pairs[f"tie {i}"] = tuple(pair)
    if len(pairs) == 1:
        return pairs["tuned"], None
    us = _layers_in_turns({n: _layer_fn(p, w, c) for n, c in pairs.items()}, p.device, p.R)
    kept = min(pairs, key=lambda n: (us[n], n != "tuned"))
    info = {"kept": kept, "pairs": {n: [c.code() for c in pair] for n, pair in pairs.items()},
            "us": {n: round(v, 2) for n, v in us.items()}}  # fmt: skip
    return pairs[kept], info


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def _weight_bytes_per_expert(w: ExpertWeights) -> float:
    """Bytes of w13 + w2 and their scales / zero points / global scales, per expert."""
    names = ("w13", "w2", "w13_scale", "w2_scale", "w13_zero", "w2_zero", "w13_global_scale",
             "w2_global_scale")  # fmt: skip
    ts = [getattr(w, n) for n in names if getattr(w, n, None) is not None]
    return sum(t.numel() * t.element_size() for t in ts) / w.num_experts


def _runner_configs(shape: TuneShape, w: ExpertWeights, T: int, device) -> tuple[GemmConfig, GemmConfig]:
    """The (gate_up, down) pair the runner looks up for T tokens (`ops.configs_for`, from the
    tables as cached: `tcfg.clear_cache()` first to see files written since)."""
    from moekit.runners.triton import ops

    return ops.configs_for(T * shape.local_share, shape.top_k, w, DTYPES[shape.dtype],
                           torch.device(device))  # fmt: skip


def table_keys(shape: TuneShape, device, spec=None) -> dict[str, TableKey]:
    """The two tables' keys; `spec` (QuantSpec or None) puts the weight format in them."""
    dev = device_key(device)[0]
    keys = {}
    for gemm in tcfg.GEMMS:
        n, k = tcfg.gemm_shape(gemm, shape.hidden, shape.intermediate)
        keys[gemm] = TableKey(
            gemm, shape.num_experts, n, k, shape.dtype, dev, triton_version(),
            quant_tag(spec),
        )  # fmt: skip
    return keys


def _existing(path: Path) -> tuple[dict[int, GemmConfig], dict]:
    if not path.is_file():
        return {}, {}
    import json

    table = tcfg.read_table(path)
    meta = json.loads(path.read_text()).get("meta", {})
    return dict(table.configs), meta


def pending_batch_sizes(paths: dict[str, Path], batch_sizes: Sequence[int], force: bool,
                        local_share: float = 1.0) -> list[int]:  # fmt: skip
    """Batch sizes still to tune: those whose key (`_tables.table_key`) is missing from either
    table (all with force)."""
    if force:
        return list(batch_sizes)
    have = [set(_existing(p)[0]) for p in paths.values()]
    return [b for b in batch_sizes
            if not all(table_key(b, local_share) in h for h in have)]  # fmt: skip


@dataclass
class TuneReport:
    shape: TuneShape
    paths: dict[str, Path]
    results: list[PointResult]
    skipped: list[int]


def tune(
    shape: TuneShape,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    out_dir: Path | str | None = None,
    device: str | torch.device = "cuda",
    force: bool = False,
    progress: bool = True,
    note: str = "",
    limit: int | None = None,
    ceilings=None,
    quantization=None,
) -> TuneReport:
    """Tune `shape` for `batch_sizes` on `device`; write/extend the two tables in `out_dir`
    (default: the user config directory). Returns what was done. `limit` (tests): try only
    the first `limit` tile candidates per GEMM, in one round; `ceilings` (tests): skip
    measuring the device's ceilings. `quantization`: a weight format name or QuantSpec (None /
    'unquantized': bf16 weights); its tables are keyed by the format (`_tables.quant_tag`)."""
    from moekit.bench import measure_ceilings
    from moekit.quant import make_spec, quantize_experts
    from moekit.quant.calibrate import random_experts_scales

    spec = make_spec(quantization)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("moekit tune needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)")
    for b in batch_sizes:
        if not isinstance(b, int) or b < 1:
            raise ConfigError(f"--batch-sizes must be positive integers, got {b!r}")
    out_dir = Path(out_dir) if out_dir is not None else tcfg.user_dir()
    keys = table_keys(shape, device, spec)
    paths = {g: out_dir / key.filename() for g, key in keys.items()}
    todo = pending_batch_sizes(paths, batch_sizes, force, shape.local_share)
    skipped = [b for b in batch_sizes if b not in todo]
    results: list[PointResult] = []
    if not todo:
        return TuneReport(shape, paths, results, skipped)

    dt = DTYPES[shape.dtype]
    ceilings = ceilings or measure_ceilings(device, dt)
    w = random_weights(shape, device)
    if spec is not None:
        w = quantize_experts(w, spec, **random_experts_scales(w, spec, shape.act))
    tables = {g: _existing(p) for g, p in paths.items()}
    tcfg.clear_cache()  # the incumbents: what the runner ran before anything is written
    incumbents = {T: _runner_configs(shape, w, T, device) for T in todo}

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, disable=not progress, transient=False) as bar:
        task = bar.add_task(shape.describe(), total=None)
        for T in todo:
            bar.update(task, description=f"{shape.describe()}  T={T}")
            t0 = time.perf_counter()
            r = tune_point(
                shape, w, T, device, ceilings, lambda n: bar.advance(task, n), T, limit,
                incumbents[T],
            )
            results.append(r)
            key = table_key(T, shape.local_share)
            for gemm, path in paths.items():
                configs, meta = tables[gemm]
                configs[key] = r.gate_up if gemm == "gate_up" else r.down
                meta.setdefault("points", {})[str(key)] = dict(r.meta(), tokens=T)
                cap = device_key(device)[1]  # `configs.transferred` lends to its peers
                meta.update(
                    shape=shape.describe(),
                    top_k=shape.top_k,
                    capability=None if cap is None else list(cap),
                    note=note,
                    ceilings={
                        "copy_TBps": round(ceilings.copy_bytes_per_s / 1e12, 3),
                        "matmul_TFLOPs": round(ceilings.matmul_flops_per_s / 1e12, 1),
                    },
                    torch=torch.__version__,
                )
                tcfg.write_table(path, keys[gemm], configs, meta)
                tables[gemm] = (configs, meta)
            bar.console.log(f"T={T}: {r.summary()} ({time.perf_counter() - t0:.0f}s)")
    tcfg.clear_cache()
    return TuneReport(shape, paths, results, skipped)


# ---------------------------------------------------------------------------------------------
# Measuring the runner as shipped (the configs it looks up)
# ---------------------------------------------------------------------------------------------


def measure(
    shape: TuneShape,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    device: str | torch.device = "cuda",
    routing: str = "uniform",
    ceilings=None,
    breakdown: bool = False,
) -> list[dict]:
    """Time the whole runner call (CUDA-graph replay) with the configs it looks up, against the
    roofline floor, per batch size. With `breakdown`, also time its stages one by one."""
    from moekit.bench import measure_ceilings, moe_cost

    device = torch.device(device)
    dt = DTYPES[shape.dtype]
    ceilings = ceilings or measure_ceilings(device, dt)
    w = random_weights(shape, device)
    rows = []
    for T in batch_sizes:
        p = _Point(shape, w, T, device, seed=T, routing=routing)
        cfgs = _runner_configs(shape, w, T, device)
        row = {"T": T, "routing": routing, "gate_up": cfgs[0].code(), "down": cfgs[1].code()}
        row["layer_us"] = _time_us(_layer_fn(p, w, cfgs), device, p.R, warmup=10, samples=15)
        E, H, I = shape.num_experts, shape.hidden, shape.intermediate
        floors = [
            moe_cost(t.ids, E, H, I, act_bytes=dt.itemsize).floor_s(ceilings) * 1e6
            for t in p.topks
        ]
        row["floor_us"] = sum(floors) / len(floors)
        row["ratio"] = row["layer_us"] / row["floor_us"]
        if breakdown:
            bm = max(cfgs[0].block_m, cfgs[1].block_m)
            row["align_us"] = _time_us(
                lambda: [p._align(t.ids, shape.num_experts, bm) for t in p.topks], device, p.R
            )
            g_fn, hs = _gate_up_fn(p, replace(cfgs[0]))
            g_fn()
            row["gate_up_us"] = _time_us(g_fn, device, p.R)
            if cfgs[0].block_m == bm:
                row["down_us"] = _time_us(_down_fn(p, cfgs[0], hs, cfgs[1]), device, p.R)
        rows.append(row)
    return rows
