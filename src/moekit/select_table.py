"""Selection tables: measured time of every runner backend over a batch-size sweep, per device,
shape and weight format, that `auto` (moekit.select) ranks backends by.

One JSON file per key, written by `moekit tune --select` (moekit.select_tune):

    {"schema": "moekit-select-table/1",
     "key": {"device_name": "NVIDIA H100 80GB HBM3", "format": "standard",
             "weight_format": "unquantized", "weight_spec": "unquantized", "dtype": "bfloat16",
             "activation": "silu", "has_bias": false,
             "num_experts": 128, "hidden_size": 2048, "intermediate_size": 768, "top_k": 8},
     "libraries": {"torch": "2.11.0+cu130", "triton": "3.6.0", "sgl-deep-gemm": "0.2.2", ...},
     "points": [{"num_tokens": 1, "ms": {"triton": 0.031, "cutlass": 0.048, ...},
                 "skewed_ms": {"triton": 0.034, ...}}, ...],
     "meta": {"preset": "qwen3-30b-a3b", "commit": "...", "created": "...",
              "skewed_routing": "zipf s=1.2"}}

`ms` is measured on uniform routing. `skewed_ms` (optional, `moekit tune --select --skewed`) is
the same backends' time on a skewed routing: real routers are skewed, and where two backends
tie on uniform routing one of them can lose much more under skew. So among the backends within
SKEW_SLACK of the fastest uniform time, `auto` ranks first the one whose worse loss to the
fastest, over the two routings, is least (`Point.ranked`).

Shape fields are per rank (E_local, I_local; K = routing columns incl. fused shared experts).
Lookup: the key must match exactly (device name compared case-insensitively); among matching
tables the one whose library versions differ least from this process's is used (a library it
was measured with that is missing here counts only to break ties: its backend is just not
usable), and the decision says which versions differ. The point used is the measured batch
size nearest to T in log scale (T = 0 uses the smallest), if it is within a factor POINT_REACH
of T; past that (a table measured only for decode batches, asked at prefill), the point is
found as for a shape without a table.

A shape without a table of its own borrows the ranking of the nearest measured point
(`nearest_shape`): of a table with the same dispatch format, weight spec and dtype, measured on
this device or on one of the same compute capability (`meta.capability`), with the library
versions nearest this process's first; among those, the point nearest in regime (`regime`: log2
of rows per local expert, of H * I and of E_local, weighted by REGIME_WEIGHTS; another device,
activation or bias adds a penalty). A point qualifies only if it measured every backend usable
here that any of those tables measured (so a backend that could not run there, e.g. w4a16 over
its pair limit, is not ranked below one that happened to run), and none farther than
MAX_DISTANCE is used. Left-one-out over the shipped
tables (scripts/select_transfer_loo.py) this choice was within 5% of the fastest at more points
than the default order, and slower than it at few. Files: shipped in
`moekit/configs/select/`, and in the user directory `$MOEKIT_CONFIG_DIR/select/`, whose tables
take precedence. A key may have several files, one per library set (shipped:
`<key>__triton<version>.json` and `<key>__triton<version>_deepgemm<version>.json` beside
`<key>.json`), every *.json of a directory being read.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Iterable, Sequence

from moekit import envs
from moekit.hardware import Platform
from moekit.log import logger

if TYPE_CHECKING:
    from moekit.select import Workload

SCHEMA = "moekit-select-table/1"
# Library versions that change which backend is fastest; recorded with every table.
LIBRARIES = ("torch", "triton", "sgl-deep-gemm", "flashinfer-python")
# With skewed times, a backend up to this factor slower than the fastest on uniform routing may
# rank first (below issue 5's 5%, leaving room for the run-to-run spread).
SKEW_SLACK = 1.03


@dataclass(frozen=True)
class TableKey:
    """What a table was measured for (per-rank shape)."""

    device_name: str
    format: str
    weight_format: str
    weight_spec: str
    dtype: str
    activation: str
    has_bias: bool
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int

    def normalized(self) -> "TableKey":
        d = asdict(self)
        d["device_name"] = " ".join(self.device_name.lower().split())
        return TableKey(**d)

    def file_name(self) -> str:
        dev = "_".join(self.device_name.split()).replace("/", "_")
        bias = "_bias" if self.has_bias else ""
        return (
            f"{dev}__E{self.num_experts}_H{self.hidden_size}_I{self.intermediate_size}"
            f"_K{self.top_k}__{self.weight_format}_{self.dtype}_{self.activation}{bias}"
            f"_{self.format}.json"
        )


@dataclass(frozen=True)
class Point:
    """One measured batch size: median ms per backend on uniform routing, and optionally on a
    skewed routing (`skewed_ms`); backends that failed are absent."""

    num_tokens: int
    ms: dict[str, float]
    skewed_ms: dict[str, float] = field(default_factory=dict)

    @property
    def ranking(self) -> tuple[str, ...]:
        """Every measured backend, best first (`ranked`)."""
        return self.ranked(self.ms)

    def ranked(self, among: Collection[str]) -> tuple[str, ...]:
        """The measured backends of `among`, best first: the fastest on uniform routing first;
        with skewed times, those within SKEW_SLACK of it come first, the one whose worse loss
        to the fastest of `among` over the two routings is least first (a backend without a
        skewed time loses infinitely there)."""
        order = sorted((b for b in among if b in self.ms), key=lambda b: (self.ms[b], b))
        if not self.skewed_ms or not order:
            return tuple(order)
        fast = self.ms[order[0]]
        skewed = [self.skewed_ms[b] for b in order if b in self.skewed_ms]
        fast_skewed = min(skewed) if skewed else math.inf

        def worse_loss(b: str) -> float:
            t = self.skewed_ms.get(b)
            return max(self.ms[b] / fast, math.inf if t is None else t / fast_skewed)

        near = [b for b in order if self.ms[b] <= SKEW_SLACK * fast]
        near.sort(key=lambda b: (worse_loss(b), self.ms[b], b))
        return tuple(near + [b for b in order if b not in near])

    def skew_note(self, backend: str, among: Collection[str]) -> str:
        """Why `backend` ranks above the fastest of `among` on uniform routing ('' where
        `backend` is that one)."""
        faster = [b for b in among if b in self.ms and self.ms[b] < self.ms[backend]]
        if not faster:
            return ""
        best = min(faster, key=lambda b: (self.ms[b], b))
        note = (f"{(self.ms[backend] / self.ms[best] - 1) * 100:.1f}% behind {best} "
                f"({self.ms[best]:.4g} ms) on uniform routing")  # fmt: skip
        if best not in self.skewed_ms:
            return f"{note}; {best} has no skewed-routing time"
        return (f"{note}, {(self.skewed_ms[best] / self.skewed_ms[backend] - 1) * 100:.1f}% "
                f"ahead of it on skewed routing ({self.skewed_ms[backend]:.4g} against "
                f"{self.skewed_ms[best]:.4g} ms)")  # fmt: skip


@dataclass(frozen=True)
class SelectionTable:
    key: TableKey
    libraries: dict[str, str | None]
    points: tuple[Point, ...]
    source: str = "<memory>"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"selection table {self.source}: no points")
        pts = tuple(sorted(self.points, key=lambda p: p.num_tokens))
        seen = [p.num_tokens for p in pts]
        if len(set(seen)) != len(seen):
            raise ValueError(f"selection table {self.source}: repeated batch sizes {seen}")
        for p in pts:
            if p.num_tokens < 0 or not p.ms:
                raise ValueError(
                    f"selection table {self.source}: a point needs num_tokens >= 0 and at least "
                    f"one backend, got {p}"
                )
            times = list(p.ms.items()) + list(p.skewed_ms.items())
            bad = {b: v for b, v in times if not (isinstance(v, (int, float)) and v > 0)}
            if bad:
                raise ValueError(f"selection table {self.source}: non-positive times {bad}")
        object.__setattr__(self, "points", pts)

    def nearest(self, num_tokens: int) -> Point:
        """The measured point nearest to `num_tokens` in log scale (ties: the smaller batch)."""
        x = math.log(max(num_tokens, 1))
        def distance(p: Point) -> tuple[float, int]:
            return abs(math.log(max(p.num_tokens, 1)) - x), p.num_tokens

        return min(self.points, key=distance)

    def serving(self, num_tokens: int) -> Point | None:
        """The nearest point, if `num_tokens` lies in its `reach`; else None: the table does not
        rank this batch size."""
        point = self.nearest(num_tokens)
        lo, hi = reach(point)
        return point if lo <= num_tokens <= hi else None

    def served(self) -> list[tuple[int, int]]:
        """The batch-size ranges [lo, hi] that `serving` answers: its points' reaches, merged."""
        spans: list[tuple[int, int]] = []
        for lo, hi in map(reach, self.points):  # points sorted by num_tokens
            if spans and lo <= spans[-1][1] + 1:
                spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
            else:
                spans.append((lo, hi))
        return spans

    def crossovers(self) -> list[tuple[int, str]]:
        """[(T, first)] at each measured T where the first-ranked backend changes (the first
        point included)."""
        out: list[tuple[int, str]] = []
        for p in self.points:
            w = p.ranking[0]
            if not out or out[-1][1] != w:
                out.append((p.num_tokens, w))
        return out

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "key": asdict(self.key),
            "libraries": dict(self.libraries),
            "points": [{"num_tokens": p.num_tokens, "ms": dict(p.ms),
                        **({"skewed_ms": dict(p.skewed_ms)} if p.skewed_ms else {})}
                       for p in self.points],  # fmt: skip
            "crossovers": [{"from_num_tokens": t, "backend": b} for t, b in self.crossovers()],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, doc: dict, source: str = "<memory>") -> "SelectionTable":
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"{source}: schema {doc.get('schema')!r}, expected {SCHEMA!r}")
        try:
            key = TableKey(**doc["key"])
            points = tuple(
                Point(int(p["num_tokens"]), {str(b): float(v) for b, v in p["ms"].items()},
                      {str(b): float(v) for b, v in p.get("skewed_ms", {}).items()})
                for p in doc["points"]
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source}: malformed selection table: {err}") from err
        return cls(key, dict(doc.get("libraries", {})), points, source, dict(doc.get("meta", {})))


@dataclass(frozen=True)
class Match:
    """The result of a lookup: the table and point used (None when no table matches), a note for
    the decision's reason, and whether the table is another shape's (`nearest_shape`)."""

    table: SelectionTable | None
    point: Point | None
    note: str
    transferred: bool = False


def spec_name(work: "Workload") -> str:
    """The weight spec of a workload as recorded in table keys ('unquantized', or the spec's
    describe(), the format's default spec when the workload names none). The scales' dtype is
    recorded as the format's default: the runners read any (w4a16 packs them as bfloat16), so a
    GPTQ / AWQ checkpoint's float16 scales look up the tables measured with bfloat16 ones, as
    the Triton config tables' keys do (`runners._tables.quant_tag`)."""
    if work.weight_format == "unquantized":
        return "unquantized"
    from moekit.quant.spec import make_spec

    spec = work.weight_spec or make_spec(work.weight_format)
    if "scale_dtype" in {f.name for f in fields(spec)}:
        spec = replace(spec, scale_dtype=type(spec)().scale_dtype)
    return spec.describe()


def key_of(work: "Workload", platform: Platform) -> TableKey | None:
    """The table key of `work` on `platform`, None when the workload carries no shape."""
    if not work.has_shape:
        return None
    return TableKey(
        device_name=platform.device_name,
        format=work.format,
        weight_format=work.weight_format,
        weight_spec=spec_name(work),
        dtype=work.dtype,
        activation=work.activation,
        has_bias=work.has_bias,
        num_experts=work.num_experts,
        hidden_size=work.hidden_size,
        intermediate_size=work.intermediate_size,
        top_k=work.top_k,
    )


def library_versions(platform: Platform) -> dict[str, str | None]:
    return {lib: platform.libraries.get(lib) for lib in LIBRARIES}


# A table's nearest point serves a batch size at most this factor away; past it (a table measured
# for decode batches only, asked at prefill, or the reverse) the point is chosen as for a shape
# without a table (`nearest_shape`: its own far points compete with other shapes' near ones).
# The shipped tables' points are 4x apart, so inside a table's span every T is within 2x.
POINT_REACH = 4.0


def reach(point: Point) -> tuple[int, int]:
    """The batch sizes [lo, hi] a measured point may serve: within a factor POINT_REACH of its T
    (T = 0 counts as 1, so a point at T <= POINT_REACH also serves T = 0)."""
    t = max(point.num_tokens, 1)
    lo = 0 if t <= POINT_REACH else math.ceil(t / POINT_REACH)
    return lo, math.floor(t * POINT_REACH)


def lookup(tables: Iterable[SelectionTable], work: "Workload", platform: Platform,
           usable: Collection[str] = ()) -> Match:  # fmt: skip
    """The table and point for `work` on `platform`: this shape's table and its nearest batch
    size, else the nearest measured shape's point (`nearest_shape`; `usable`: the backends that
    can run `work` here). See the module docstring."""
    tables = list(tables)
    key = key_of(work, platform)
    if key is None:
        return Match(None, None, "the workload carries no shape (E, H, I, K)")
    want = key.normalized()
    found = [t for t in tables if t.key.normalized() == want]
    if not found:
        return nearest_shape(tables, work, platform, usable)
    here = library_versions(platform)
    best = min(found, key=lambda t: _library_rank(t, here))  # stable: earlier tables win ties
    point = best.serving(work.num_tokens)
    if point is not None:
        return Match(best, point,
                     f"measured on {best.key.device_name}, {_library_note(best, here)}")
    lo, hi = best.points[0].num_tokens, best.points[-1].num_tokens  # sorted
    return nearest_shape(tables, work, platform, usable,
                         why=f"selection table {best.source} measured T={lo}-{hi}, none within "
                             f"{POINT_REACH:g}x of T={work.num_tokens}")  # fmt: skip


def _differing(t: SelectionTable, here: dict[str, str | None]) -> list[str]:
    return [lib for lib in LIBRARIES if lib in t.libraries and t.libraries[lib] != here[lib]]


def _library_rank(t: SelectionTable, here: dict[str, str | None]) -> tuple[int, int]:
    """First the differences that change the ranking of backends usable here (a library
    installed here at another version, or not measured with); a library measured with but
    missing here only takes its backend out of the ranking, which `auto` skips anyway."""
    d = _differing(t, here)
    return sum(here[lib] is not None for lib in d), len(d)


def _library_note(t: SelectionTable, here: dict[str, str | None]) -> str:
    d = [f"{lib} {t.libraries[lib]} (here {here[lib]})" for lib in _differing(t, here)]
    return f"measured with {', '.join(d)}" if d else "same library versions"


# ------------------------------------------------------------------ shapes without a table

# Weights of |log2 rows per local expert|, |log2 H * I| and |log2 E_local| in the regime
# distance, and the penalties for a table of another device (same compute capability) or another
# activation / bias. Rows per expert decide which kernel design wins (decode GEMV, tiles, large
# GEMMs); the other terms break ties between shapes at the same rows. Left-one-out over the
# shipped tables (scripts/select_transfer_loo.py), a same-shape table of the other GPU ranked
# backends better than other shapes on the same one, hence a penalty below their distance.
REGIME_WEIGHTS = (1.0, 0.5, 0.5)
OTHER_DEVICE = 1.0
OTHER_ACTIVATION = 0.5
# Farther than this, the default order: the left-one-out's farthest transfer was 6.5 (and paid).
MAX_DISTANCE = 7.0


def regime(key: TableKey, num_tokens: int, local_share: float) -> tuple[float, float, float]:
    """(log2 rows per local expert, log2 H * I, log2 E_local) of a call of T tokens whose rows
    hold K * local_share local pairs each (standard format)."""
    rows = num_tokens * key.top_k * local_share / key.num_experts
    return (math.log2(max(rows, 1 / 64)), math.log2(key.hidden_size * key.intermediate_size),
            math.log2(key.num_experts))  # fmt: skip


def table_local_share(t: SelectionTable) -> float:
    """The local share of the layer a table was measured on: meta.local_share, else 1 / ep."""
    share = t.meta.get("local_share")
    return float(share) if share else 1.0 / max(int(t.meta.get("ep_size") or 1), 1)


def nearest_shape(tables: Sequence[SelectionTable], work: "Workload", platform: Platform,
                  usable: Collection[str] = (), why: str | None = None) -> Match:  # fmt: skip
    """The measured point of another shape nearest `work` (see the module docstring), or a
    Match without a table saying why none applies. `why`: why this shape's own table does not
    serve (default: it has none)."""
    key = key_of(work, platform)
    assert key is not None
    want = key.normalized()
    mine = regime(key, work.num_tokens, work.local_share)

    def same_family(t: SelectionTable) -> bool:
        k = t.key.normalized()
        if (k.format, k.weight_spec, k.dtype) != (want.format, want.weight_spec, want.dtype):
            return False
        cap = t.meta.get("capability")
        return k.device_name == want.device_name or (
            cap is not None and platform.capability is not None
            and tuple(cap) == tuple(platform.capability))  # fmt: skip

    family = [t for t in tables if same_family(t)]
    none = why or (f"no selection table of this shape: none measured for {platform.device_name}, "
                   f"E={key.num_experts} H={key.hidden_size} I={key.intermediate_size} "
                   f"K={key.top_k}, {key.weight_spec} {key.dtype} "
                   f"{key.activation}{' bias' if key.has_bias else ''} {key.format}")  # fmt: skip
    if not family:
        return Match(None, None, none + "; nor any other shape of this format, dtype and device "
                     "(or compute capability)")  # fmt: skip
    measured = {b for t in family for p in t.points for b in p.ms}
    required = (set(usable) & measured) - {"torch"}
    here = library_versions(platform)
    best = None
    for t in family:
        other = t.key.normalized()
        penalty = OTHER_DEVICE * (other.device_name != want.device_name) + OTHER_ACTIVATION * (
            (other.activation, other.has_bias) != (want.activation, want.has_bias))
        share = table_local_share(t)
        lib = _library_rank(t, here)
        for p in t.points:
            if not required <= p.ms.keys():
                continue
            theirs = regime(t.key, p.num_tokens, share)
            d = penalty + sum(w * abs(a - b)
                              for w, a, b in zip(REGIME_WEIGHTS, mine, theirs, strict=True))
            if d <= MAX_DISTANCE and (best is None or (lib, d) < best[0]):
                best = ((lib, d), t, p, theirs)
    if best is None:
        return Match(None, None, f"{none}; no other shape's point within distance {MAX_DISTANCE:g} "
                     f"measured all of {', '.join(sorted(required))}")  # fmt: skip
    (_, d), t, p, theirs = best
    k = t.key
    note = (f"{none}; nearest measured shape E={k.num_experts} H={k.hidden_size} "
            f"I={k.intermediate_size} K={k.top_k} {k.activation}{' bias' if k.has_bias else ''}"
            f"{' (' + str(t.meta['preset']) + ')' if t.meta.get('preset') else ''} on "
            f"{k.device_name}, {_library_note(t, here)}: at T={p.num_tokens}, "
            f"{2 ** theirs[0]:.3g} rows per expert (here {2 ** mine[0]:.3g}), distance {d:.2f}")
    return Match(t, p, note, transferred=True)


# ---------------------------------------------------------------------------- files


def shipped_dir() -> Path:
    return Path(__file__).resolve().parent / "configs" / "select"


def user_dir() -> Path:
    return Path(envs.MOEKIT_CONFIG_DIR.get()) / "select"


def load_dir(directory: Path | str) -> list[SelectionTable]:
    """Every valid table in `directory` (sorted by file name); invalid files are logged and
    skipped; a missing directory gives []."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    tables = []
    for path in sorted(directory.glob("*.json")):
        try:
            tables.append(SelectionTable.from_json(json.loads(path.read_text()), str(path)))
        except (OSError, ValueError) as err:
            logger.log(logging.WARNING, f"selection table skipped: {path}: {err}")
    return tables


@functools.lru_cache(maxsize=None)
def _cached(dirs: tuple[str, ...]) -> tuple[SelectionTable, ...]:
    return tuple(t for d in dirs for t in load_dir(d))


def default_tables() -> Sequence[SelectionTable]:
    """User tables ($MOEKIT_CONFIG_DIR/select), then the shipped ones; read once per process
    and directory set (`reload()` forgets them)."""
    return _cached((str(user_dir()), str(shipped_dir())))


def reload() -> None:
    _cached.cache_clear()


def save(table: SelectionTable, directory: Path | str | None = None) -> Path:
    """Write `table` as JSON into `directory` (default: the user dir); returns the path."""
    directory = Path(directory) if directory is not None else user_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return write(table, directory / table.key.file_name())


def write(table: SelectionTable, path: Path | str) -> Path:
    """Write `table` as JSON to `path` (e.g. its own `source` file); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(table.to_json(), indent=1, sort_keys=False) + "\n")
    reload()
    return path
