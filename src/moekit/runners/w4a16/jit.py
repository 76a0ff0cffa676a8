"""Build and launch the `w4a16` kernels (csrc/w4a16.cu): nvcc, one shared library per weight
format variant (format, zero points, one or two scale products) and GPU architecture, cached on
disk (`moekit.runners._nvcc`); ctypes calls it on torch's current stream (CUDA-graph safe)."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.runners import _nvcc
from moekit.runners.w4a16.pack import PackedMatrix

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "w4a16.cu"
MAX_PAIRS = 128  # mirrors MAX_P in the .cu file (checked when a library loads)
GATE_UP, DOWN = 0, 1
ACT_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
WARPS = 4  # per block (mirrors the .cu file)
# How a GEMM's work spreads, in order of growing parallelism: (mt, split_k), mt 16-row weight
# tiles per warp (gate_up: one gate and one up tile), split_k warps of a block on one row
# block's K.
SHARES = {GATE_UP: ((2, 1), (2, 2), (2, 4)), DOWN: ((2, 1), (2, 2), (2, 4), (1, 4))}
SPLITS = (1, 2, 4)
# Blocks of work per multiprocessor from which a GEMM stops spreading further. Fitted to the
# H100 (session 23: each GEMM of the four presets, mxfp4, T = 1 ... 64, timed at every split;
# scripts/gpu_w4a16_profile.py splits): the first share reaching these numbers was within
# about 1% of each GEMM's best, on average.
BLOCKS_PER_SM = {GATE_UP: 11.0, DOWN: 9.0}


def problem() -> str | None:
    """None when the kernels can be built here, else why not."""
    if _nvcc.nvcc() is None:
        return "needs nvcc (CUDA 11.8+) to build its kernels: set CUDA_HOME or add it to PATH"
    return None


@functools.cache
def library(fmt: int, zero: bool, two_mul: bool, arch: str) -> ctypes.CDLL:
    """The compiled kernels of one format variant for `arch` ('90' for sm_90)."""
    why = problem()
    if why:
        raise RuntimeError(why)
    args = [
        str(SOURCE), "-shared", "-std=c++17", "-O3", "-Xcompiler", "-fPIC",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-DMK_FMT={fmt}", f"-DMK_ZERO={int(zero)}", f"-DMK_TWO_MUL={int(two_mul)}",
    ]  # fmt: skip
    path = _nvcc.build(_nvcc.nvcc(), args, "w4a16", [SOURCE.read_bytes()],
                       f"w4a16 kernels (format {fmt}, zero {zero}, two_mul {two_mul})")  # fmt: skip
    lib = ctypes.CDLL(str(path))
    lib.mk_w4_max_pairs.restype = ctypes.c_int
    if lib.mk_w4_max_pairs() != MAX_PAIRS:
        raise RuntimeError(f"w4a16 kernels take {lib.mk_w4_max_pairs()} pairs, jit.py says "
                           f"{MAX_PAIRS}: the two are out of step")  # fmt: skip
    lib.mk_w4_last_error.restype = ctypes.c_char_p
    lib.mk_w4_launch.restype = ctypes.c_int
    lib.mk_w4_launch.argtypes = (
        [ctypes.c_int] * 5 + [ctypes.c_void_p] * 10 + [ctypes.c_longlong]
        + [ctypes.c_int] * 7 + [ctypes.c_float] * 2 + [ctypes.c_void_p]
    )  # fmt: skip
    return lib


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class Plan:
    """How one GEMM call spreads: nt MMA column groups of 8 pairs per expert segment (2 when
    experts expect more than 8 pairs, else segments of 8), split_k warps of a block per row
    block of mt 16-row tiles (the others take more rows, sharing activation loads through L1)."""

    nt: int
    split_k: int
    mt: int = 2


def plan(kind: int, num_pairs: float, num_experts: int, n: int, sms: int,
         pairs_per_expert: float) -> Plan:  # fmt: skip
    """The first of SHARES[kind] that gives every multiprocessor BLOCKS_PER_SM blocks of work,
    for `num_pairs` local pairs expected over `num_experts` experts."""
    nt = 2 if pairs_per_expert > 8 else 1
    used = num_experts * -math.expm1(num_pairs * math.log1p(-1 / num_experts)) if (
        num_experts > 1) else min(1.0, num_pairs)  # fmt: skip
    segments = max(1.0, used)
    for mt, split_k in SHARES[kind]:
        row_blocks = n // (16 if kind == GATE_UP else 16 * mt)
        if segments * math.ceil(row_blocks * split_k / WARPS) >= BLOCKS_PER_SM[kind] * sms:
            break
    return Plan(nt, split_k, mt)


def launch(kind: int, w: PackedMatrix, x: torch.Tensor, ids: torch.Tensor,
           topk_weights: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           top_k: int, n: int, how: Plan, act: str = "silu", alpha: float = 0.0,
           limit: float = 0.0, zero_out: torch.Tensor | None = None) -> None:  # fmt: skip
    """One GEMM over the P = ids.numel() pairs (see the .cu file). gate_up (kind 0): x [T, K]
    bf16 -> out h [P, n]; down (kind 1): x = h [P, K] -> added into out [T, n]. ids int32 [P],
    topk_weights float32 [P], n the output rows (gate_up: I). zero_out: zeroed by gate_up."""
    P = ids.numel()
    E = w.codes.shape[0]
    K = w.codes.shape[2] * 64
    lib = library(w.fmt, w.has_zero, w.two_mul, arch_of(x.device))
    zero_n = zero_out.numel() if zero_out is not None else 0
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = lib.mk_w4_launch(
        kind, ACT_CODES[act], int(bias is not None), how.nt, how.mt, _ptr(x), _ptr(ids),
        _ptr(topk_weights), _ptr(w.codes), _ptr(w.scales), _ptr(w.zeros), _ptr(w.global_scale),
        _ptr(bias), _ptr(out), _ptr(zero_out), zero_n, P, top_k, E, n, K, w.group, how.split_k,
        alpha, limit, stream,
    )  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16 kernel: {lib.mk_w4_last_error().decode()}")
