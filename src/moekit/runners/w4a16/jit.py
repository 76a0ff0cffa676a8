"""Build and launch the `w4a16` kernels (csrc/w4a16.cu): nvcc, one shared library per weight
format variant (`PackedMatrix.build`: format, zero points, one or two scale products, int4
scales after the MMAs) and GPU architecture, cached on disk (`moekit.runners._nvcc`); ctypes
calls it on torch's current stream (CUDA-graph safe)."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.hardware import sm_count
from moekit.runners import _nvcc
from moekit.runners._shared import expected_experts_used
from moekit.runners.w4a16.pack import PackedMatrix

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "w4a16.cu"
MAX_PAIRS = 128  # mirrors MAX_P in the .cu file (checked when a library loads)
GATE_UP, DOWN = 0, 1
ACT_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
WARPS = 4  # per block (mirrors the .cu file)
# How a GEMM's work can spread: (mt, split_k, k_blocks), mt 16-row weight tiles per warp
# (gate_up: one gate and one up tile), split_k warps of a block on one row block's K, k_blocks
# blocks on it (down only: its bf16 reductions add the partial sums).
SHARES = {
    GATE_UP: ((2, 1, 1), (2, 2, 1), (2, 4, 1)),
    DOWN: ((2, 1, 1), (2, 2, 1), (2, 4, 1), (1, 4, 1), (1, 4, 2), (1, 4, 4)),
}
_ANY_SHARE = frozenset(SHARES[GATE_UP] + SHARES[DOWN])


@dataclass(frozen=True)
class CostModel:
    """How `plan` ranks the shares: waves x (bytes of an item + item_cost_bytes), times
    (blocks that fit / blocks) ** underfill_exp when the grid is underfilled. Fitted to the H100
    (session 23: each GEMM of the four presets, mxfp4, T = 1 ... 64, timed alone at every share;
    scripts/gpu_w4a16_profile.py splits). Re-checked on the ring kernels (session 24): still the
    best constants of a grid (item cost 0-80 KB, exponent 0-1). Against the measured plans of
    the 72 GEMMs of the H100 tables (`plans.py`), its plans are 3.8% slower in geometric mean and
    21% at worst; it decides only where no table does."""

    item_cost_bytes: float = 30_000  # fixed cost of one work item, in bytes of weights streamed
    underfill_exp: float = 0.5
    bytes_per_weight: float = 0.53  # about 4.25 bits: codes and scales


COST = CostModel()


def problem() -> str | None:
    """None when the kernels can be built here, else why not."""
    if _nvcc.nvcc() is None:
        return "needs nvcc (CUDA 11.8+) to build its kernels: set CUDA_HOME or add it to PATH"
    return None


@functools.cache
def library(build: tuple[int, bool, bool, bool], arch: str) -> ctypes.CDLL:
    """The compiled kernels of one format variant (`PackedMatrix.build`) for `arch` ('90' for
    sm_90)."""
    why = problem()
    if why:
        raise RuntimeError(why)
    path = _nvcc.build(_nvcc.nvcc(), nvcc_args(build, arch), "w4a16", [SOURCE.read_bytes()],
                       "w4a16 kernels (format {}, zero {}, two_mul {}, post_scale {})".format(
                           *build))  # fmt: skip
    lib = ctypes.CDLL(str(path))
    lib.mk_w4_max_pairs.restype = ctypes.c_int
    if lib.mk_w4_max_pairs() != MAX_PAIRS:
        raise RuntimeError(f"w4a16 kernels take {lib.mk_w4_max_pairs()} pairs, jit.py says "
                           f"{MAX_PAIRS}: the two are out of step")  # fmt: skip
    lib.mk_w4_last_error.restype = ctypes.c_char_p
    lib.mk_w4_occupancy.restype = ctypes.c_int
    lib.mk_w4_occupancy.argtypes = [ctypes.c_int] * 6
    lib.mk_w4_items.restype = ctypes.c_longlong
    lib.mk_w4_items.argtypes = [ctypes.c_int] * 9
    lib.mk_w4_launch.restype = ctypes.c_int
    lib.mk_w4_launch.argtypes = (
        [ctypes.c_int] * 6 + [ctypes.c_void_p] * 10 + [ctypes.c_longlong]
        + [ctypes.c_int] * 8 + [ctypes.c_float] * 2 + [ctypes.c_int, ctypes.c_void_p]
    )  # fmt: skip
    return lib


def nvcc_args(build: tuple[int, bool, bool, bool], arch: str, source: Path = SOURCE) -> list[str]:
    """nvcc's arguments for one format variant (`PackedMatrix.build`)."""
    fmt, zero, two_mul, post_scale = build
    return [
        str(source), "-shared", "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
        f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-DMK_FMT={fmt}",
        f"-DMK_ZERO={int(zero)}", f"-DMK_TWO_MUL={int(two_mul)}",
        f"-DMK_INT4_POST={int(post_scale)}",
    ]  # fmt: skip


def arch_of(device: torch.device) -> str:
    """'90' for an sm_90 device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _arch(index)


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"{major}{minor}"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Plan:
    """How one GEMM call spreads: nt MMA column groups of 8 pairs per expert segment (2 when
    experts expect more than 8 pairs, else segments of 8), split_k warps of a block per row
    block of mt 16-row tiles (the others take more rows, sharing activation loads through L1),
    k_blocks blocks per row block (down); ring: the chunks stream through a shared-memory ring
    (else directly into registers: see the .cu file)."""

    nt: int
    split_k: int
    mt: int = 2
    k_blocks: int = 1
    ring: bool = True

    def __post_init__(self) -> None:
        if self.nt not in (1, 2) or (self.mt, self.split_k, self.k_blocks) not in _ANY_SHARE:
            raise ValueError(f"w4a16 plan {self}: nt must be 1 or 2 and (mt, split_k, k_blocks) "
                             f"one of {sorted(_ANY_SHARE)}")  # fmt: skip


@functools.lru_cache(maxsize=4096)
def plan(kind: int, num_pairs: float, num_experts: int, n: int, k: int, sms: int,
         occupancy: tuple[int, int, int, int]) -> Plan:  # fmt: skip
    """How to spread one GEMM (n output rows, k the reduction) over `num_pairs` local pairs
    expected on `num_experts` experts, without a measured plan (`plans.py`): the ring, and the
    share of SHARES[kind] with the least time by COST. occupancy: blocks per multiprocessor of
    the ring variants (nt, mt) = (1, 1), (1, 2), (2, 1), (2, 2) (`occupancy`)."""
    nt = 2 if num_pairs / num_experts > 8 else 1
    segments = max(1.0, expected_experts_used(num_pairs, num_experts))
    best: tuple[float, Plan] | None = None
    for mt, split_k, k_blocks in SHARES[kind]:
        rows = 16 if kind == GATE_UP else 16 * mt  # weight rows of one warp (gate_up: x 2)
        items = segments * math.ceil(n // rows * split_k / WARPS) * k_blocks
        grid = max(1, occupancy[2 * (nt - 1) + mt - 1]) * sms
        item_bytes = ((2 if kind == GATE_UP else 1) * rows * k * COST.bytes_per_weight * WARPS
                      / split_k / k_blocks)  # fmt: skip
        cost = math.ceil(items / grid) * (item_bytes + COST.item_cost_bytes) * max(
            1.0, grid / items) ** COST.underfill_exp  # fmt: skip
        if best is None or cost < best[0]:
            best = (cost, Plan(nt, split_k, mt, k_blocks))
    return best[1]


def occupancy(w: PackedMatrix, kind: int, act: str, has_bias: bool,
              device: torch.device) -> tuple[int, int, int, int]:  # fmt: skip
    """Blocks per multiprocessor of the ring kernels (nt, mt) = (1, 1), (1, 2), (2, 1), (2, 2)
    for these weights (`plan`'s occupancy: its plans take the ring); 0 where a variant does not
    exist."""
    return _occupancy(w.build, arch_of(device), kind, ACT_CODES[act], has_bias, device.index)


@functools.cache
def _occupancy(build, arch, kind, act, has_bias, device_index):
    lib = library(build, arch)
    with torch.cuda.device(device_index):
        return tuple(lib.mk_w4_occupancy(kind, act, int(has_bias), nt, mt, 1)
                     for nt in (1, 2) for mt in (1, 2))  # fmt: skip


def launch(kind: int, w: PackedMatrix, x: torch.Tensor, ids: torch.Tensor,
           topk_weights: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           top_k: int, n: int, how: Plan, act: str = "silu", alpha: float = 0.0,
           limit: float = 0.0, zero_out: torch.Tensor | None = None,
           overlap: bool = False) -> None:  # fmt: skip
    """One GEMM over the P = ids.numel() pairs (see the .cu file). gate_up (kind 0): x [T, K]
    bf16 -> out h [P, n]; down (kind 1): x = h [P, K] -> added into out [T, n]. ids int32 [P],
    topk_weights float32 [P], n the output rows (gate_up: I). zero_out: zeroed by gate_up.
    overlap (down, right after its gate_up on the stream): see `down_overlaps`."""
    P = ids.numel()
    E = w.codes.shape[0]
    K = w.codes.shape[2] * 64
    lib = library(w.build, arch_of(x.device))
    zero_n = zero_out.numel() if zero_out is not None else 0
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = lib.mk_w4_launch(
        kind, ACT_CODES[act], int(bias is not None), how.nt, how.mt, int(how.ring), _ptr(x),
        _ptr(ids), _ptr(topk_weights), _ptr(w.codes), _ptr(w.scales), _ptr(w.zeros),
        _ptr(w.global_scale),
        _ptr(bias), _ptr(out), _ptr(zero_out), zero_n, P, top_k, E, n, K, w.group, how.split_k,
        how.k_blocks, alpha, limit, int(overlap), stream,
    )  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16 kernel: {lib.mk_w4_last_error().decode()}")


def down_overlaps(w13: PackedMatrix, w2: PackedMatrix, act: str, has_bias: bool,
                  gate_up: Plan, down: Plan, num_pairs: int, top_k: int,
                  device: torch.device) -> bool:  # fmt: skip
    """Whether down should start as a programmatic dependent launch of gate_up (sm_90+): its
    blocks are then placed while gate_up finishes, group the pairs and start streaming their
    first weights (`overlap_pays` says where that pays)."""
    return _down_overlaps(w13.build, arch_of(device), ACT_CODES[act], has_bias, gate_up, down,
                          num_pairs, top_k, w13.codes.shape[0], w13.codes.shape[1] * 8,
                          w2.codes.shape[1] * 16, device.index, sm_count(device))  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _down_overlaps(build, arch, act, has_bias, gate_up, down, P, top_k, E, inter, hidden,
                   device_index, sms) -> bool:  # fmt: skip
    if int(arch) < 90:
        return False
    lib = library(build, arch)

    def grid_and_wave(kind: int, how: Plan, n: int) -> tuple[int, int]:
        with torch.cuda.device(device_index):
            per_sm = lib.mk_w4_occupancy(kind, act, int(has_bias), how.nt, how.mt, int(how.ring))
        wave = max(1, per_sm) * sms
        items = lib.mk_w4_items(kind, how.nt, how.mt, P, top_k, E, n, how.split_k, how.k_blocks)
        return max(1, min(items, wave)), wave

    return overlap_pays(*grid_and_wave(GATE_UP, gate_up, inter), *grid_and_wave(DOWN, down, hidden))


OVERLAP_FILL = 0.7  # down's grid over its full wave from which it may always overlap


def overlap_pays(gate_up_grid: int, gate_up_wave: int, down_grid: int, down_wave: int) -> bool:
    """`down_overlaps`' rule, from the two grids and their full waves (blocks that fit at once).
    Overlapping pays where down's grid (nearly) fills a wave, or fits beside gate_up's blocks
    at once: a small grid placed as gate_up frees its slots piles onto the first
    multiprocessors freed. Measured on the H100 (benchmarks/w4a16_notes.md, session 25): down
    at 0.39 of a wave beside a full gate_up, 1.18-1.22x slower (mixtral TP2 T = 1); at 0.55,
    1.02x; at 0.78 and 0.91, 1.5-3% faster; at a full wave 5-18% faster."""
    room = down_wave * (1.0 - gate_up_grid / gate_up_wave)  # down's slots beside gate_up's
    return down_grid >= OVERLAP_FILL * down_wave or down_grid <= room
