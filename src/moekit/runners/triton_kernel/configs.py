"""Kernel configs of the `triton_kernel` runner as data, and the one function that picks one.

`config_for` first looks for a tuned table shipped for the layer shape, dtype, device and
Triton version (src/moekit/configs/triton_kernel/*.json, {batch size: config}, written by
`scripts/gpu_triton_kernel.py --tune` on the GPU), else the same table tuned with another
Triton version, newest first (`runners._tables.version_candidates`); without one (or with no
tuned batch size within a factor 2), `heuristic_config` applies: it depends on the mean rows
per expert, T*K/E, through `HEURISTIC`, a table of (upper bound on rows per expert, config),
first match wins, the blocks then clamped to the GEMM's size. Written for Hopper (H100: wgmma
wants BLOCK_M >= 64, 132 SMs, 227 KB shared memory) and correct anywhere.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from moekit._triton_host import next_pow2
from moekit.log import log_once
from moekit.runners._align import pairs_per_chunk
from moekit.runners._tables import (
    device_slug,
    nearest_batch,
    triton_version,
    version_candidates,
    version_note,
)

REDUCES = ("sum", "atomic")


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 16 and not v & (v - 1)


@dataclass(frozen=True)
class Tile:
    """One GEMM's column block (block_n: output columns; gate_up reads 2 * block_n weight
    rows), reduction step block_k, warps and software-pipeline stages; flatten /
    warp_specialize: the persistent work loop's `tl.range` flags (flatten: one software
    pipeline across work items, so the next item's loads overlap this one's epilogue;
    warp_specialize: Triton's automatic producer / consumer warp split); persistent: a grid of
    SMs * programs_per_sm programs that loop over the work items (False: one program per
    possible work item, the ones past the routing's items exit at once, and the hardware
    schedules the rest)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    flatten: bool = False
    warp_specialize: bool = False
    persistent: bool = True

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"Tile.{name} must be a power of two >= 16, got {getattr(self, name)!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tile.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"Tile.num_stages must be in 1..8, got {self.num_stages!r}")
        for name in ("flatten", "warp_specialize", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Tile.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class KernelConfig:
    """block_m: rows per work tile (one expert's sorted rows; both GEMMs use the routing's
    tiles); group_m: work tiles that share a weight column block in program order (L2 reuse);
    programs_per_sm: persistent programs per SM (grid = SMs * this, fewer if there is less
    work); tma: load weights (and, in down, the intermediate) through TMA descriptors where
    strides allow (pointer loads otherwise); reduce: how the K rows of a token are summed,
    'sum' (down stores each pair's row, then a deterministic kernel sums them: bit-exact
    run to run) or 'atomic' (down's epilogue adds each row into the zeroed output: no [P, H]
    intermediate, the order of the bf16 additions varies between runs); interleaved_one_tile
    (interleaved gate/up weights only): gate_up holds one accumulator over 2 * block_n
    consecutive weight rows and splits it in the epilogue, instead of two accumulators over the
    strided gate rows (2n) and up rows (2n + 1)."""

    block_m: int = 64
    gate_up: Tile = field(default_factory=Tile)
    down: Tile = field(default_factory=Tile)
    group_m: int = 8
    programs_per_sm: int = 1
    tma: bool = True
    reduce: str = "sum"
    interleaved_one_tile: bool = False

    def __post_init__(self) -> None:
        if not _pow2(self.block_m):
            raise ValueError(f"KernelConfig.block_m must be a power of two >= 16, got {self.block_m!r}")
        if not 1 <= self.group_m <= 64:
            raise ValueError(f"KernelConfig.group_m must be in 1..64, got {self.group_m!r}")
        if not 1 <= self.programs_per_sm <= 8:
            raise ValueError(
                f"KernelConfig.programs_per_sm must be in 1..8, got {self.programs_per_sm!r}"
            )
        if self.reduce not in REDUCES:
            raise ValueError(
                f"KernelConfig.reduce must be one of {', '.join(REDUCES)}, got {self.reduce!r}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KernelConfig:
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        d = dict(d)
        tiles = {}
        for name in ("gate_up", "down"):
            t = dict(d.pop(name, {}))
            bad = set(t) - {f.name for f in fields(Tile)}
            if bad:
                raise ValueError(f"Tile: unknown keys {sorted(bad)}")
            tiles[name] = Tile(**t)
        bad = set(d) - {f.name for f in fields(cls)}
        if bad:
            raise ValueError(f"KernelConfig: unknown keys {sorted(bad)}")
        return cls(**d, **tiles)


@dataclass(frozen=True)
class RoutingTuning:
    """Pairs per program of the counting sort: the power of two that cuts P into at most
    max_chunks chunks, clamped to [min_chunk, max_chunk] (and at most P's own power of two);
    fused_max_chunks: from 2 up to this many chunks the scatter programs sum the chunk
    histograms themselves (two kernels), else a one-program scan runs between (three);
    scan_elems: elements of one [rows, EP] tile of those sums; cpu_programs: persistent
    programs in the CPU interpreter (more than one, so the work loop is exercised).

    Timed alone on the H100 (scripts/gpu_probe_routing.py, benchmarks/triton_kernel_notes.md,
    session 48), us a call, E = 128, K = 8, T = 256 / 1024 / 4096 / 16384: 14.6 / 11.6 / 11.6 /
    16.7 with 1024-pair chunks and the scan kernel, 7.9 / 7.1 / 9.2 / 13.8 with these; one
    chunk (P <= min_chunk) keeps the scan kernel: summed there, E = 128 read 18.0 against 15.7."""

    min_chunk: int = 256
    max_chunk: int = 1024
    max_chunks: int = 64
    fused_max_chunks: int = 128
    scan_elems: int = 4096
    num_warps: int = 4
    cpu_programs: int = 3

    def chunk(self, num_pairs: int) -> int:
        want = pairs_per_chunk(num_pairs, self.min_chunk, self.max_chunks, self.max_chunk)
        return max(16, min(want, next_pow2(num_pairs)))  # at most P's power of two

    def sums_in_scatter(self, num_chunks: int) -> bool:
        return 1 < num_chunks <= self.fused_max_chunks


ROUTING = RoutingTuning()

# (max mean rows per expert, config): first match wins.
HEURISTIC: tuple[tuple[float, KernelConfig], ...] = (
    (16, KernelConfig(16, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), group_m=1, programs_per_sm=2)),
    (48, KernelConfig(32, Tile(64, 128, 4, 4), Tile(64, 128, 4, 4), group_m=4, programs_per_sm=2)),
    (160, KernelConfig(64, Tile(64, 64, 4, 4), Tile(128, 64, 4, 4), group_m=8, programs_per_sm=2)),
    (float("inf"), KernelConfig(128, Tile(128, 64, 8, 3), Tile(128, 64, 8, 4), group_m=8)),
)


def _clamp(n: int, cap: int) -> int:
    """The block size for a dimension of size n: cap, or the power of two >= max(n, 16)."""
    p = 16
    while p < min(n, cap):
        p *= 2
    return p


def heuristic_config(num_tokens: int, top_k: int, num_experts: int, hidden: int,
                     intermediate: int, interleaved: bool = False) -> KernelConfig:  # fmt: skip
    """The heuristic config of a call (T tokens, K, E, H, I), blocks clamped to the GEMMs:
    gate_up is [rows, H] x [H, 2I] (block_n counts activated columns), down [rows, I] x [I, H].
    Interleaved gate/up tiles hold 2 * block_n rows, kept <= 256 (the TMA block limit)."""
    rows = num_tokens * top_k / max(num_experts, 1)
    cfg = next(c for bound, c in HEURISTIC if rows <= bound)
    g, d = cfg.gate_up, cfg.down
    g_n = _clamp(intermediate, min(g.block_n, 128) if interleaved else g.block_n)
    return replace(
        cfg,
        gate_up=replace(g, block_n=g_n, block_k=_clamp(hidden, g.block_k)),
        down=replace(d, block_n=_clamp(hidden, d.block_n), block_k=_clamp(intermediate, d.block_k)),
    )


# ----------------------------------------------------------------------------------------------
# Tuned tables (shipped JSON, written by scripts/gpu_triton_kernel.py --tune)
# ----------------------------------------------------------------------------------------------


def table_dir() -> Path:
    """The shipped tables: src/moekit/configs/triton_kernel/."""
    return Path(__file__).resolve().parents[2] / "configs" / "triton_kernel"


def table_name(num_experts: int, top_k: int, hidden: int, intermediate: int, act: str,
               interleaved: bool, dtype: str, device: str, triton_version: str) -> str:  # fmt: skip
    """The file name of one layer shape's table, e.g.
    E=128,K=8,H=2048,I=768,act=silu,dtype=bfloat16,device=NVIDIA_H100_80GB_HBM3,triton=3.6.0.json"""
    a = act + ("-interleaved" if interleaved else "")
    return (f"E={num_experts},K={top_k},H={hidden},I={intermediate},act={a},dtype={dtype},"
            f"device={device_slug(device)},triton={triton_version}.json")  # fmt: skip


@functools.lru_cache(maxsize=None)
def read_table(path: Path) -> dict[int, KernelConfig] | None:
    """{batch size: config} of one table file, None if it does not exist; errors name the file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        table = {int(b): KernelConfig.from_dict(c) for b, c in data["configs"].items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"bad triton_kernel config file {path}: {err}") from err
    if not table or min(table) < 1:
        raise ValueError(f"bad triton_kernel config file {path}: no positive batch-size keys")
    return table


@functools.cache
def _table_path(directory: Path, name: str, version: str) -> Path | None:
    """The file holding table `name` in `directory`: its own, else the newest other Triton
    version's (`version_candidates`), None if none. Resolved and logged once per process (the
    lookup runs on every call of the runner)."""
    for path in version_candidates((directory,), name, version):
        if path.is_file():
            log_once(logging.INFO, f"triton_kernel runner: tuned configs from {path.name}"
                     f"{version_note(path, version)}")  # fmt: skip
            return path
    return None


def pick(table: dict[int, KernelConfig], num_tokens: int) -> KernelConfig | None:
    """The config of the tuned batch size nearest to num_tokens if that is within a factor
    TABLE_REACH; else None (the heuristic applies)."""
    best = nearest_batch(table, num_tokens, TABLE_REACH)
    return None if best is None else table[best]


TABLE_REACH = 2.0


def config_for(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
               interleaved: bool = False, act: str = "silu", dtype: str | None = None,
               device: str | None = None) -> KernelConfig:  # fmt: skip
    """The config of a call: the shipped tuned table of this shape, dtype (e.g. 'bfloat16'),
    device name and Triton version when one has a batch size near num_tokens (`pick`), else
    `heuristic_config`."""
    if dtype is not None and device is not None:
        version = triton_version()
        name = table_name(num_experts, top_k, hidden, intermediate, act, interleaved, dtype,
                          device, version)  # fmt: skip
        path = _table_path(table_dir(), name, version)
        table = read_table(path) if path is not None else None
        cfg = pick(table, num_tokens) if table is not None else None
        if cfg is not None:
            return cfg
    return heuristic_config(num_tokens, top_k, num_experts, hidden, intermediate, interleaved)
