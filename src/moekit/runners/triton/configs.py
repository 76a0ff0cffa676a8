"""Kernel configs of the `triton` runner as data: tuned JSON tables and a heuristic default.

One table per GEMM and weight shape, keyed by (gemm, E, N, K, dtype, device name, Triton
version, weight format with its block / group shape: `_tables.quant_tag`), with a config per
batch size inside; the batch size nearest to the call's (in log2 distance) wins. A batch size
counts tokens whose every pair is local: an EP rank that sees T tokens with a share s of their
pairs local looks up T * s (`_tables.table_key`; keys below 1 are tuned on such ranks). GEMM
names and shapes:
  gate_up: x [*, H] @ w13[e].T -> N = 2I, K = H
  down:    h [*, I] @ w2[e].T  -> N = H,  K = I
Lookup order: the user directory (`MOEKIT_CONFIG_DIR`/triton) before the files shipped in
`moekit/configs/triton`, a table tuned with this Triton version before one tuned with
another, passing over a table with no entry within `TABLE_REACH` of the call's batch size when
a later one has one; without a table of its own, the config of the nearest tuned shape
(`transferred`: same GEMM, dtype and weight format, tuned on this device or one of the same
compute capability, at the entry whose rows per used expert, output width and K are nearest
the call's), then the heuristic `default_config`. A table counts as the shape's own only up to
`TABLE_SPAN_REACH` x the largest batch size it was tuned for (a table tuned for decode batches
says nothing of prefill's). A quantized format without a table of its own or a near one takes
the unquantized config of the same shape (tuned, transferred or default) through
`adapt_config`. Which one is used is logged once per shape.
File format (written by `moekit tune`):
  {"key": {...}, "configs": {"<T>": {GemmConfig fields}}, "meta": {...}}
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from moekit import envs
from moekit.log import log_once
from moekit.runners._shared import expected_experts_used
from moekit.runners._tables import (
    MIN_KEY,
    device_slug,
    nearest_batch,
    parse_key,
    triton_version,
    version_candidates,
    version_note,
)

GEMMS = ("gate_up", "down")
_CODE = re.compile(r"m(\d+)n(\d+)k(\d+)g(\d+)w(\d+)s(\d+)(T?)(A?)(M?)(?:K(\d+))?(?:F(\d+))?")
REDUCE_MODES = ("kernel", "atomic")
SPLIT_K_OPTIONS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GemmConfig:
    """Block sizes and schedule of one grouped GEMM launch.

    block_m: rows per program (pairs sorted by expert, padded to it; 1: one pair per program,
    its products summed on the CUDA cores instead of an MMA, for decode); block_n: output columns
    per program (for gate_up: activated columns, the program reads 2 * block_n weight rows);
    block_k: reduction step; group_m: row blocks that share a weight tile in program order;
    swap_ab: compute the transposed tile (weights in the MMA's M slot; for small block_m);
    reduce (down only): 'kernel' stores each pair's row and sums over K in a second kernel,
    'atomic' adds rows into the output (zeroed by the gate_up launch) with atomics;
    tma: load weight tiles (and, in down, the h tiles) through TMA descriptors (where strides
    allow; pointer loads otherwise);
    split_k: programs per output tile, each over its share of the K steps (more programs for
    decode batches, where a few hundred weight tiles leave SMs idle). down (reduce 'atomic'
    only): each adds its product into the output (masked rows, which store instead of
    adding, run unsplit). gate_up: each stores its float32 sums in a workspace, and the last
    program of a tile adds them up and applies the activation.
    fold_rows: the most rows of a short last block that the block before it computes
    (`PipelineConfig.fold_rows`, which it replaces for this launch; 0: none; None: the
    pipeline's). 32 at mixtral-8x7b TP2's T = 1024 on the H100, where experts get 256 +- 16
    rows (benchmarks/triton_notes.md, session 37).
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    reduce: str = "kernel"
    tma: bool = False
    split_k: int = 1
    fold_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if name == "block_m" and v == 1:
                continue
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(
                    f"GemmConfig.{name} must be a power of two >= 16"
                    + (" (or 1)" if name == "block_m" else "")
                    + f", got {v!r}"
                )
        if self.block_m == 1 and self.swap_ab:
            raise ValueError(
                "GemmConfig: block_m 1 multiplies on the CUDA cores; swap_ab must be False"
            )
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.group_m <= 64 or not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemmConfig group_m / num_stages out of range: {self}")
        if self.reduce not in REDUCE_MODES:
            raise ValueError(
                f"GemmConfig.reduce: unknown {self.reduce!r}; allowed: {', '.join(REDUCE_MODES)}"
            )
        if self.split_k not in SPLIT_K_OPTIONS:
            raise ValueError(
                f"GemmConfig.split_k must be one of {SPLIT_K_OPTIONS}, got {self.split_k!r}"
            )
        if self.fold_rows is not None and (not isinstance(self.fold_rows, int)
                                           or self.fold_rows < 0):  # fmt: skip
            raise ValueError(f"GemmConfig.fold_rows must be None or >= 0, got {self.fold_rows!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["fold_rows"] is None:
            del d["fold_rows"]  # the pipeline's: tables that do not set it stay as they were
        return d

    def code(self) -> str:
        """A short name, as `moekit tune` logs configs and probes take them: m64n128k64g8w4s3
        (block_m, block_n, block_k, group_m, warps, stages), then T swap_ab, A atomic reduce,
        M TMA, K<n> split-K, F<n> fold_rows."""
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}g{self.group_m}"
                f"w{self.num_warps}s{self.num_stages}" + ("T" if self.swap_ab else "")
                + ("A" if self.reduce == "atomic" else "") + ("M" if self.tma else "")
                + (f"K{self.split_k}" if self.split_k > 1 else "")
                + (f"F{self.fold_rows}" if self.fold_rows is not None else ""))  # fmt: skip

    @classmethod
    def from_code(cls, text: str) -> GemmConfig:
        """The config `code()` names; ValueError for anything else."""
        m = _CODE.fullmatch(text)
        if m is None:
            raise ValueError(f"GemmConfig: bad config code {text!r} (e.g. m64n128k64g8w4s3AMK4)")
        bm, bn, bk, g, w, st = (int(v) for v in m.groups()[:6])
        return cls(bm, bn, bk, g, w, st, swap_ab=bool(m[7]),
                   reduce="atomic" if m[8] else "kernel", tma=bool(m[9]),
                   split_k=int(m[10] or 1),
                   fold_rows=None if m[11] is None else int(m[11]))  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> GemmConfig:
        allowed = {f.name for f in fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"GemmConfig: unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(allowed))}"
            )
        return cls(**d)


@dataclass(frozen=True)
class PipelineConfig:
    """Choices above the GEMM configs. direct_max_tokens: batches of at most this many tokens
    skip the alignment kernel: each GEMM block finds the pairs of its expert among the
    call's pairs itself (`ops.Rows.direct`; block_m capped at 16, and with block_m 1 an expert
    picked twice is read twice). On the H100 (six preset / format jobs, T = 2 and 4, layer in
    turns against the alignment, benchmarks/triton_notes.md) that took 1.6% off in geometric
    mean (qwen3 fp8 T = 2: 7%; worst point 1.6% slower); at T = 8 and 16 it lost up to 18%.
    fuse_act_quant: with direct rows, fp8 per-token-group activations are quantized
    inside the GEMMs (no separate quantization launches). Off: on the H100 the qwen3 fp8
    block-wise T = 1 call measured 29.1 us with it (together with group scales loaded one
    step ahead) against 25.5 us with neither; each program re-quantizes its 16 identical
    rows with IEEE divisions. asm_dequant: the packed 4-bit formats (int4_w4a16, mxfp4, nvfp4)
    dequantize in PTX on a GPU (`_kernels._dequant_bytes_asm`; off: its portable twin
    `_dequant_nibbles`, the same values). nvfp4_bf16_scale: with bf16 activations nvfp4
    weights are dequantized in bf16 arithmetic with the float32 group scale (e4m3 x global)
    rounded to bf16 first (off: in float32, bit-identical to `moekit.quant.dequantize`).
    packed_maxnreg: a register cap (PTX .maxnreg) for the GEMMs of the packed 4-bit formats,
    to fit more programs per SM (None: the compiler's choice; an experiment knob, see
    benchmarks/triton_notes.md).
    pdl: standard calls of at most decode_max_pairs (token, expert) pairs on a GPU of compute
    capability 9.0+ chain their kernels (alignment, quantization, GEMMs) as programmatic
    dependent launches, so that each kernel's programs are placed while the one before it
    finishes (`ops.decode_pdl`). On the H100 that took 4-13% off T = 1 in fp8 (four
    kernels), 1-3% in bf16, and up to 3% at T = 4; from 16 tokens on it was within the noise
    either way (benchmarks/triton_notes.md). tail_levels: with sorted rows, a block of a
    GEMM in tail_gemms whose valid rows all fit in its first block_m / 2^j rows, j <= levels
    (an expert's last, partly filled block), multiplies only the fewest such rows (0: every
    block a whole block_m tile); few_blocks_tail_levels where a used expert gets at most
    few_blocks blocks of rows on average. Not for the w8a8 formats. On the H100 (four
    presets, T = 256-16384, benchmarks/triton_notes.md): bf16 one level took 0-8% off the
    layer; a second (block_m / 4) took up to 4% more where experts get 1-2 blocks and lost
    1-7% where they get 4 or more; fp8 block-wise lost up to 5% with tails. fold_rows: with
    sorted rows and unquantized weights, an expert's last block holding at most fold_rows valid
    rows after a full block of the same expert is computed by the full block's program, on the
    weight tiles it loads anyway (one more MMA, operands swapped so that 16 rows stay on wgmma),
    instead of by a program of its own that would stream those tiles again (0: off); with
    fold_levels > 1, on the fewest of fold_rows / 2^j rows (j < fold_levels, at least 16).
    GEMMs in fold_gemms, one K share, not swapped. Four bf16 presets at T = 1024-16384, layer in
    turns (benchmarks/triton_notes.md): 16 rows took 1-6% off at 9 of the 10 points where it
    applies on the H100 (mixtral TP2 T = 16384: 2% slower, within that point's spread) and 2-13%
    at 7 of 10 on the H200 (mixtral TP2 T = 1024: 4% slower); 32 rows in two levels gained 10%
    at mixtral TP2 T = 1024 on the H100 but lost up to 5% elsewhere: a table's config sets
    `GemmConfig.fold_rows` where another size pays. quant_h_in_gate_up: fp8 per-token-group
    formats whose gate_up tiles are whole groups wide quantize h in its epilogue for down
    (`ops.h_quant_dtype`), instead of in a kernel of their own between the GEMMs: on the H100
    1.4-7% off the layer at T = 1024 / 4096 (qwen3, deepseek-v3, gpt-oss; narrower tiles, as
    the decode tables have, meeting through arrival counts lost 1-17% at T <= 256:
    benchmarks/triton_notes.md, session 46)."""

    direct_max_tokens: int = 4
    fuse_act_quant: bool = False
    asm_dequant: bool = True
    nvfp4_bf16_scale: bool = True
    packed_maxnreg: int | None = None
    pdl: bool = True
    decode_max_pairs: int = 32
    tail_levels: int = 1
    few_blocks_tail_levels: int = 2
    few_blocks: float = 2.0
    tail_gemms: tuple[str, ...] = ("gate_up", "down")
    fold_rows: int = 16
    fold_levels: int = 1
    fold_gemms: tuple[str, ...] = ("gate_up", "down")
    quant_h_in_gate_up: bool = True


PIPELINE = PipelineConfig()


@dataclass(frozen=True)
class TableKey:
    """What a tuned table is for. n, k: the GEMM's output columns and reduction length."""

    gemm: str
    num_experts: int
    n: int
    k: int
    dtype: str
    device: str
    triton: str
    quant: str = "unquantized"

    def filename(self) -> str:
        quant = "" if self.quant == "unquantized" else f",quant={self.quant}"
        return (
            f"{self.gemm},E={self.num_experts},N={self.n},K={self.k},dtype={self.dtype}{quant},"
            f"device={device_slug(self.device)},triton={self.triton}.json"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def shipped_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "configs" / "triton"


def user_dir() -> Path:
    return Path(envs.MOEKIT_CONFIG_DIR.get()).expanduser() / "triton"


def gemm_shape(gemm: str, hidden: int, intermediate: int) -> tuple[int, int]:
    """(N, K) of `gemm` for hidden size H and intermediate size I."""
    if gemm == "gate_up":
        return 2 * intermediate, hidden
    if gemm == "down":
        return hidden, intermediate
    raise ValueError(f"gemm: unknown {gemm!r}; allowed: {', '.join(GEMMS)}")


# ---------------------------------------------------------------------------------------------
# Tables on disk
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """Configs per batch size, where they came from, and the tuned shape's top_k (None where
    the file's meta does not say)."""

    configs: dict[int | float, GemmConfig]
    source: str
    top_k: int | None = None

    def pick(self, num_tokens: float) -> GemmConfig:
        """The config of the batch size nearest to num_tokens (`nearest_batch`)."""
        return self.configs[nearest_batch(self.configs, num_tokens)]


def read_table(path: Path, data: dict | None = None) -> Table:
    """Load one JSON table (`data`: its contents, when already parsed); errors name the file."""
    try:
        data = json.loads(path.read_text()) if data is None else data
        configs = {parse_key(b): GemmConfig.from_dict(c) for b, c in data["configs"].items()}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"bad triton config file {path}: {err}") from err
    if not configs:
        raise ValueError(f"bad triton config file {path}: no batch-size keys")
    top_k = data.get("meta", {}).get("top_k")
    return Table(configs, str(path), int(top_k) if top_k else None)


def write_table(path: Path, key: TableKey, configs: dict[int, GemmConfig], meta: dict) -> None:
    """Write (or overwrite) one JSON table, batch sizes sorted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "key": key.to_dict(),
        "configs": {str(b): configs[b].to_dict() for b in sorted(configs)},
        "meta": meta,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def _candidates(key: TableKey) -> list[Path]:
    """Files that may hold `key`'s table (`version_candidates`; user dir before shipped)."""
    return version_candidates((user_dir(), shipped_dir()), key.filename(), key.triton)


# A table's entry stands for batch sizes within this factor of its own (the tuned sweep's sizes
# are 4x apart). A table with none that near (`moekit tune --batch-sizes` on a few sizes) gives
# way to the next one in lookup order that has one, e.g. a full table of another Triton version.
TABLE_REACH = 2.0


@functools.cache
def find_table(key: TableKey, num_tokens: float | None = None) -> Table | None:
    """The first readable table for `key` (see module docstring); with `num_tokens`, the first
    with an entry within TABLE_REACH of it, else the one whose nearest entry is nearest (the
    earlier on ties); None without a table. Tables are read in order until one serves.
    Cached: call `clear_cache()` after writing new files."""
    best = None  # (log2 distance of its nearest entry, table)
    t = None if num_tokens is None else math.log2(max(num_tokens, MIN_KEY))
    for path in _candidates(key):
        if path.is_file():
            table = read_table(path)
            if t is None:
                return table
            gap = abs(math.log2(nearest_batch(table.configs, num_tokens)) - t)
            if gap <= math.log2(TABLE_REACH):
                return table
            if best is None or gap < best[0]:
                best = (gap, table)
    return None if best is None else best[1]


def clear_cache() -> None:
    get_config.cache_clear()
    masked_config.cache_clear()
    find_table.cache_clear()
    tuned_shapes.cache_clear()


# ---------------------------------------------------------------------------------------------
# The nearest tuned shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TunedShape:
    """A table with what its configs were tuned for: its key, the shape's top_k (the table's,
    from its meta) and the compute capability of its device (None where the file does not
    say)."""

    key: TableKey
    capability: tuple[int, int] | None
    table: Table

    @property
    def top_k(self) -> int:
        return self.table.top_k


@functools.cache
def tuned_shapes() -> tuple[TunedShape, ...]:
    """Every table in the user directory, then the shipped one, whose meta names the tuned
    shape's top_k (as `moekit tune` writes it). Unreadable files are left out here; a lookup
    of their own key reports them (`find_table`)."""
    out = []
    for directory in (user_dir(), shipped_dir()):
        for path in sorted(directory.glob("*.json")):
            try:
                data = json.loads(path.read_text())
                table = read_table(path, data)
                cap = data.get("meta", {}).get("capability")
                if table.top_k:
                    out.append(TunedShape(TableKey(**data["key"]), tuple(cap) if cap else None,
                                          table))  # fmt: skip
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return tuple(out)


def _regime(num_tokens: float, top_k: int, num_experts: int, n: int, k: int):
    """Where a call sits for config choice, as log2 of: rows per used expert (block_m, swap),
    output columns over the used experts (programs, waves), and K (K step, split-K)."""
    pairs = max(num_tokens, MIN_KEY) * top_k
    used = max(expected_experts_used(pairs, num_experts), 1e-9)
    return (math.log2(max(pairs / used, 1.0)), math.log2(used * n), math.log2(k))


# Weights of the regime's three distances (rows per used expert counts most), and the largest
# distance a transferred entry may have (2: a factor 4 in rows per used expert alone).
REGIME_WEIGHTS = (1.0, 0.5, 0.5)
MAX_REGIME_DISTANCE = 2.0


def transferred(
    gemm: str, num_tokens: float, top_k: int, num_experts: int, n: int, k: int, dtype: str,
    device: str, quant: str, capability: tuple[int, int] | None,
    shapes: tuple[TunedShape, ...] | None = None,
) -> tuple[GemmConfig, str] | None:  # fmt: skip
    """(config, where from) for a GEMM [N=n, K=k] without a table of its own: the entry, among
    the tables `shapes` (default `tuned_shapes()`) of the same GEMM, dtype and weight format
    tuned on `device` or on a device of the same compute `capability` (None: `device` only),
    whose regime (`_regime`) is nearest the call's, within MAX_REGIME_DISTANCE; ties go to
    this device, then this Triton version. Its blocks are cut to the GEMM's size (`clamp`).
    None when no entry qualifies."""
    want = _regime(num_tokens, top_k, num_experts, n, k)
    running = triton_version()
    best = None
    for s in tuned_shapes() if shapes is None else shapes:
        key = s.key
        if (key.gemm, key.dtype, key.quant) != (gemm, dtype, quant):
            continue
        same_device = key.device == device
        if not same_device and (capability is None or s.capability != tuple(capability)):
            continue
        for batch in s.table.configs:
            have = _regime(batch, s.top_k, key.num_experts, key.n, key.k)
            dist = sum(w * abs(a - b) for w, a, b in zip(REGIME_WEIGHTS, want, have, strict=True))
            rank = (round(dist, 6), not same_device, key.triton != running)
            if dist <= MAX_REGIME_DISTANCE and (best is None or rank < best[0]):
                best = (rank, s, batch)
    if best is None:
        return None
    _, s, batch = best
    k_ = s.key
    where = (f"nearest tuned shape E={k_.num_experts} N={k_.n} K={k_.k} top_k={s.top_k} at "
             f"batch {batch} ({s.table.source})")  # fmt: skip
    return clamp(gemm, s.table.configs[batch], n, k), where


def clamp(gemm: str, c: GemmConfig, n: int, k: int) -> GemmConfig:
    """Blocks no larger than the (power-of-two rounded up) GEMM sizes: N (gate_up: I = N / 2
    output columns a program) and K."""
    width = n // 2 if gemm == "gate_up" else n
    return replace(c, block_n=min(c.block_n, _pow2_at_least(width)),
                   block_k=min(c.block_k, _pow2_at_least(k)))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Heuristic default
# ---------------------------------------------------------------------------------------------


def _pow2_at_least(n: int) -> int:
    """The smallest power of two >= max(n, 16)."""
    return max(16, 1 << max(0, (n - 1).bit_length()))


def _pow2_at_most(n: int, cap: int) -> int:
    """The power of two >= 16 nearest below or at max(n, 16), capped at `cap`."""
    p = 16
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def default_config(gemm: str, rows_per_expert: float, n: int, k: int) -> GemmConfig:
    """A reasonable config without tuning, from the mean rows per used expert (T*K/E, at least
    1) and the GEMM's N and K. Small row counts are weight-bandwidth bound: small block_m and a
    deep pipeline; large ones are MMA bound: 128-row blocks."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm: unknown {gemm!r}; allowed: {', '.join(GEMMS)}")
    width = n // 2 if gemm == "gate_up" else n  # output columns of one program's N range
    if rows_per_expert <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif rows_per_expert <= 48:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 4
    elif rows_per_expert <= 192:
        bm, bn, bk, warps, stages = 64, 64, 64, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 64 if gemm == "gate_up" else 128, 64, 8, 3
    return GemmConfig(
        block_m=bm,
        block_n=_pow2_at_most(width, bn),
        block_k=_pow2_at_most(k, bk),
        group_m=1 if rows_per_expert <= 16 else 8,
        num_warps=warps,
        num_stages=stages,
    )


def adapt_config(cfg: GemmConfig, quant: str, gemm: str = "down") -> GemmConfig:
    """An unquantized config of GEMM `gemm` turned into a starting point for weight format
    `quant` (a `quant_tag`): w8a8 formats read half the bytes per element, so twice the K step
    (at most 256). With per-group scales (block weights / token-group activations) the K step
    is one group (128), and each step keeps a float32 partial product beside the
    accumulators, so the tile is cut to half the accumulator area the bf16 config may use
    (at most 64 x 128 per 4 warps; sm_90's ptxas still spills a few of these tiles: gate_up
    64 x (2 x 64) at 4 warps, down 128 x 128 at 8, which the tuned tables avoid; see
    benchmarks/triton_notes.md, sessions 70 and 71). Weight-only formats keep the tile (the
    dequantized tile is what the registers hold) and load through pointers; the packed 4-bit
    ones (int4_w4a16, mxfp4, nvfp4) also leave swap_ab off: their weights then reach the MMA
    through ldmatrix in 4-byte pieces, while swapped they are read 2 bytes at a time and
    repacked (H100, PTX dequantization, T = 1..16: swap_ab off between 0.5% slower and 15%
    faster at the 18 points of benchmarks/results/20261121T2301Z_H100_triton_quant_asm.json)."""
    if quant == "unquantized":
        return cfg
    if quant.startswith(("fp8_w8a8", "int8_w8a8")):
        if "block" in quant or "token_group" in quant:
            bn, warps = cfg.block_n, cfg.num_warps
            cols = 2 if gemm == "gate_up" else 1
            if cfg.block_m * cols * bn > 64 * 128:
                warps = 8
            while cfg.block_m * cols * bn > 64 * 128 * warps // 4 and bn > 16:
                bn //= 2
            return replace(cfg, block_k=128, block_n=bn, num_warps=warps)
        return replace(cfg, block_k=min(2 * cfg.block_k, 256))
    if quant.startswith(("int4_w4a16", "mxfp4", "nvfp4")):
        return replace(cfg, tma=False, swap_ab=False)
    return replace(cfg, tma=False)


# A tuned table covers batch sizes up to this multiple of its largest key (tables tuned for
# decode only); beyond, the nearest tuned shape's config is used, else the quantized format's
# adapted unquantized config, else the heuristic default.
TABLE_SPAN_REACH = 4


def _table_key(gemm, num_experts, hidden, intermediate, dtype, device, quant):
    """(N, K, the TableKey under this Triton version, the shape as the log lines name it) of
    one GEMM: what get_config and masked_config look up."""
    n, k = gemm_shape(gemm, hidden, intermediate)
    key = TableKey(gemm, num_experts, n, k, dtype, device, triton_version(), quant)
    return n, k, key, f"{gemm} E={num_experts} N={n} K={k} {dtype} {quant} on {device}"


@functools.lru_cache(maxsize=4096)  # the forward's host path asks twice per call
def get_config(
    gemm: str,
    num_tokens: float,
    top_k: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: str,
    device: str,
    quant: str = "unquantized",
    capability: tuple[int, int] | None = None,
) -> GemmConfig:
    """The config for one GEMM of a call with `num_tokens` tokens (tuned table, else the
    nearest tuned shape, else default; see the module docstring) for weight format `quant` (a
    `quant_tag`) on `device` of compute `capability` (None: no transfer from other devices).
    Cached per arguments; `clear_cache()` after writing new files."""
    n, k, key, shape = _table_key(gemm, num_experts, hidden, intermediate, dtype, device, quant)
    table = find_table(key, num_tokens)
    what = f"triton runner {shape}"
    if table is not None and num_tokens <= TABLE_SPAN_REACH * max(table.configs):
        note = version_note(table.source, key.triton)
        log_once(logging.INFO, f"{what}: tuned configs from {table.source}{note}")
        return table.pick(num_tokens)
    missing = (f"no tuned config file ({key.filename()})" if table is None else
               f"batches past {TABLE_SPAN_REACH} x the largest ({max(table.configs):g}) "
               f"of {table.source}")  # fmt: skip
    near = transferred(gemm, num_tokens, top_k, num_experts, n, k, dtype, device, quant,
                       None if capability is None else tuple(capability))  # fmt: skip
    if near is not None:
        log_once(logging.INFO, f"{what}: {missing}; using the {near[1]} (`moekit tune` "
                 "makes one)")  # fmt: skip
        return near[0]
    if quant != "unquantized":
        log_once(
            logging.INFO,
            f"{what}: {missing}; using the unquantized config adapted to the format "
            "(`moekit tune --quantization` makes one)",
        )
        base = get_config(gemm, num_tokens, top_k, num_experts, hidden, intermediate, dtype,
                          device, capability=capability)  # fmt: skip
        return adapt_config(base, quant, gemm)
    log_once(
        logging.INFO,
        f"{what}: {missing}; using heuristic defaults (`moekit tune` makes one)",
    )
    rows = max(1.0, num_tokens * top_k / num_experts)
    return default_config(gemm, rows, n, k)


# The masked format takes a tuned entry only with MMA row blocks (block_m 1 is the standard
# format's decode mode, one pair per program).
MASKED_MIN_BLOCK_M = 16


@functools.lru_cache(maxsize=256)
def masked_config(
    gemm: str,
    capacity: int,
    num_experts: int,
    hidden: int,
    intermediate: int,
    dtype: str,
    device: str,
    quant: str = "unquantized",
) -> GemmConfig:
    """The config for one GEMM of the masked format (x [E, C, *], at most C = `capacity` rows
    per expert): the entry of the shape's own tuned table whose rows per expert (T * top_k / E,
    the table's top_k) are nearest C, where the table names its top_k, covers C and the entry
    has block_m >= MASKED_MIN_BLOCK_M; else the heuristic at C rows, adapted to `quant`. The
    grid spans C rows per expert whatever the counts, so C sets the tile, not the counts' mean
    (H100, deepseek-v3 EP8 local shape, six (mean, C) cases: the table at C ran 0.58-0.94x the
    heuristic's time in fp8 block-wise, 0.72-1.01x in bf16; benchmarks/triton_notes.md,
    session 71)."""
    n, k, key, shape = _table_key(gemm, num_experts, hidden, intermediate, dtype, device, quant)
    what = f"triton runner masked {shape}"
    table = find_table(key)
    if table is not None and table.top_k:  # the version nearest the batch size, as get_config
        table = find_table(key, capacity * num_experts / table.top_k)
    if table is not None and table.top_k:
        tokens = capacity * num_experts / table.top_k
        cfg = table.pick(tokens)
        if tokens <= TABLE_SPAN_REACH * max(table.configs) and cfg.block_m >= MASKED_MIN_BLOCK_M:
            log_once(logging.INFO, f"{what}: tuned configs from {table.source}")
            return cfg
    log_once(logging.INFO, f"{what}: no tuned entry with row blocks for C={capacity}; "
             "heuristic defaults")  # fmt: skip
    return adapt_config(default_config(gemm, capacity, n, k), quant, gemm)
