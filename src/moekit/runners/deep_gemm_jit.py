"""DeepGEMM's SM90 grouped GEMM kernels, built and launched by moekit's own host code.

The sgl-deep-gemm package ships DeepGEMM's kernel templates (its `include` directory, which its
own JIT compiles). Its compiled Python binding is tied to the torch it was built against: the
0.2.2 wheel misreads torch 2.11's tensors (every call fails its first shape check). So moekit
does not call the binding. `csrc/deep_gemm_launch.cu` instantiates one kernel configuration
(`KernelConfig`), builds its TMA descriptors and launches it; nvcc compiles it once per
configuration into a shared library cached on disk, and ctypes calls it with raw pointers on
torch's current stream (CUDA-graph capturable).

Needs: the package's include directory (found without importing the package), nvcc with
sm_90a support (CUDA 12.3+; $CUDA_HOME, /usr/local/cuda or PATH), an SM90 GPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moekit.runners import _nvcc

SOURCE = Path(__file__).with_name("csrc") / "deep_gemm_launch.cu"
PACKAGE = "deep_gemm"  # import name of sgl-deep-gemm
SMEM_LIMIT = 232448  # SM90 dynamic shared memory per block
MAX_STAGES = 8
DEFAULT_CUDA_HOMES = _nvcc.DEFAULT_CUDA_HOMES


def include_dir() -> Path | None:
    """The DeepGEMM headers shipped in the installed package (not imported), or None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        inc = Path(loc) / "include"
        if (inc / "deep_gemm" / "impls" / "sm90_fp8_gemm_1d2d.cuh").is_file():
            return inc
    return None


def nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin, /usr/local/cuda/bin, then PATH."""
    return _nvcc.nvcc(DEFAULT_CUDA_HOMES)


def problem() -> str | None:
    """None when kernels can be built here, else why not."""
    if include_dir() is None:
        return "the installed deep_gemm package has no SM90 kernel headers (include/deep_gemm)"
    if nvcc() is None:
        return "needs nvcc (CUDA 12.3+) to build DeepGEMM's kernels: set CUDA_HOME or add it to PATH"
    return None


@dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel: d [rows, n] = a [rows, k] @ b[group] [n, k].T over `groups` experts.
    fp8: e4m3 operands with float32 scales (activations per row and 128 columns, weights per
    128 x 128 block), else bf16. masked: the [groups, C, k] layout (rows per group given), else
    groups of contiguous rows, each starting on a row tile (end row per group given)."""

    fp8: bool
    masked: bool
    n: int
    k: int
    groups: int
    block_m: int
    block_n: int
    stages: int
    swizzle_d: int
    num_sms: int
    multicast: int = 1  # 2: CTA pairs share each A tile (TMA multicast in a cluster of 2)

    def smem_bytes(self) -> int:
        """Dynamic shared memory of the kernel (mirrors mk_smem_bytes in the .cu file)."""
        return _smem_bytes(self.fp8, self.block_m, self.block_n, self.k, self.stages)

    def defines(self) -> list[str]:
        vals = dict(FP8=int(self.fp8), MASKED=int(self.masked), N=self.n, K=self.k,
                    GROUPS=self.groups, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    STAGES=self.stages, SWIZZLE_D=self.swizzle_d, NUM_SMS=self.num_sms,
                    MULTICAST=self.multicast)  # fmt: skip
        return [f"-DMK_{k}={v}" for k, v in vals.items()]


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def _smem_bytes(fp8: bool, bm: int, bn: int, k: int, stages: int) -> int:
    elem = 1 if fp8 else 2
    d = _align(bm * bn * 2, 1024)
    stage = (bm + bn) * (128 // elem) * elem
    sfb = 0
    if fp8:
        stage += _align(bm * 4, 128)
        sfb = _align(-(-k // 128) * (1 if 128 % bn == 0 else 2) * 4, 8)
    return d + stages * stage + sfb + stages * 16


def row_tile(masked: bool, rows_per_group: int) -> int:
    """Rows per tile: 64 for the masked layout when a group holds at most 64 rows (decode),
    else 128 (also the contiguous layout's alignment)."""
    return 64 if masked and rows_per_group <= 64 else 128


@dataclass(frozen=True)
class ColumnTiles:
    """Columns per tile (`block_n`). Contiguous layout, H100 (scripts/gpu_profile_deep_gemm.py
    tiles, the qwen3 / deepseek-v3 EP8 / mixtral GEMMs at T = 4096 and 16384): fp8 192 was the
    fastest or within 1% at all 8 GEMMs (0-8% over 128); bf16 256 gained 1-8% where n >= 4096
    and lost up to 7% on qwen3's n = 1536 / 2048. The masked layout keeps 128 (its tiles were
    not compared)."""

    fp8: int = 192
    bf16: int = 128
    bf16_wide: int = 256
    bf16_wide_from_n: int = 4096
    masked: int = 128


COLUMN_TILES = ColumnTiles()


def block_n(fp8: bool, masked: bool, n: int, tiles: ColumnTiles = COLUMN_TILES) -> int:
    """Columns per tile for a GEMM with n output columns (see ColumnTiles)."""
    if masked:
        return tiles.masked
    if fp8:
        return tiles.fp8
    return tiles.bf16_wide if n >= tiles.bf16_wide_from_n else tiles.bf16


def choose(fp8: bool, masked: bool, n: int, k: int, groups: int, rows_per_group: int,
           num_sms: int, multicast: int = 1) -> KernelConfig:  # fmt: skip
    """The configuration for a problem: `row_tile` rows, `block_n` columns, as many pipeline
    stages as shared memory holds (at most MAX_STAGES). multicast 2 (CTA pairs share each A
    tile, a cluster launch) is off by default: the H100 sweep with it was slower at 6 of 8
    large-batch points (benchmarks/results/20261122T0413Z_H100_select_result_multicast2.json);
    its gain over clusters of one alone (1.06-1.19x fp8, scripts/gpu_profile_deep_gemm.py
    multicast) is smaller than what the cluster launch itself costs against a plain launch."""
    bm = row_tile(masked, rows_per_group)
    bn = block_n(fp8, masked, n)
    stages = MAX_STAGES
    while stages > 2 and _smem_bytes(fp8, bm, bn, k, stages) > SMEM_LIMIT:
        stages -= 1
    swizzle_d = next((s for s in (128, 64, 32) if (bn * 2) % s == 0), 0)
    return KernelConfig(fp8, masked, n, k, groups, bm, bn, stages, swizzle_d, num_sms, multicast)


@functools.lru_cache(maxsize=None)
def library(cfg: KernelConfig) -> ctypes.CDLL:
    """The compiled launcher of `cfg` (built on first use, then loaded from the disk cache;
    thread-safe, so several configurations can be built at once)."""
    why = problem()
    if why:
        raise RuntimeError(why)
    inc, compiler = include_dir(), nvcc()
    args = [
        str(SOURCE), "-shared", "-std=c++20", "-O3", "-Xcompiler", "-fPIC,-fconcepts,-Wno-abi",
        "-gencode=arch=compute_90a,code=sm_90a",
        "--expt-relaxed-constexpr", "--expt-extended-lambda",
        "--diag-suppress=39,161,174,177,186,940", f"-I{inc}", *cfg.defines(),
    ]  # fmt: skip
    key = [SOURCE.read_bytes(), repr(sorted(asdict(cfg).items())).encode(),
           str(inc.resolve()).encode(),
           (inc / "deep_gemm" / "impls" / "sm90_fp8_gemm_1d2d.cuh").read_bytes()]  # fmt: skip
    path = _nvcc.build(compiler, args, "deep_gemm", key, f"DeepGEMM kernel {cfg}")
    lib = ctypes.CDLL(str(path))
    lib.mk_launch.restype = ctypes.c_int
    lib.mk_launch.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_uint32] * 2 + [ctypes.c_void_p]
    lib.mk_last_error.restype = ctypes.c_char_p
    lib.mk_smem_bytes.restype = ctypes.c_uint32
    if lib.mk_smem_bytes() != cfg.smem_bytes():
        raise RuntimeError(
            f"DeepGEMM launcher: shared memory {lib.mk_smem_bytes()} != {cfg.smem_bytes()} "
            "computed in Python (deep_gemm_jit._smem_bytes is out of step with the .cu file)"
        )
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def launch(cfg: KernelConfig, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor,
           layout: torch.Tensor, m: int, sfa: torch.Tensor | None = None,
           sfb: torch.Tensor | None = None) -> None:  # fmt: skip
    """d = a @ b[group].T (see KernelConfig); layout int32 [groups].
    Contiguous: a [m, k], d [m, n]; layout[g] = end row of group g, which starts at the previous
    end rounded up to block_m (the kernel visits only those row tiles; other rows of d are left
    unwritten). Masked: a [groups * m, k], d [groups * m, n]; layout[g] = rows used by group g
    (m a multiple of block_m). b [groups * n, k]. fp8: sfa float32 [(groups,) k / 128, m]
    (MN-major), sfb float32 [groups, n / 128, k / 128]."""
    rows = cfg.groups * m if cfg.masked else m
    want = {"a": (a, (rows, cfg.k)), "b": (b, (cfg.groups * cfg.n, cfg.k)),
            "d": (d, (rows, cfg.n))}  # fmt: skip
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {list(shape)}, got {list(t.shape)}")
    if m % cfg.block_m:
        raise ValueError(f"rows per block: m={m} must be a multiple of block_m={cfg.block_m}")
    if layout.dtype != torch.int32 or layout.numel() != cfg.groups:
        raise ValueError(f"layout: int32 [{cfg.groups}] (rows or end row per group)")
    if cfg.fp8 and (sfa is None or sfb is None or sfa.shape[-1] != m or sfa.stride(-2) != m):
        raise ValueError("fp8 needs sfa [(groups,) k / 128, m] (MN-major) and sfb")
    lib = library(cfg)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    err = lib.mk_launch(_ptr(a), _ptr(sfa), _ptr(b), _ptr(sfb), _ptr(d), _ptr(layout), m, m,
                        stream)  # fmt: skip
    if err:
        raise RuntimeError(f"DeepGEMM kernel {cfg}: {lib.mk_last_error().decode()}")
