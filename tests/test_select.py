"""Runner selection (`moekit.select`, `moekit.select_table`) as pure functions on the CPU, with
the hardware, the installed libraries, the runners and the selection tables injected."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace

import pytest
import torch

from moekit import metrics, select_table
from moekit.config import ConfigError, ParallelConfig, RunnerConfig
from moekit.hardware import Availability, Platform
from moekit.presets import preset
from moekit.quant import make_spec
from moekit.runners import registry
from moekit.runners.base import Runner, RunnerCaps
from moekit.select import Workload, explain, select_runner, why_not, workload_for
from moekit.select_table import Point, SelectionTable, key_of

LIBS = {"torch": "2.11.0+cu130", "triton": "3.6.0"}
H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {**LIBS, "sgl-deep-gemm": "0.2.2"})
H100_NO_DG = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, dict(LIBS))
B200 = Platform("cuda", "NVIDIA B200", (10, 0), 1, {**LIBS, "flashinfer-python": "0.7.2"})
A100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 1, dict(LIBS))
CPU = Platform("cpu", "cpu", None, 0, {"torch": "2.13.0"})

SM100_ONLY = ("flashinfer_trtllm", "flashinfer_mxfp4", "flashinfer_cutedsl")


def shaped(T: int, **kw) -> Workload:
    """A bf16 workload with the per-rank shape of qwen3-30b-a3b."""
    return replace(workload_for(preset("qwen3-30b-a3b"), T), **kw)


# ---------------------------------------------------------------------------- fake runners


def fake_runner(name: str, *, needs_gpu=True, sm=None, lib=None, formats=("standard",),
                weight_formats=("unquantized",), min_h=None):
    """A Runner class with controlled availability and capabilities."""

    class Fake(Runner):
        caps = RunnerCaps(
            formats=frozenset(formats),
            weight_formats=frozenset(weight_formats),
            activations=frozenset({"silu", "gelu", "swiglu_oai"}),
            devices=frozenset({"cuda"} if needs_gpu else {"cuda", "cpu"}),
        )

        @classmethod
        def availability(cls, platform: Platform) -> Availability:
            if needs_gpu and not platform.is_cuda:
                return Availability(False, "needs a CUDA GPU")
            if sm is not None and platform.sm() < sm:
                return Availability(False, f"needs SM{sm}+")
            if lib is not None and not platform.has(lib):
                return Availability(False, f"needs {lib}")
            return Availability(True)

        @classmethod
        def workload_problem(cls, work, platform=None):
            if min_h and work.hidden_size is not None and work.hidden_size < min_h:
                return f"needs H >= {min_h}"
            return None

        def run(self, dispatch_out, weights, act):  # pragma: no cover - never run
            raise AssertionError("selection tests do not run runners")

    Fake.name = name
    return Fake


FOUR_BIT = ("int4_w4a16", "mxfp4", "nvfp4")


@pytest.fixture
def fakes(monkeypatch):
    """Replace the registry with fake runners: triton (GPU, unquantized, fp8_w8a8 and the 4-bit
    formats), w4a16 (GPU, the 4-bit formats),
    triton_kernel (GPU, unquantized + fp8_w8a8), cutlass (GPU, SM90, standard + masked), deep_gemm (SM90 +
    sgl-deep-gemm), torch (anywhere)."""
    runners = {
        "triton": fake_runner("triton", lib="triton",
                              weight_formats=("unquantized", "fp8_w8a8", *FOUR_BIT)),
        "w4a16": fake_runner("w4a16", weight_formats=FOUR_BIT),
        "triton_kernel": fake_runner("triton_kernel", lib="triton",
                                     weight_formats=("unquantized", "fp8_w8a8")),
        "cutlass": fake_runner("cutlass", sm=90, formats=("standard", "masked")),
        "deep_gemm": fake_runner("deep_gemm", sm=90, lib="sgl-deep-gemm",
                                 formats=("standard", "masked"),
                                 weight_formats=("unquantized", "fp8_w8a8")),
        "torch": fake_runner("torch", needs_gpu=False, formats=("standard", "masked"),
                             weight_formats=("unquantized", "fp8_w8a8")),
    }
    monkeypatch.setattr(registry, "_RUNNERS", runners)
    monkeypatch.setattr(registry, "_loaded", True)
    return runners


def table(points: dict[int, dict[str, float]], *, device="NVIDIA H100 80GB HBM3", libs=None,
          work: Workload | None = None, source="<test>") -> SelectionTable:
    work = work or shaped(1)
    key = replace(key_of(work, Platform("cuda", device)), device_name=device)
    return SelectionTable(
        key, dict(LIBS if libs is None else libs),
        tuple(Point(t, ms) for t, ms in points.items()), source,
    )


NO_TABLES: tuple = ()


# ---------------------------------------------------------------------------- requested backends


def test_requested_backend_is_checked(fakes):
    d = select_runner(shaped(8), RunnerConfig("cutlass"), H100, tables=NO_TABLES)
    assert d.backend == "cutlass" and "--moe-runner-backend cutlass" in d.reason
    with pytest.raises(ConfigError, match="deep_gemm cannot run here: needs sgl-deep-gemm"):
        select_runner(shaped(8), RunnerConfig("deep_gemm"), H100_NO_DG, tables=NO_TABLES)
    with pytest.raises(ConfigError, match="cutlass cannot run here: needs SM90"):
        select_runner(shaped(8), RunnerConfig("cutlass"), A100, tables=NO_TABLES)
    with pytest.raises(ConfigError, match="not implemented"):
        select_runner(shaped(8), RunnerConfig("flashinfer_trtllm"), H100, tables=NO_TABLES)


def test_requested_format_and_workload_rules(fakes):
    fakes["cutlass"] = fake_runner("cutlass", sm=90, min_h=4096)
    with pytest.raises(ConfigError, match="needs H >= 4096"):
        select_runner(shaped(8), RunnerConfig("cutlass"), H100, tables=NO_TABLES)
    with pytest.raises(ConfigError, match="dispatch format 'masked'"):
        select_runner(shaped(8, format="masked"), RunnerConfig("triton"), H100, tables=NO_TABLES)
    with pytest.raises(ConfigError, match="weight format 'fp8_w8a8'"):
        select_runner(shaped(8, weight_format="fp8_w8a8"), RunnerConfig("cutlass"), H100,
                      tables=NO_TABLES)


# ---------------------------------------------------------------------------- adaptive threshold


@pytest.mark.parametrize("threshold", [1, 64, 1024])
def test_adaptive_threshold(fakes, threshold):
    cfg = RunnerConfig("auto", enable_adaptive_moe=True, adaptive_moe_batch_threshold=threshold)
    if threshold > 1:
        below = select_runner(shaped(threshold - 1), cfg, H100, tables=NO_TABLES)
        assert below.backend == "triton" and f"< --adaptive-moe-batch-threshold {threshold}" in (
            below.reason
        )
    at = select_runner(shaped(threshold), cfg, H100, tables=NO_TABLES)
    assert at.backend == "triton_kernel" and ">=" in at.reason
    above = select_runner(shaped(threshold * 4), cfg, H100, tables=NO_TABLES)
    assert above.backend == "triton_kernel"


def test_adaptive_overrides_the_table_and_fails_when_triton_kernel_cannot_run(fakes):
    cfg = RunnerConfig("triton", enable_adaptive_moe=True, adaptive_moe_batch_threshold=16)
    tables = [table({1: {"cutlass": 0.01, "triton": 0.02}})]
    assert select_runner(shaped(1), cfg, H100, tables=tables).backend == "triton"
    del fakes["triton_kernel"]
    with pytest.raises(ConfigError, match="triton_kernel"):
        select_runner(shaped(16), cfg, H100, tables=tables)


# ---------------------------------------------------------------------------- auto without a table


def test_auto_default_preference_switches_at_threshold(fakes):
    cfg = RunnerConfig("auto", adaptive_moe_batch_threshold=512)
    small = select_runner(shaped(8), cfg, H100, tables=NO_TABLES)
    assert small.backend == "triton"
    assert "no selection table" in small.reason and "none measured for" in small.reason
    large = select_runner(shaped(512), cfg, H100, tables=NO_TABLES)
    assert large.backend == "triton" and "T >= 512" in large.reason
    assert "deep_gemm > cutlass" in large.reason and "cutlass > deep_gemm" in small.reason


def test_auto_default_puts_deep_gemm_first_where_it_leads(fakes):
    """Without a table: deep_gemm where it can run for fp8 with block scales at or above the
    threshold (standard format) and for the masked format at every size; small standard
    batches, other scale layouts and a missing library keep the plain order."""
    cfg = RunnerConfig("auto", adaptive_moe_batch_threshold=1024)
    block = shaped(4096, weight_format="fp8_w8a8", weight_spec=make_spec("fp8_w8a8"))
    d = select_runner(block, cfg, H100, tables=NO_TABLES)
    assert d.backend == "deep_gemm" and "fp8 weights with block scales: deep_gemm first" in (
        d.reason
    )
    assert select_runner(replace(block, num_tokens=1023), cfg, H100, tables=NO_TABLES).backend == (
        "triton"
    )
    channel = replace(block, weight_spec=make_spec("fp8_w8a8", weight_scale="channel"))
    assert select_runner(channel, cfg, H100, tables=NO_TABLES).backend == "triton"
    masked = replace(block, format="masked", num_tokens=64)  # E * C rows, below the threshold
    for w in (masked, replace(masked, weight_format="unquantized", weight_spec=None)):
        d = select_runner(w, cfg, H100, tables=NO_TABLES)
        assert d.backend == "deep_gemm" and "masked format: deep_gemm first" in d.reason
    bf16_masked = replace(masked, weight_format="unquantized", weight_spec=None)
    d = select_runner(bf16_masked, cfg, H100_NO_DG, tables=NO_TABLES)
    assert d.backend == "cutlass" and "skipped deep_gemm: needs sgl-deep-gemm" in d.reason
    d = select_runner(block, cfg, H100_NO_DG, tables=NO_TABLES)
    assert d.backend == "triton" and "skipped deep_gemm: needs sgl-deep-gemm" in d.reason


def test_auto_default_puts_w4a16_first_for_4bit_decode(fakes):
    """Without a table: w4a16 for 4-bit weights at T <= 16 (where it was measured faster), the
    plain order above that and for other formats."""
    cfg = RunnerConfig("auto")
    for fmt in ("int4_w4a16", "mxfp4", "nvfp4"):
        work = shaped(16, weight_format=fmt, weight_spec=make_spec(fmt))
        d = select_runner(work, cfg, H100, tables=NO_TABLES)
        assert d.backend == "w4a16" and "4-bit weights at T <= 16: w4a16 first" in d.reason
        assert select_runner(replace(work, num_tokens=17), cfg, H100,
                             tables=NO_TABLES).backend == "triton"  # fmt: skip
    assert select_runner(shaped(4), cfg, H100, tables=NO_TABLES).backend == "triton"


def test_auto_skips_unusable_and_says_why(fakes):
    del fakes["triton"]
    d = select_runner(shaped(8), RunnerConfig("auto"), A100, tables=NO_TABLES)
    assert d.backend == "triton_kernel"
    assert "skipped triton: " in d.reason
    d = select_runner(shaped(8, format="masked"), RunnerConfig("auto"), H100_NO_DG,
                      tables=NO_TABLES)  # fmt: skip
    assert d.backend == "cutlass"  # deep_gemm: no library; triton_kernel: standard only here


def test_auto_on_cpu_picks_the_reference(fakes):
    d = select_runner(shaped(8, device="cpu"), RunnerConfig("auto"), CPU, tables=NO_TABLES)
    assert d.backend == "torch"


def test_auto_without_any_usable_backend(fakes):
    work = shaped(8, weight_format="int8_w8a16")
    with pytest.raises(ConfigError, match="no runner can run this") as err:
        select_runner(work, RunnerConfig("auto"), H100, tables=NO_TABLES)
    assert "deep_gemm: " in str(err.value) and "int8_w8a16" in str(err.value)


def test_workload_without_shape_uses_the_preference(fakes):
    tables = [table({1: {"cutlass": 0.01, "triton": 0.02}})]
    d = select_runner(Workload(1), RunnerConfig("auto"), H100, tables=tables)
    assert d.backend == "triton" and "carries no shape" in d.reason


# ---------------------------------------------------------------------------- selection tables


SWEEP = {
    1: {"triton": 0.020, "cutlass": 0.030, "deep_gemm": 0.050},
    16: {"triton": 0.025, "cutlass": 0.024, "deep_gemm": 0.040},
    256: {"triton": 0.080, "cutlass": 0.060, "deep_gemm": 0.055},
    4096: {"triton": 0.900, "triton_kernel": 0.700, "cutlass": 0.750, "deep_gemm": 0.600},
}


@pytest.mark.parametrize(
    "T, expected, nearest",
    [(0, "triton", 1), (1, "triton", 1), (3, "triton", 1), (5, "cutlass", 16), (16, "cutlass", 16),
     (60, "cutlass", 16), (70, "deep_gemm", 256), (1500, "deep_gemm", 4096),
     (16384, "deep_gemm", 4096)],
)
def test_table_nearest_batch(fakes, T, expected, nearest):
    d = select_runner(shaped(T), RunnerConfig("auto"), H100, tables=[table(SWEEP)])
    assert d.backend == expected
    assert f"nearest measured T={nearest}," in d.reason and "same library versions" in d.reason


def test_a_decode_only_table_gives_way_to_a_near_shape_at_prefill(fakes):
    """A table measured at T = 1-64 serves up to 4x its span (T = 256 on its T = 64 point).
    Past that, its far points compete with other shapes' near ones by regime: at T = 4096 the
    E = 64 table's T = 2048 point (the same rows per expert) ranks the backends, and without it
    the T = 64 point does (distance 6); at T = 16384 (distance 8) nothing is near enough."""
    decode = table({T: {"triton": 0.01 * T, "deep_gemm": 0.02 * T} for T in (1, 4, 16, 64)},
                   source="decode")  # fmt: skip
    prefill = other_shape({2048: {"triton": 2.0, "deep_gemm": 1.0}}, num_experts=64,
                          source="prefill")  # fmt: skip
    auto = RunnerConfig("auto")
    d = select_runner(shaped(256), auto, H100, tables=[decode, prefill])
    assert d.backend == "triton" and "selection table decode" in d.reason
    assert "nearest measured T=64," in d.reason
    d = select_runner(shaped(4096), auto, H100, tables=[decode, prefill])
    assert d.backend == "deep_gemm" and "from prefill" in d.reason, d.reason
    assert "selection table decode measured T=1-64, none within 4x of T=4096" in d.reason
    d = select_runner(shaped(4096), auto, H100, tables=[decode])
    assert d.backend == "triton" and "from decode" in d.reason and "distance 6.00" in d.reason
    d = select_runner(shaped(16384), auto, H100, tables=[decode])
    assert "none within 4x of T=16384" in d.reason and "default preference" in d.reason


def test_served_ranges_agree_with_lookup(fakes):
    """`served` lists the batch sizes a table ranks (within 4x of a point), merged where the
    points' reaches touch; `lookup` uses the table at exactly those."""
    t = table({T: {"triton": 0.01, "cutlass": 0.02} for T in (1, 64, 4096)})
    assert t.served() == [(0, 4), (16, 256), (1024, 16384)]
    assert table(SWEEP).served() == [(0, 16384)]
    for T in range(0, 20000, 7):
        match = select_table.lookup([t], shaped(T), H100)
        own = match.table is t and not match.transferred
        assert own == any(lo <= T <= hi for lo, hi in t.served()), T


def test_table_skips_backends_not_usable_here(fakes):
    d = select_runner(shaped(4096), RunnerConfig("auto"), H100_NO_DG, tables=[table(SWEEP)])
    assert d.backend == "triton_kernel"
    assert "deep_gemm 0.6 ms is not usable: needs sgl-deep-gemm" in d.reason


def test_table_with_no_usable_backend_falls_back(fakes):
    tables = [table({1: {"deep_gemm": 0.01}})]
    d = select_runner(shaped(1), RunnerConfig("auto"), H100_NO_DG, tables=tables)
    assert d.backend == "triton"
    assert "none of the measured deep_gemm is usable here" in d.reason


@pytest.mark.parametrize(
    "change",
    [dict(device_name="NVIDIA H200"), dict(dtype="float16"),
     dict(weight_format="fp8_w8a8", weight_spec="fp8_w8a8(...)"), dict(format="masked")],
)
def test_table_of_another_family_is_not_used(fakes, change):
    """Another device (its compute capability not recorded), dtype, weight spec or dispatch
    format: neither this shape's table nor a nearest shape's; the default order applies."""
    t = table(SWEEP)
    t = SelectionTable(replace(t.key, **change), t.libraries, t.points, "<other>")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[t])
    assert "no selection table" in d.reason and d.backend == "triton"
    assert "nor any other shape" in d.reason


@pytest.mark.parametrize("change", [dict(num_experts=64), dict(top_k=4), dict(activation="gelu")])
def test_table_of_another_shape_is_borrowed(fakes, change):
    """Another E, K or activation: not this shape's table, but the nearest measured shape's
    (at T = 4096, where SWEEP measured every backend that can run here)."""
    t = table(SWEEP)
    t = SelectionTable(replace(t.key, **change), t.libraries, t.points, "<other>")
    d = select_runner(shaped(4096), RunnerConfig("auto"), H100, tables=[t])
    assert d.backend == "deep_gemm", d.reason
    assert "no selection table of this shape" in d.reason and "nearest measured shape" in d.reason
    assert d.reason.count("from <other>") == 1, d.reason


def other_shape(points, *, work=None, source="<other>", libs=None, device="NVIDIA H100 80GB HBM3",
                meta=None, **change) -> SelectionTable:
    """A table measured for a shape other than `shaped`'s (fields of TableKey in `change`)."""
    t = table(points, work=work, libs=libs, device=device)
    return SelectionTable(replace(t.key, **change), t.libraries, t.points, source, meta or {})


def test_nearest_shape_matches_rows_per_expert_not_batch_size(fakes):
    """qwen3's shape at T = 32 has 2 rows per expert (32 * 8 / 128). A table of E = 64 has 2 at
    T = 16 (distance 0.5: E differs by 2x) and 4 at T = 32 (distance 1.5): T = 16 is used."""
    t = other_shape({16: {"triton": 0.01, "cutlass": 0.02}, 32: {"triton": 0.02, "cutlass": 0.01}},
                    num_experts=64)
    d = select_runner(shaped(32), RunnerConfig("auto"), H100, tables=[t])
    assert d.backend == "triton", d.reason
    assert "at T=16, 2 rows per expert (here 2), distance 0.50" in d.reason


def test_nearest_shape_counts_local_pairs_on_an_ep_rank(fakes):
    """An EP rank that sees every token holds T * K / ep local pairs: with local_share 1/8 the
    call below has 16 * 8 / 8 / 128 = 0.125 rows per expert, as many as the E = 64 table's
    T = 1 point (distance 0.5: E), against 2 at its T = 16 (4.5)."""
    t = other_shape({1: {"triton": 0.01, "cutlass": 0.02}, 16: {"triton": 0.02, "cutlass": 0.01}},
                    num_experts=64)
    work = shaped(16, local_share=1 / 8)
    d = select_runner(work, RunnerConfig("auto"), H100, tables=[t])
    assert d.backend == "triton" and "at T=1, 0.125 rows per expert (here 0.125)" in d.reason
    # a table measured on an EP rank (meta ep_size 8) is placed the same way: T = 8 there
    t_ep = other_shape({8: {"triton": 0.01, "cutlass": 0.02}, 1: {"triton": 0.02, "cutlass": 0.01}},
                       num_experts=64, meta={"ep_size": 8})
    d = select_runner(work, RunnerConfig("auto"), H100, tables=[t_ep])
    assert d.backend == "triton" and "at T=8, 0.125 rows per expert (here 0.125)" in d.reason
    par = ParallelConfig(tp_size=8, ep_size=8)
    assert workload_for(preset("deepseek-v3"), 4, parallel=par).local_share == 1 / 8


def test_nearest_shape_needs_every_usable_backend_measured(fakes):
    """The nearest point did not measure cutlass, which can run here and another point of the
    tables measured: a farther point that ranks it is used (cutlass's absence there may only
    mean it could not run at that shape)."""
    near = other_shape({16: {"triton": 0.01}}, num_experts=64, source="near")
    far = other_shape({16: {"triton": 0.02, "cutlass": 0.01}}, num_experts=16, source="far")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[near, far])
    assert d.backend == "cutlass" and "from far" in d.reason, d.reason
    # a backend no table measured (triton_kernel here) does not disqualify any point
    assert "triton_kernel" not in {b for t in (near, far) for p in t.points for b in p.ms}


def test_nearest_shape_within_max_distance(fakes):
    """A point farther than MAX_DISTANCE is not borrowed: the default order applies."""
    t = other_shape({16: {"triton": 0.02, "cutlass": 0.01}}, num_experts=128 * 2 ** 7,
                    source="far")  # fmt: skip
    d = select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[t])  # E 3.5 + rows 6
    assert d.backend == "triton" and "no other shape's point within distance 7" in d.reason


def test_nearest_shape_prefers_library_versions_then_distance(fakes):
    near_other_triton = other_shape({16: {"triton": 0.01, "cutlass": 0.02}}, num_experts=64,
                                    libs={**LIBS, "triton": "3.9.0"}, source="near")
    far_same = other_shape({16: {"triton": 0.02, "cutlass": 0.01}}, num_experts=8, source="far")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100_NO_DG,
                      tables=[near_other_triton, far_same])
    assert d.backend == "cutlass" and "from far" in d.reason and "same library versions" in \
        d.reason


def test_nearest_shape_on_another_device_of_the_same_capability(fakes):
    """An H200 table of this very shape (capability recorded) is borrowed at distance
    OTHER_DEVICE, ahead of this device's tables of shapes farther away; one without a recorded
    capability is never used for another device."""
    h200 = other_shape({16: {"triton": 0.01, "cutlass": 0.02}}, device="NVIDIA H200",
                       meta={"capability": [9, 0]}, source="h200")
    far_here = other_shape({16: {"triton": 0.02, "cutlass": 0.01}}, num_experts=16, source="far")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[far_here, h200])
    assert d.backend == "triton" and "from h200" in d.reason and "distance 1.00" in d.reason
    assert "on NVIDIA H200" in d.reason
    near_here = other_shape({8: {"triton": 0.02, "cutlass": 0.01}}, num_experts=64, source="near")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[near_here, h200])
    assert d.backend == "cutlass" and "distance 0.50" in d.reason  # E = 64 at T = 8: 1 row
    blackwell = replace(H100, device_name="NVIDIA B200", capability=(10, 0))
    d = select_runner(shaped(16), RunnerConfig("auto"), blackwell, tables=[h200])
    assert "no selection table" in d.reason and "nor any other shape" in d.reason


def test_table_device_name_is_case_insensitive(fakes):
    t = table(SWEEP, device="nvidia  h100 80gb hbm3")
    assert select_runner(shaped(16), RunnerConfig("auto"), H100, tables=[t]).backend == "cutlass"


def test_table_prefers_matching_library_versions(fakes):
    old = table({16: {"triton": 0.01, "cutlass": 0.02}}, libs={**LIBS, "triton": "3.5.0"},
                source="old")
    new = table({16: {"triton": 0.03, "cutlass": 0.02}}, source="new")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100_NO_DG, tables=[old, new])
    assert d.backend == "cutlass" and "selection table new" in d.reason
    d = select_runner(shaped(16), RunnerConfig("auto"), H100_NO_DG, tables=[old])
    assert d.backend == "triton"
    assert "measured with triton 3.5.0 (here 3.6.0)" in d.reason


def test_table_measured_with_a_library_missing_here_beats_one_of_another_triton(fakes):
    """Here: Triton 3.6 without deep_gemm. A table of the same Triton measured with deep_gemm
    ranks the other backends right (deep_gemm is only skipped); one of another Triton does not,
    though each differs in one library. Below, the tie between two equally good tables goes to
    the first, as before."""
    other_triton = table({16: {"triton": 0.01, "cutlass": 0.02}},
                         libs={**LIBS, "triton": "3.9.0"}, source="other_triton")
    with_dg = table({16: {"deep_gemm": 0.005, "cutlass": 0.02, "triton": 0.03}},
                    libs={**LIBS, "sgl-deep-gemm": "0.2.2"}, source="with_dg")
    for tables in ([other_triton, with_dg], [with_dg, other_triton]):
        d = select_runner(shaped(16), RunnerConfig("auto"), H100_NO_DG, tables=tables)
        assert d.backend == "cutlass" and "selection table with_dg" in d.reason, d.reason
        assert "sgl-deep-gemm 0.2.2 (here None)" in d.reason
    same = table({16: {"triton": 0.01, "cutlass": 0.02}}, source="same")
    d = select_runner(shaped(16), RunnerConfig("auto"), H100_NO_DG, tables=[with_dg, same])
    assert "selection table same" in d.reason  # no difference at all beats a missing library


def test_table_with_spec_key_for_fp8(fakes):
    spec = make_spec("fp8_w8a8")
    work = shaped(16, weight_format="fp8_w8a8", weight_spec=spec)
    t = table({16: {"deep_gemm": 0.01, "torch": 1.0}}, work=work)
    assert t.key.weight_spec == spec.describe()
    assert select_runner(work, RunnerConfig("auto"), H100, tables=[t]).backend == "deep_gemm"
    other = shaped(16, weight_format="fp8_w8a8",
                   weight_spec=make_spec("fp8_w8a8", weight_scale="channel"))
    assert "no selection table" in select_runner(other, RunnerConfig("auto"), H100,
                                                 tables=[t]).reason


def test_table_validation_and_crossovers():
    t = table(SWEEP)
    assert t.crossovers() == [(1, "triton"), (16, "cutlass"), (256, "deep_gemm")]
    assert t.nearest(2).num_tokens == 1  # log-distance tie between 1 and 4 goes to the smaller
    with pytest.raises(ValueError, match="no points"):
        table({})
    with pytest.raises(ValueError, match="non-positive"):
        table({1: {"triton": 0.0}})


def skewed(points: dict[int, tuple[dict[str, float], dict[str, float]]], **kw) -> SelectionTable:
    """A table whose points carry (uniform ms, skewed ms)."""
    t = table({T: u for T, (u, _) in points.items()}, **kw)
    return replace(t, points=tuple(replace(p, skewed_ms=points[p.num_tokens][1])
                                   for p in t.points))  # fmt: skip


def test_skewed_times_decide_only_among_near_ties():
    """Within SKEW_SLACK of the fastest on uniform routing, the backend whose worse loss over
    the two routings is least goes first; a backend slower than that on uniform routing never
    does, however fast it is on skewed routing; one without a skewed time ranks after those
    with one; without skewed times the order is the uniform one."""
    assert 1.0 < select_table.SKEW_SLACK <= 1.05  # issue 5: auto within 5% of the fastest
    tie = 1 + (select_table.SKEW_SLACK - 1) / 2
    p = Point(1024, {"triton": 1.0, "triton_kernel": tie, "deep_gemm": 1.2},
              {"triton": 1.3, "triton_kernel": 1.1, "deep_gemm": 0.5})
    assert p.ranking == ("triton_kernel", "triton", "deep_gemm")
    assert p.ranked(["triton", "deep_gemm"]) == ("triton", "deep_gemm")
    assert p.ranked(["deep_gemm", "cutlass"]) == ("deep_gemm",)
    assert p.ranked([]) == ()
    # a near tie that is also slower on skewed routing stays behind
    q = replace(p, skewed_ms={"triton": 1.0, "triton_kernel": 1.1})
    assert q.ranking == ("triton", "triton_kernel", "deep_gemm")
    # no skewed time: ranks after the near backends that have one
    r = replace(p, skewed_ms={"triton_kernel": 1.1, "deep_gemm": 0.5})
    assert r.ranking == ("triton_kernel", "triton", "deep_gemm")
    assert replace(p, skewed_ms={}).ranking == ("triton", "triton_kernel", "deep_gemm")
    far = replace(p, ms={"triton": 1.0, "triton_kernel": select_table.SKEW_SLACK * 1.01})
    assert far.ranking == ("triton", "triton_kernel")
    assert "behind triton (1 ms) on uniform routing" in p.skew_note("triton_kernel", p.ms)
    assert "18.2% ahead of it on skewed routing" in p.skew_note("triton_kernel", p.ms)
    assert p.skew_note("triton", p.ms) == ""
    assert "triton has no skewed-routing time" in r.skew_note("triton_kernel", r.ms)
    t = skewed({1024: (p.ms, p.skewed_ms)})
    assert t.crossovers() == [(1024, "triton_kernel")]
    with pytest.raises(ValueError, match="non-positive"):
        skewed({1: ({"triton": 1.0}, {"triton": -1.0})})


def test_auto_explains_a_pick_made_by_skewed_times(fakes):
    near = 1 + (select_table.SKEW_SLACK - 1) / 2
    t = skewed({1024: ({"triton": 1.0, "cutlass": near, "deep_gemm": 0.5},
                       {"triton": 2.0, "cutlass": 1.0, "deep_gemm": 0.4})})
    d = select_runner(shaped(1024), RunnerConfig("auto"), H100_NO_DG, tables=[t])
    assert d.backend == "cutlass", d.reason
    assert "ranked first of the usable" in d.reason
    assert "behind triton (1 ms) on uniform routing, 100.0% ahead of it" in d.reason
    assert "deep_gemm 0.5 ms is not usable" in d.reason
    d = select_runner(shaped(1024), RunnerConfig("auto"), H100, tables=[t])
    assert d.backend == "deep_gemm" and "the fastest usable" in d.reason, d.reason


def test_table_files_roundtrip_and_bad_files(tmp_path):
    t = table(SWEEP)
    path = select_table.save(t, tmp_path)
    assert path.name == t.key.file_name()
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    loaded = select_table.load_dir(tmp_path)
    assert len(loaded) == 1
    got = loaded[0]
    assert got.key == t.key and got.points == t.points and got.libraries == t.libraries
    sk = skewed({16: ({"triton": 1.0, "cutlass": 1.01}, {"triton": 2.0, "cutlass": 1.0})},
                work=shaped(16))
    back = SelectionTable.from_json(json.loads(json.dumps(sk.to_json())))
    assert back.points == sk.points and back.points[0].skewed_ms == {"triton": 2.0, "cutlass": 1.0}
    assert "skewed_ms" not in t.to_json()["points"][0]
    assert json.loads(path.read_text())["crossovers"][0] == {"from_num_tokens": 1,
                                                              "backend": "triton"}
    assert select_table.load_dir(tmp_path / "missing") == []


def test_user_tables_take_precedence(tmp_path, monkeypatch, fakes):
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "user"))
    shipped = tmp_path / "shipped"
    monkeypatch.setattr(select_table, "shipped_dir", lambda: shipped)
    select_table.save(table({16: {"triton": 0.01, "cutlass": 0.02}}), shipped)
    assert select_runner(shaped(16), RunnerConfig("auto"), H100).backend == "triton"
    select_table.save(table({16: {"triton": 0.03, "cutlass": 0.02}}))  # user dir
    d = select_runner(shaped(16), RunnerConfig("auto"), H100)
    assert d.backend == "cutlass" and str(tmp_path / "user") in d.reason
    select_table.reload()


def test_shipped_tables_are_valid():
    """Every shipped table parses and names only known backends."""
    from moekit.config import RUNNER_BACKENDS

    for t in select_table.load_dir(select_table.shipped_dir()):
        for p in t.points:
            assert set(p.ms) <= set(RUNNER_BACKENDS) - {"auto"}, t.source


# ---------------------------------------------------------------------------- real runners


@pytest.mark.parametrize("platform, reason", [(H100, "needs SM100 (Blackwell); this GPU is SM90"),
                                              (CPU, "needs SM100 (Blackwell); no CUDA GPU"),
                                              (B200, "not implemented")])
@pytest.mark.parametrize("backend", SM100_ONLY)
def test_sm100_only_backends_fail_with_reason(backend, platform, reason):
    work = shaped(8, device="cpu" if platform is CPU else "cuda")
    with pytest.raises(ConfigError, match="cannot run here: .*" + re.escape(reason)):
        select_runner(work, RunnerConfig(backend), platform, tables=NO_TABLES)
    assert reason in why_not(backend, work, platform)


@pytest.mark.parametrize("platform", [H100, H100_NO_DG, B200, A100], ids=lambda p: p.device_name)
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_auto_never_picks_sm100_only_backends(platform, T):
    cfg = RunnerConfig("auto")
    try:
        d = select_runner(shaped(T), cfg, platform, tables=NO_TABLES)
    except ConfigError:
        return  # nothing usable on this fake platform with this build: fine, nothing picked
    assert d.backend not in SM100_ONLY


def test_real_rules_for_impossible_choices(monkeypatch):
    # the platform's rules, not this machine's toolchain
    monkeypatch.setattr(registry.runner_class("deep_gemm"), "toolchain_problem", lambda: None)
    gptoss = workload_for(preset("gpt-oss-120b"), 16)
    assert why_not("deep_gemm", gptoss, H100) is None  # 2880: off the 128 grid, 16-aligned
    assert "multiples of 16" in why_not("deep_gemm", replace(gptoss, intermediate_size=2884), H100)
    assert "sgl-deep-gemm" in why_not("deep_gemm", shaped(1), H100_NO_DG)
    assert "SM90" in why_not("deep_gemm", shaped(1), B200)
    fp16 = shaped(1, dtype="float16")
    assert "bfloat16" in why_not("cutlass", fp16, H100)
    assert "int4_w4a16" in why_not("cutlass", shaped(1, weight_format="int4_w4a16"), H100)
    block = shaped(1, weight_format="fp8_w8a8", weight_spec=make_spec("fp8_w8a8"))
    assert "block" in why_not("cutlass", block, H100)
    assert why_not("deep_gemm", block, H100) is None
    channel = replace(block, weight_spec=make_spec("fp8_w8a8", weight_scale="channel"))
    assert "block" in why_not("deep_gemm", channel, H100)
    assert why_not("cutlass", channel, H100) is None
    assert "flashinfer-python" in why_not("flashinfer_cutlass", shaped(1), H100)


def test_workload_for_is_per_rank():
    m = preset("deepseek-v3")
    w = workload_for(m, 32, parallel=ParallelConfig(tp_size=8, ep_size=8))
    assert (w.num_experts, w.hidden_size, w.intermediate_size, w.top_k) == (32, 7168, 2048, 8)
    w = workload_for(preset("mixtral-8x7b"), 1, parallel=ParallelConfig(tp_size=4))
    assert (w.num_experts, w.intermediate_size) == (8, 14336 // 4)


# ---------------------------------------------------------------------------- explain and logging


def test_explain_rows(fakes):
    rows = dict(explain(shaped(16), RunnerConfig("auto"), H100_NO_DG, tables=[table(SWEEP)]))
    assert rows["cutlass"] == "chosen"
    assert rows["triton"] == "usable" and rows["torch"] == "usable"
    assert rows["deep_gemm"] == "needs sgl-deep-gemm"
    assert rows["flashinfer_trtllm"] == registry.NOT_IMPLEMENTED
    assert list(rows.values()).count("chosen") == 1


def test_explain_when_nothing_can_run(fakes):
    rows = explain(shaped(1, weight_format="int8_w8a16"), RunnerConfig("auto"), H100,
                   tables=NO_TABLES)
    assert rows[0][0] == "(none)" and "no runner can run this" in rows[0][1]
    assert all(s != "chosen" for _, s in rows)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_one_log_line_per_new_decision(fakes):
    handler = _Collect()
    log = logging.getLogger("moekit")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.INFO)
    try:
        work = shaped(12345)  # a batch size no other test uses
        for _ in range(3):
            select_runner(work, RunnerConfig("auto"), H100, tables=[table(SWEEP)])
        select_runner(replace(work, num_tokens=12346), RunnerConfig("auto"), H100,
                      tables=[table(SWEEP)])
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    lines = [m for m in handler.messages if "T=1234" in m]
    assert len(lines) == 2
    assert lines[0].startswith("runner deep_gemm for T=12345 (standard, unquantized, bfloat16")


# ---------------------------------------------------------------------------- in the layer


def test_layer_decides_per_batch_size_from_the_table(tmp_path, monkeypatch):
    """The MoE layer caches one decision per workload, batch size included (what makes the choice
    per captured batch size under CUDA graphs); a CPU table switches torch -> cutlass at T=32."""
    from moekit import MoE, MoEConfig
    from moekit.hardware import detect
    from moekit.router import TopKOutput

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, dtype="float32")
    layer = MoE(cfg, device="cpu")
    work = workload_for(cfg, 1, device="cpu")
    key = key_of(work, detect())
    t = SelectionTable(key, select_table.library_versions(detect()), (
        Point(4, {"torch": 0.01, "cutlass": 0.02}), Point(32, {"torch": 0.05, "cutlass": 0.03})))
    select_table.save(t, tmp_path / "select")
    metrics.reset()
    try:
        for T in (4, 4, 32):
            x = torch.randn(T, 32)
            ids = torch.rand(T, 8).argsort(1)[:, :2].int()
            layer.forward_topk(x, TopKOutput(torch.rand(T, 2), ids))
        decided = {w.num_tokens: d.backend for w, d in layer.runners._decisions.items()}
        assert decided == {4: "torch", 32: "cutlass"}
        assert metrics.runner_calls() == {"torch": 2, "cutlass": 1}
    finally:
        select_table.reload()


# ---------------------------------------------------------------------------- moekit tune --select


def test_tune_select_writes_a_table_the_layer_uses(tmp_path, monkeypatch):
    """CPU, scaled-down preset: measure torch and cutlass, write the table, and check that the
    layer's `auto` decisions follow it (the table's fastest backend at the nearest batch)."""
    from moekit import MoE
    from moekit.select_tune import sweep_spec, tune_select

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    spec = sweep_spec("qwen3-30b-a3b", dtype="float32", batch_sizes=(1, 16), device="cpu",
                      backends=("torch", "cutlass", "auto"))
    assert "auto" not in spec.backends
    with pytest.raises(ConfigError, match="uniform routing, got routing 'zipf'"):
        tune_select(replace(spec, routing="zipf"))
    report = tune_select(spec)
    try:
        assert report.path is not None and report.path.parent == tmp_path / "select"
        t = report.table
        assert [p.num_tokens for p in t.points] == [1, 16]
        assert all(set(p.ms) == {"torch", "cutlass"} for p in t.points)
        assert t.meta["preset"] == "qwen3-30b-a3b" and t.meta["scaled_down"]
        layer = MoE(spec.moe, spec.parallel, device="cpu")
        from moekit.sweep import make_routing

        for T in (1, 16):
            topk = make_routing(T, spec.moe.num_experts, spec.moe.top_k)
            layer.forward_topk(torch.randn(T, spec.moe.hidden_size), topk)
        decided = {w.num_tokens: d for w, d in layer.runners._decisions.items()}
        for p in t.points:
            assert decided[p.num_tokens].backend == p.ranking[0]
            assert str(report.path) in decided[p.num_tokens].reason
    finally:
        select_table.reload()


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU this times full-size shapes: scripts/gpu_backends.sh does")
def test_tune_cli_select_flag(tmp_path, monkeypatch, capsys):
    from moekit.cli.main import main

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    try:
        code = main(["tune", "--select", "--model", "mixtral-8x7b", "--dtype", "float32",
                     "--batch-sizes", "2", "--no-progress", "--out-dir", str(tmp_path / "x")])
    finally:
        select_table.reload()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "wrote " in out and "auto picks: T>=2: " in out
    assert "(this table ranks batch sizes T = 0-8, within 4x of a measured one;" in out
    assert len(list((tmp_path / "x").glob("*.json"))) == 1


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU this times full-size shapes: scripts/gpu_backends.sh does")
def test_tune_cli_select_skewed(tmp_path, monkeypatch, capsys):
    """--skewed: a second sweep on Zipf routing; its times sit beside the uniform ones."""
    from moekit.cli.main import main

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    try:
        code = main(["tune", "--select", "--skewed", "--zipf-s", "1.5", "--model", "mixtral-8x7b",
                     "--dtype", "float32", "--batch-sizes", "2,8", "--out-dir", str(tmp_path)])
    finally:
        select_table.reload()
    out = capsys.readouterr().out
    assert code == 0, out
    assert "uniform routing: " in out and "zipf s=1.5 routing: " in out
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["meta"]["skewed_routing"] == "zipf s=1.5"
    assert doc["meta"]["command"] == "moekit tune --select --skewed"
    for p in doc["points"]:
        assert set(p["skewed_ms"]) == set(p["ms"]) and all(v > 0 for v in p["skewed_ms"].values())
    assert main(["tune", "--skewed", "--model", "mixtral-8x7b"]) == 2
    assert "--skewed: only with --select" in capsys.readouterr().err


# ---------------------------------------------------------------------------- shipped tables


def test_shipped_tables_are_keyed_like_their_presets_layers_and_drive_auto(fakes):
    """Every table in moekit/configs/select loads, is keyed exactly as the workload of its
    preset's layer (rank 0, its TP/EP) looks it up on that device, and makes `auto` pick the
    fastest measured backend at the nearest measured batch size."""
    shipped = select_table.load_dir(select_table.shipped_dir())
    assert shipped, f"no selection tables in {select_table.shipped_dir()}"
    for t in shipped:
        meta = t.meta
        par = ParallelConfig(tp_size=meta["tp_size"], ep_size=meta["ep_size"])
        plat = Platform("cuda", t.key.device_name, (9, 0), 1,
                        {k: v for k, v in t.libraries.items() if v is not None})
        moe = preset(meta["preset"], weight_format=t.key.weight_format)
        sizes = [p.num_tokens for p in t.points]
        for T in sorted({*sizes, *(s * 2 + 1 for s in sizes)}):
            work = workload_for(moe, T, parallel=par)
            assert key_of(work, plat) == t.key, (t.source, meta)
            d = select_runner(work, RunnerConfig("auto"), plat, tables=shipped)
            point = t.nearest(T)
            assert d.backend == point.ranking[0], (t.source, T, d.reason)
            assert "same library versions" in d.reason


def test_checkpoint_specs_look_up_the_shipped_tables(fakes):
    """A layer holding a checkpoint's format keys like the preset's own: DeepSeek-V3's block fp8
    (read from weight_scale_inv) and GPTQ's float16 int4 scales find the shipped tables."""
    from moekit.quant.checkpoint import checkpoint_format

    shipped = select_table.load_dir(select_table.shipped_dir())
    plat = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"torch": "2.11.0+cu130"})
    par = ParallelConfig(tp_size=8, ep_size=8)
    for qc, fmt in [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8_w8a8"),
                    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True},
                     "int4_w4a16")]:  # fmt: skip
        spec = checkpoint_format(qc).spec
        moe = preset("deepseek-v3", weight_format=fmt)
        work = workload_for(moe, 16, parallel=par, weight_spec=spec)
        assert key_of(work, plat) == key_of(workload_for(moe, 16, parallel=par), plat)
        assert any(t.key == key_of(work, plat) for t in shipped), fmt


def test_shipped_tables_rank_backends_for_an_untuned_preset(fakes):
    """qwen3-235b-a22b has no table: `auto` borrows the nearest shipped shape's point (the
    shipped tables record capability 9.0, so an H800 uses them too)."""
    shipped = select_table.load_dir(select_table.shipped_dir())
    assert all(t.meta.get("capability") == [9, 0] for t in shipped)
    work = workload_for(preset("qwen3-235b-a22b"), 4096, parallel=ParallelConfig())
    for device in ("NVIDIA H100 80GB HBM3", "NVIDIA H800"):
        plat = Platform("cuda", device, (9, 0), 1, {"torch": "2.11.0+cu130", "triton": "3.9.0",
                                                    "sgl-deep-gemm": "0.2.2"})  # fmt: skip
        d = select_runner(work, RunnerConfig("auto"), plat, tables=shipped)
        assert "no selection table of this shape" in d.reason, d.reason
        assert "nearest measured shape" in d.reason and "same library versions" in d.reason
        assert "__triton3.9.0_deepgemm0.2.2.json" in d.reason


def test_shipped_h200_tables_for_triton_39_without_deep_gemm(fakes):
    """An H200 with Triton 3.9 and no deep_gemm (a plain install of torch 2.15) ranks by the
    table measured under Triton 3.9 with deep_gemm, not by the Triton 3.6 one: fp8 block-wise
    at T = 4096 runs the Gluon engine of `triton_kernel` (deep_gemm, the fastest measured, is
    skipped), which the 3.6 table never measured."""
    shipped = select_table.load_dir(select_table.shipped_dir())
    plat = Platform("cuda", "NVIDIA H200", (9, 0), 1,
                    {"torch": "2.11.0+cu130", "triton": "3.9.0"})  # fmt: skip
    work = workload_for(preset("qwen3-30b-a3b", weight_format="fp8_w8a8"), 4096,
                        parallel=ParallelConfig())  # fmt: skip
    d = select_runner(work, RunnerConfig("auto"), plat, tables=shipped)
    assert d.backend == "triton_kernel", d.reason
    assert "__triton3.9.0_deepgemm0.2.2.json" in d.reason and "deep_gemm" in d.reason
