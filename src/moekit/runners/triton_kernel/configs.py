"""Kernel configs of the `triton_kernel` runner as data, and the one function that picks one.

A call's config depends on the mean rows per expert, T*K/E (so, for a given layer shape, on the
batch size): `HEURISTIC` is a table of (upper bound on rows per expert, config), first match
wins; the blocks are then clamped to the GEMM's size (`config_for`). Written for Hopper (H100:
wgmma wants BLOCK_M >= 64, 132 SMs, 227 KB shared memory) and correct anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 16 and not v & (v - 1)


@dataclass(frozen=True)
class Tile:
    """One GEMM's column block (block_n: output columns; gate_up reads 2 * block_n weight
    rows), reduction step block_k, warps and software-pipeline stages."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"Tile.{name} must be a power of two >= 16, got {getattr(self, name)!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"Tile.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"Tile.num_stages must be in 1..8, got {self.num_stages!r}")


@dataclass(frozen=True)
class KernelConfig:
    """block_m: rows per work tile (one expert's sorted rows; both GEMMs use the routing's
    tiles); group_m: work tiles that share a weight column block in program order (L2 reuse);
    programs_per_sm: persistent programs per SM (grid = SMs * this, fewer if there is less
    work); tma: load weights (and, in down, the intermediate) through TMA descriptors where
    strides allow (pointer loads otherwise)."""

    block_m: int = 64
    gate_up: Tile = field(default_factory=Tile)
    down: Tile = field(default_factory=Tile)
    group_m: int = 8
    programs_per_sm: int = 1
    tma: bool = True

    def __post_init__(self) -> None:
        if not _pow2(self.block_m):
            raise ValueError(f"KernelConfig.block_m must be a power of two >= 16, got {self.block_m!r}")
        if not 1 <= self.group_m <= 64:
            raise ValueError(f"KernelConfig.group_m must be in 1..64, got {self.group_m!r}")
        if not 1 <= self.programs_per_sm <= 8:
            raise ValueError(
                f"KernelConfig.programs_per_sm must be in 1..8, got {self.programs_per_sm!r}"
            )


@dataclass(frozen=True)
class RoutingTuning:
    """chunk: pairs per program of the counting sort (power of two); scan_elems: elements of
    one [rows, EP] tile in the single-program scan; cpu_programs: persistent programs in the
    CPU interpreter (more than one, so the work loop is exercised)."""

    chunk: int = 1024
    scan_elems: int = 4096
    num_warps: int = 4
    cpu_programs: int = 3


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


def config_for(num_tokens: int, top_k: int, num_experts: int, hidden: int, intermediate: int,
               interleaved: bool = False) -> KernelConfig:  # fmt: skip
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
