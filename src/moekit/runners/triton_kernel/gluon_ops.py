"""The `triton_kernel` runner's Hopper engine: warp-specialized Gluon GEMMs (`_gluon_kernels`)
over the runner's routing, for large batches on sm_90 with Triton >= 3.9.

  fused_moe(x [T, H], ids, weights, w, act, cfg) -> [T, H]
    route (BM = 128) -> gate_up (x's rows gathered by the producer; zeroes the output on the
    way) -> down (adds each pair's weighted rows into the output; reduce 'sum': stores them by
    pair, then a sum over K)
    fp8_w8a8 with 128 x 128 weight blocks: x and h quantized per token and group of 128 first
    (`quantize_act`), the scales applied per K step inside the GEMMs (`FP8`, `fp8_problem`)

`unavailable_reason` says why the engine cannot run a call (None: it can); `ops.fused_moe`
asks it (through `engine_for`) before choosing the engine, so nothing here is reached on other
hardware or Triton versions.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import triton

from moekit import envs
from moekit._triton_host import cdiv
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import sm_count
from moekit.log import log_once
from moekit.quant.spec import FP8_DTYPE
from moekit.runners._tables import device_key, version_tuple
from moekit.runners._triton_common import ACT_CODES
from moekit.runners.triton.ops import tma_ok

MIN_TRITON = (3, 9)
DTYPES = (torch.float16, torch.bfloat16)
ENGINES = ("auto", "triton", "gluon")
# auto picks this engine from this many mean rows per expert (T * K / E) on. Measured on the
# H100 with Triton 3.9, timed in turns against the runner's Triton engine since the epilogue
# stores through shared memory (scripts/gpu_gluon_engine_ab.py, results/ab/20261122T1826Z_*,
# benchmarks/triton_kernel_notes.md): faster at 15 of 16 points from 32 rows per expert up,
# qwen3-30b-a3b 1.07-1.15x (64-1024 rows), mixtral-8x7b TP2 1.19-1.28x, deepseek-v3 1.12-1.23x,
# gpt-oss-120b 1.07x at 32 rows, 0.99x at 64, 1.01x at 128, 1.15x at 512. Fewer rows: not
# measured, the Triton engine stays.
MIN_ROWS_PER_EXPERT = 32


# a side tile's rows (wgmma N; 32 would not fit in the shared memory beside 4 stages of
# 128 x 64 A tiles and 256 x 64 weight tiles and the epilogue's float32 side tile)
FOLD_ROWS = (0, 16)


@dataclass(frozen=True)
class GluonConfig:
    """Tiles of the two GEMMs (block_m is fixed at 128: two consumer warpgroups of 64 rows);
    gate_up's block_n counts activated columns (it loads gate and up tiles of that many rows);
    stages: shared-memory load stages; group_m: work tiles sharing a weight column block in
    program order; reduce as in `KernelConfig` ('sum' or 'atomic'); gather: gate_up's producer
    warps copy x's rows of each tile with cp.async where x's rows are 16-byte aligned (else, and
    with False, x's rows are first copied into sorted order, xs, and read through TMA; fp8 always
    gathers); gate_up_fused (gathering gate_up only): a stage's gate and up tiles side by side,
    multiplied by one wgmma of 2 * block_n columns (FP8's; bf16 at block_n 128 spills);
    consumers: 1 = the two consumer warpgroups in one partition, held in step; 2 = one partition
    each (64 rows of every tile), so one can scale in its products while the other's wgmma
    runs (the `_gluon_kernels` docstring); fold_rows: an expert's last 1 ... fold_rows rows
    after a full tile are that tile's too, multiplied as side rows (`_gluon_kernels` FOLD;
    0: off; with consumers 1, unquantized weights and gate_up_fused off, else ignored);
    evict_weights: the weight tiles of an expert with one work tile are loaded L2 evict-first
    (`_gluon_kernels` EVICT_W), so that the activation rows every column block of a tile reads
    stay in L2; zero_in_gate_up (reduce 'atomic'): gate_up zeroes the output down adds into, a
    piece each K step while its wgmma run, instead of a fill kernel before; early_pairs: down
    loads a tile's pair ids and routing weights before its K loop, not in its epilogue."""

    gate_up_block_n: int = 128
    gate_up_block_k: int = 64
    gate_up_stages: int = 4
    down_block_n: int = 256
    down_block_k: int = 64
    down_stages: int = 4
    group_m: int = 8
    reduce: str = "sum"
    gather: bool = True
    gate_up_fused: bool = False
    consumers: int = 1
    fold_rows: int = 0
    evict_weights: bool = False
    zero_in_gate_up: bool = False
    early_pairs: bool = False

    def __post_init__(self) -> None:
        if self.consumers not in (1, 2):
            raise ValueError(f"GluonConfig.consumers={self.consumers!r}; allowed: 1, 2")
        if self.fold_rows not in FOLD_ROWS:
            raise ValueError(f"GluonConfig.fold_rows={self.fold_rows!r}; allowed: "
                             f"{', '.join(map(str, FOLD_ROWS))}")  # fmt: skip

    def fold_for(self, w: ExpertWeights) -> int:
        """The side rows a tile takes for these weights (0 where folding does not apply)."""
        applies = self.consumers == 1 and not self.gate_up_fused and not w.is_quantized
        return self.fold_rows if applies else 0

    @property
    def num_warps(self) -> int:
        """Warps of the kernels' default partition: both consumer warpgroups, or the first."""
        from moekit.runners.triton_kernel import _gluon_kernels as gk

        return gk.NUM_WARPS // self.consumers


# bf16: the top-k sum in down's epilogue (atomic adds into the zeroed output, no [T * K, H]
# intermediate and no sum kernel) and evict-first weights of single-tile experts. Timed in
# turns on the H100 (Triton 3.9, scripts/gpu_gluon_fold_ab.py, benchmarks/triton_kernel_notes.md,
# session 39), both over neither at T = 1024 / 4096 / 16384: qwen3 1.086 / 1.053 / 1.041,
# mixtral TP2 1.006 / 1.007 / 0.980, deepseek-v3 EP8 1.012 / 1.027 / 1.037, gpt-oss 1.013 /
# 1.083 / 1.012. The sum's order of bf16 additions then varies between runs; reduce='sum' is
# bit-reproducible. The output zeroed by gate_up (no fill kernel) and down's pair ids and weights
# loaded before its K loop: both over neither (session 40, same probe, second run, 5 rounds)
# 1.023 / 1.002 / 1.012, 1.006 / 1.007 / 1.012, 1.005 / 1.002 / 0.985, 0.998 / 1.001 / 1.007;
# each alone 0.997-1.037 in the first run (benchmarks/triton_kernel_notes.md, session 40).
DEFAULT = GluonConfig(reduce="atomic", evict_weights=True, zero_in_gate_up=True,
                      early_pairs=True)  # fmt: skip
# fp8 with 128 x 128 weight blocks (block_k = the scale group; gate_up's block_n 64 keeps a gate
# or up tile inside one 128-row scale block, and the four float32 accumulators of a warpgroup
# within the registers; down's 128 is one row block).
FP8_BLOCK = (128, 128)
# consumers=2: each warpgroup waits for its own wgmma every K step (the scales) and frees the
# stage alone, so one scales in its products while the other's wgmma runs. Timed in turns on
# the H100 (results/ab/20261122T1755Z_H100_triton39_gluon_consumers_ab.json): 1.05-1.30x over
# the two warpgroups in one partition at T = 4096 / 16384 on all four presets; bf16 (no wait
# each step) gains nothing from it (0.95-1.01x) and keeps one partition. 4 stages and group_m 4
# (results/ab/20261122T1851Z_*, 1855Z_*): 4 stages faster than 5 at all 8 points of the second
# run (0.1-3.1%); group_m 4 over 8 at 6 of 8 (up to 8.7%, gpt-oss T = 4096), 0.3-0.8% slower on
# qwen3.
# The epilogue and cache policy as DEFAULT's (the top-k sum added into the output that gate_up
# zeroes, down's pairs and weights loaded before its K loop, evict-first weights of single-tile
# experts) over the deterministic sum: timed in turns on the H100 (scripts/gpu_gluon_fp8_ab.py,
# 4 rounds, two runs; benchmarks/triton_kernel_notes.md, session 41), T = 256 / 1024 / 4096 /
# 16384, second run: qwen3 1.110 / 1.086 / 1.088 / 1.093, mixtral TP2 1.065 / 1.012 / 1.018 /
# 1.034, deepseek-v3 (all local) 1.092 / 1.063 / 1.043 / 1.024, gpt-oss 1.009 / 0.989 / 1.025 /
# 1.045.
FP8 = replace(DEFAULT, gate_up_block_n=64, gate_up_block_k=128, gate_up_stages=4,
              down_block_n=128, down_block_k=128, down_stages=4, group_m=4, gate_up_fused=True,
              consumers=2)  # fmt: skip
# gate_up gathers x's rows in its producer below this intermediate size, else reads a sorted
# copy through TMA. Same A/B: the copy's share of the work falls with I (it moves P * H
# elements twice, the GEMMs 6 * P * H * I FLOPs): gathering gained 6-9% on qwen3 (I 768) and
# 1-3% on gpt-oss (2880), was even on deepseek-v3 (2048) and lost 4.5% on mixtral (7168).
GATHER_MAX_INTERMEDIATE = 4096


# Folding (`GluonConfig.fold_rows`) where the mean rows per expert is in [FOLD_MIN_ROWS,
# FOLD_MAX_ROWS]: one or two tiles an expert, so that a tail of a few rows is often a third or
# half of the expert's tiles. Timed on the H100 (Triton 3.9, the layer in turns on `moekit
# bench`'s inputs, three runs; scripts/gpu_gluon_fold_ab.py, benchmarks/triton_kernel_notes.md,
# session 38), 16 folded rows over none: qwen3 T = 4096 (256 rows) 1.020 / 1.029, gpt-oss
# T = 4096 (128) 1.030 / 1.054, deepseek-v3 EP8 T = 4096 (128) 1.044 / 0.972, mixtral TP2
# T = 1024 (256) 1.141; the rule itself 1.026, 1.035, 1.037, 1.142 (H200, one run: 0.997,
# 1.034, 1.096, 0.989). With many tiles an expert the few folded tiles cost far more than the
# tiles they save (T = 16384: deepseek-v3 0.92 / 0.87, gpt-oss 0.85 / 0.84; not understood),
# and the folding kernels cost gpt-oss 5-8% on tiles that do not fold.
FOLD_MIN_ROWS, FOLD_MAX_ROWS = 128, 256
FOLD_AUTO = 16
# Narrower tiles in six stages (SMALL_TILES) up to SMALL_TILES_MAX_ROWS mean rows per expert,
# where each expert's weights stream once through one or two row tiles and memory, not the MMA,
# binds. Timed on the H100 (Triton 3.9, scripts/gpu_gluon_fold_ab.py, the layer in turns,
# benchmarks/triton_kernel_notes.md, session 48), over DEFAULT's tiles, two runs: qwen3 T = 1024
# (64 rows) 1.009 / 1.015, T = 2048 (128) 1.028, gpt-oss T = 1024 (32) 1.048 / 1.049, T = 4096
# (128) 1.064, deepseek-v3 EP8 T = 1024 (32) 1.012, T = 4096 (128) 1.001; at 256 rows (mixtral
# TP2 T = 1024) gate_up's 64-column tiles lost 19%.
SMALL_TILES_MAX_ROWS = 128
SMALL_TILES = dict(gate_up_block_n=64, gate_up_stages=6, down_block_n=128, down_stages=6)


def config_for(w: ExpertWeights, rows_per_expert: float | None = None) -> GluonConfig:
    """The engine's config for a layer: FP8 for fp8 weights, else DEFAULT with the gather rule
    and (given the call's mean rows per local expert) the fold and small-tile rules above."""
    if w.format == "fp8_w8a8":
        return FP8
    fold = rows_per_expert is not None and FOLD_MIN_ROWS <= rows_per_expert <= FOLD_MAX_ROWS
    small = rows_per_expert is not None and rows_per_expert <= SMALL_TILES_MAX_ROWS
    return replace(DEFAULT, gather=w.intermediate_size < GATHER_MAX_INTERMEDIATE,
                   fold_rows=FOLD_AUTO if fold else DEFAULT.fold_rows,
                   **(SMALL_TILES if small else {}))  # fmt: skip


def fp8_problem(spec) -> str | None:
    """None if an fp8_w8a8 spec is the engine's recipe (128 x 128 weight blocks, activations
    per token and group of 128), else why not."""
    if getattr(spec, "weight_scale", None) != "block" or tuple(spec.block_shape) != FP8_BLOCK:
        return (f"runs fp8_w8a8 with {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales "
                f"(weight_scale='block') only, got {spec.describe()}")  # fmt: skip
    if spec.act_scheme != "token_group" or spec.act_group_size != FP8_BLOCK[1]:
        return (f"runs fp8_w8a8 with per-token-group ({FP8_BLOCK[1]}) activation scales only, "
                f"got {spec.describe()}")  # fmt: skip
    return None


@functools.lru_cache(maxsize=None)
def _gluon_import_error() -> str | None:
    if version_tuple(triton.__version__) < MIN_TRITON:
        return f"needs Triton >= 3.9 (Gluon warp specialization); this is {triton.__version__}"
    try:
        from moekit.runners.triton_kernel import _gluon_kernels  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any import failure disables the engine
        return f"Gluon kernels do not import: {type(err).__name__}: {err}"
    return None


def platform_problem(capability: tuple[int, int] | None, triton_version: str | None) -> str | None:
    """Why the engine cannot run on a GPU of this compute capability with this Triton, or None."""
    if capability != (9, 0):
        return "needs an sm_90 GPU"
    if triton_version is None or version_tuple(triton_version) < MIN_TRITON:
        return f"needs Triton >= 3.9, have {triton_version}"
    return None


def engine_status(capability: tuple[int, int] | None, triton_version: str | None) -> str:
    """One line for `moekit env`: whether the engine can run on this GPU and Triton, and when
    auto takes it."""
    problem = platform_problem(capability, triton_version)
    if problem:
        return f"Gluon engine: off ({problem}; fp8 block-wise weights need it)"
    return (f"Gluon engine: on from {MIN_ROWS_PER_EXPERT} rows per expert, and for fp8 "
            f"block-wise weights "
            f"({envs.MOEKIT_TRITON_KERNEL_ENGINE.name})")  # fmt: skip


def unavailable_reason(x: torch.Tensor, w: ExpertWeights, act: ActivationSpec) -> str | None:
    """Why the engine cannot run this call, or None."""
    if x.device.type != "cuda":
        return "runs on CUDA only"
    if device_key(x.device)[1] != (9, 0):
        return "needs an sm_90 GPU (Hopper wgmma)"
    if x.dtype not in DTYPES:
        return f"runs float16 / bfloat16, got {x.dtype}"
    if act.name not in ACT_CODES:
        return "runs the standard activations only"
    H, I = w.hidden_size, w.intermediate_size
    if w.format == "fp8_w8a8":
        problem = fp8_problem(w.spec)
        if problem:
            return problem
        if H % 16 or I % 64:
            return (f"runs fp8 with H a multiple of 16 and I of 64 (16-byte fp8 rows, one scale "
                    f"block a gate / up tile), got H={H}, I={I}")  # fmt: skip
        if not (w.w13_scale.is_contiguous() and w.w2_scale.is_contiguous()):
            return "needs contiguous weight scales"
    elif w.format != "unquantized":
        return f"runs unquantized or fp8_w8a8 block-wise weights, got {w.format}"
    elif (H * x.element_size()) % 16 or (I * x.element_size()) % 16:
        return "needs H and I to be multiples of 8 (16-byte TMA rows)"
    if not (w.w13.is_contiguous() and w.w2.is_contiguous()):
        return "needs contiguous weights"
    if not tma_ok(w.w13, w.w2):
        return "needs 16-byte aligned weights"
    return _gluon_import_error()


def _mean_rows(num_tokens: int, top_k: int, local_share: float, w: ExpertWeights) -> float:
    """Mean rows per local expert of a call: its local pairs (an EP rank's share of the
    num_tokens * top_k) over the experts."""
    return num_tokens * top_k * local_share / max(w.num_experts, 1)


def engine_for(x: torch.Tensor, w: ExpertWeights, act: ActivationSpec, top_k: int,
               local_share: float = 1.0) -> str:  # fmt: skip
    """'gluon' or 'triton' for a call, from MOEKIT_TRITON_KERNEL_ENGINE: auto takes this
    engine where it can run, the mean rows per expert (T * top_k * local_share / E: an EP
    rank's local pairs) reach MIN_ROWS_PER_EXPERT;
    gluon forces it (ValueError naming the reason where it cannot run). fp8 weights run here
    only: 'gluon', or a ValueError that says why not."""
    mode = envs.MOEKIT_TRITON_KERNEL_ENGINE.get().strip().lower()
    if mode not in ENGINES:
        raise ValueError(f"{envs.MOEKIT_TRITON_KERNEL_ENGINE.name}={mode!r}; allowed: "
                         f"{', '.join(ENGINES)}")  # fmt: skip
    if w.format != "unquantized":  # only this engine runs quantized weights
        reason = unavailable_reason(x, w, act)
        if mode == "triton" or reason is not None:
            raise ValueError(f"triton_kernel runs {w.format} weights in its Gluon engine only, "
                             f"which {reason or 'MOEKIT_TRITON_KERNEL_ENGINE=triton turns off'}")  # fmt: skip
        return "gluon"
    if mode == "triton":
        return "triton"
    if mode == "auto" and _mean_rows(x.shape[0], top_k, local_share, w) < MIN_ROWS_PER_EXPERT:
        return "triton"
    reason = unavailable_reason(x, w, act)
    if reason is not None:
        if mode == "gluon":
            raise ValueError(f"{envs.MOEKIT_TRITON_KERNEL_ENGINE.name}=gluon: the Gluon engine "
                             f"{reason}")  # fmt: skip
        if x.is_cuda and device_key(x.device)[1] == (9, 0):
            # on a Hopper GPU the user could have it: say why not (elsewhere it is noise)
            log_once(logging.INFO, f"triton_kernel runner: Gluon engine not used: it {reason}")
        return "triton"
    log_once(
        logging.INFO,
        f"triton_kernel runner: Gluon warp-specialized engine (Triton {triton.__version__}, "
        f"sm_90) at >= {MIN_ROWS_PER_EXPERT} rows per expert",
    )
    return "gluon"


def _desc(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, shape, strides, block, _smem_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout of a [block] tile of dtype (NVMMA swizzle). Cached: building it
    is most of a descriptor's 10 us of host time, and a layer call makes four or five."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _fold(r, cfg: GluonConfig, w: ExpertWeights) -> int:
    """A GEMM's FOLD: the routing's fold (its tiles hold that many rows past BM at most), which
    must be what the config gives these weights."""
    if r.fold != cfg.fold_for(w):
        raise ValueError(f"routing folds {r.fold} rows, the config {cfg.fold_for(w)} for "
                         f"{w.format} weights: route with fold=cfg.fold_for(w)")  # fmt: skip
    return r.fold


def _side_desc(a: torch.Tensor, fold: int, bk: int, unused):
    """The side rows' descriptor over a GEMM's A rows (block [fold, bk]); `unused` without."""
    if not fold:
        return unused
    return _desc(a, [a.shape[0], a.shape[1]], [a.shape[1], 1], [fold, bk])


def _grid(device: torch.device, work_bound: int) -> tuple[int]:
    """Persistent: one program per SM, fewer if there is less work."""
    return (max(1, min(sm_count(device), work_bound)),)


def _gl_dtype(dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
            FP8_DTYPE: gl.float8e4nv}[dtype]  # fmt: skip


def _scale_args(a_scale: torch.Tensor | None, w_scale: torch.Tensor | None, dummy: torch.Tensor):
    """(a_scale, its row stride, w_scale, its expert and row-block strides) for SCALED
    kernels; placeholders (never read) otherwise."""
    if a_scale is None:
        return dummy, 0, dummy, 0, 0
    return a_scale, a_scale.stride(0), w_scale, w_scale.stride(0), w_scale.stride(1)


def gate_up(x: torch.Tensor, r, w: ExpertWeights, act: ActivationSpec, cfg: GluonConfig,
            top_k: int, out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None,
            zero: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """h [P, I] in sorted row order = act(x[token(row)] @ w13[e].T + b13[e]) for x [T, H];
    rows past the valid pairs are left unwritten. fp8 block-wise weights: x is fp8 with
    x_scale [T, cdiv(H, 128)] (its rows are always gathered), h in out_dtype. zero: a
    contiguous tensor of 16-byte multiple size, zeroed on the way (down's atomic output)."""
    from moekit.runners.triton_kernel import _gluon_kernels as gk

    E, I, H = w.num_experts, w.intermediate_size, w.hidden_size
    bn, bk = cfg.gate_up_block_n, cfg.gate_up_block_k
    scaled = x_scale is not None
    if out is None:
        out = torch.empty(r.num_pairs, I, dtype=out_dtype or x.dtype, device=x.device)
    if act.interleaved:  # gate rows 2n and up rows 2n + 1: two [E * I, H] views, row stride 2H
        w_desc = _desc(w.w13, [E * I, H], [2 * H, 1], [bn, bk])
        w_up_desc = _desc(w.w13.view(-1)[H:], [E * I, H], [2 * H, 1], [bn, bk])
        row_step, up_off = I, 0
    else:  # gate rows n, up rows I + n of one [E * 2I, H] view
        w_desc = w_up_desc = _desc(w.w13, [E * 2 * I, H], [H, 1], [bn, bk])
        row_step, up_off = 2 * I, I
    b13 = w.b13 if w.b13 is not None else w.w13
    if zero is not None and not (zero.is_contiguous() and zero.nbytes % 16 == 0):
        raise ValueError("gate_up(zero=...): needs a contiguous tensor of a multiple of 16 bytes")
    grid = _grid(x.device, r.max_tiles * cdiv(I, bn))
    tail = dict(ACT=ACT_CODES[act.name], HAS_BIAS=w.b13 is not None, INTERLEAVED=act.interleaved,
                STAGES=cfg.gate_up_stages, GROUP_M=cfg.group_m, CONSUMERS=cfg.consumers,
                FOLD=_fold(r, cfg, w), EVICT_W=cfg.evict_weights, num_warps=cfg.num_warps,
                maxnreg=gk.MAX_REGS)  # fmt: skip
    common = (w_desc, w_up_desc, b13, out, r.tile_expert, r.tile_row0, r.tile_rows, r.num_tiles,
              I, H, row_step, up_off, b13.stride(0), out.stride(0), float(act.alpha),
              float(act.limit), out if zero is None else zero,
              0 if zero is None else zero.numel())  # fmt: skip
    # the gathering producer copies 16-byte pieces of x's rows
    aligned = x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0
    if scaled and not aligned:
        raise ValueError("fp8 gate_up gathers x's rows: they must be 16-byte aligned")
    if scaled or (cfg.gather and aligned):
        a_layout = _smem_layout((gk.BLOCK_M, bk), x.dtype)
        bb_layout = _smem_layout((2 * bn, bk), w.w13.dtype)
        gk.gate_up_gather_kernel[grid](x, x.stride(0), r.sorted_pairs, top_k, *common,
                                       *_scale_args(x_scale, w.w13_scale, b13), **tail,
                                       BM=gk.BLOCK_M, A_LAYOUT=a_layout, SCALED=scaled,
                                       FUSED=cfg.gate_up_fused, BB_LAYOUT=bb_layout)  # fmt: skip
    else:
        xs = torch.index_select(x, 0, r.sorted_pairs // top_k)
        xs_desc = _desc(xs, [xs.shape[0], H], [H, 1], [gk.BLOCK_M, bk])
        gk.gate_up_kernel[grid](xs_desc, _side_desc(xs, tail["FOLD"], bk, xs_desc), *common,
                                **tail)  # fmt: skip
    return out


def down(h: torch.Tensor, r, w: ExpertWeights, cfg: GluonConfig, topk_weights: torch.Tensor,
         top_k: int, out: torch.Tensor, h_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """reduce 'sum': out [P, H] by pair = weight[pair] * (h[row] @ w2[e].T + b2[e]) (rows of
    masked pairs unwritten); 'atomic': those rows added into out [T, H] (zeroed before).
    fp8 block-wise weights: h is fp8 with h_scale [P, cdiv(I, 128)]."""
    from moekit.runners.triton_kernel import _gluon_kernels as gk

    E, I, H = w.num_experts, w.intermediate_size, w.hidden_size
    bn, bk = cfg.down_block_n, cfg.down_block_k
    h_desc = _desc(h, [h.shape[0], I], [I, 1], [gk.BLOCK_M, bk])
    w_desc = _desc(w.w2, [E * H, I], [I, 1], [bn, bk])
    b2 = w.b2 if w.b2 is not None else w.w2
    grid = _grid(h.device, r.max_tiles * cdiv(H, bn))
    fold = _fold(r, cfg, w)
    gk.down_kernel[grid](
        h_desc, _side_desc(h, fold, bk, h_desc), w_desc, b2, out, topk_weights, r.sorted_pairs,
        r.tile_expert, r.tile_row0, r.tile_rows, r.num_tiles, top_k, H, I, b2.stride(0),
        out.stride(0), *_scale_args(h_scale, w.w2_scale, b2), HAS_BIAS=w.b2 is not None,
        ATOMIC=cfg.reduce == "atomic", STAGES=cfg.down_stages, GROUP_M=cfg.group_m,
        SCALED=h_scale is not None, CONSUMERS=cfg.consumers, FOLD=fold,
        EVICT_W=cfg.evict_weights, EARLY=cfg.early_pairs, num_warps=cfg.num_warps,
        maxnreg=gk.MAX_REGS,
    )  # fmt: skip
    return out


def fused_moe(x_TH: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: ExpertWeights,
              act: ActivationSpec, cfg: GluonConfig | None = None,
              local_share: float = 1.0) -> torch.Tensor:  # fmt: skip
    """out [T, H] = sum over k of weight_k * expert_{id_k}(x) (ids of -1 or >= E add 0), for
    a call `unavailable_reason` accepted; x_TH, ids [T, K] int32, weights [T, K] float32 as
    `ops.kernel_inputs` makes them. cfg: `config_for(w, rows per expert)` when None, the rows
    counted from T * K * local_share (an EP rank's share of the pairs is local)."""
    from moekit.runners.triton.ops import sum_topk
    from moekit.runners.triton_kernel import _gluon_kernels as gk
    from moekit.runners.triton_kernel.routing import route

    T, H = x_TH.shape
    K = ids.shape[1]
    E = w.num_experts
    if cfg is None:
        cfg = config_for(w, _mean_rows(T, K, local_share, w))
    r = route(ids, E, gk.BLOCK_M, cfg.fold_for(w))
    out = None  # reduce 'atomic': down adds into it, zeroed by gate_up on the way or a fill now
    if cfg.reduce == "atomic":
        out = (torch.empty if cfg.zero_in_gate_up else torch.zeros)(
            T, H, dtype=x_TH.dtype, device=x_TH.device)
    zero = out if cfg.zero_in_gate_up else None
    if w.format == "fp8_w8a8":  # block-wise: both GEMM inputs quantized per group of 128
        from moekit.quant.act_quant import quantize_act

        xq, xs = quantize_act(x_TH, "token_group", FP8_DTYPE, group_size=FP8_BLOCK[1])
        h = gate_up(xq, r, w, act, cfg, K, x_scale=xs, out_dtype=x_TH.dtype, zero=zero)
        h, hs = quantize_act(h, "token_group", FP8_DTYPE, group_size=FP8_BLOCK[1])
    else:
        h, hs = gate_up(x_TH, r, w, act, cfg, K, zero=zero), None
    if out is not None:
        return down(h, r, w, cfg, weights.view(-1), K, out, hs)
    y = torch.empty(T * K, H, dtype=x_TH.dtype, device=x_TH.device)
    y = down(h, r, w, cfg, weights.view(-1), K, y, hs)
    return sum_topk(y, ids, E, torch.empty_like(x_TH))


__all__ = ["DEFAULT", "FP8", "GluonConfig", "config_for", "engine_for", "engine_status",
           "fp8_problem", "fused_moe", "platform_problem", "unavailable_reason"]  # fmt: skip
