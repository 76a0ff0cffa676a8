"""The tuner's shared-memory estimate per weight format and the candidate configs it lets
through (pure functions: no kernels run)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moekit.quant import make_spec
from moekit.runners.triton.configs import GemmConfig
from moekit.tune import (
    FOLD_TRY,
    SMEM_LIMIT,
    TWO_WARPS_MAX_TILE,
    TileBytes,
    fits,
    schedule_variants,
    smem_bytes,
    tile_bytes,
    tile_candidates,
)

# gate_up tile 16 x 64 x 128, 4 warps, 3 stages (bf16 / fp16 activations: 2 bytes). Per K step:
# A 16 * 128 * act; weights 2 * 64 rows * 128 * w; scales 128 rows * groups * bytes (+ zero);
# packed formats add one dequantized tile 128 * 64 * 2 = 16384 (64 rows < 32 per warp * 4).
TILE = GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=3)
SMEM_CASES = [
    # (format, params, expected bytes)
    ("unquantized", {}, 3 * (4096 + 32768)),
    ("int4_w4a16", {}, 3 * (4096 + 8192 + 128 * 1 * 2) + 16384),  # g128, bf16 scales
    ("int4_w4a16", {"group_size": 32, "symmetric": False, "scale_dtype": torch.float32},
     3 * (4096 + 8192 + 128 * 4 * (4 + 1)) + 16384),  # 4 groups, f32 scale + u8 zero
    ("mxfp4", {}, 3 * (4096 + 8192 + 128 * 4 * 1) + 16384),  # e8m0 per 32
    ("nvfp4", {}, 3 * (4096 + 8192 + 128 * 8 * 1) + 16384),  # e4m3 per 16
    ("int8_w8a16", {}, 3 * (4096 + 16384 + 128 * 4)),  # f32 row scale every step
    ("fp8_w8a8", {"weight_scale": "block"}, 3 * (4096 + 16384 + 128 * 4 + 16 * 4)),
    ("fp8_w8a8", {"weight_scale": "channel"}, 3 * (2048 + 16384)),
    ("fp8_w8a8", {"weight_scale": "tensor"}, 3 * (2048 + 16384)),
    ("int8_w8a8", {}, 3 * (2048 + 16384)),
]  # fmt: skip


@pytest.mark.parametrize("fmt,params,expected", SMEM_CASES)
def test_smem_estimate_per_format(fmt, params, expected):
    spec = None if fmt == "unquantized" else make_spec(fmt, **params)
    assert smem_bytes("gate_up", TILE, tile_bytes(spec, 2)) == expected


def test_weight_bytes_per_element():
    assert tile_bytes(None, 2).weight == 2 and tile_bytes(None, 4).weight == 4
    for fmt in ("int4_w4a16", "mxfp4", "nvfp4"):
        tb = tile_bytes(make_spec(fmt), 2)
        assert tb.weight == 0.5 and tb.packed and tb.weight_only
    for fmt in ("int8_w8a16", "int8_w8a8", "fp8_w8a8"):
        assert tile_bytes(make_spec(fmt), 2).weight == 1
    assert tile_bytes(make_spec("int8_w8a16"), 2).weight_only
    assert not tile_bytes(make_spec("fp8_w8a8"), 2).weight_only


def test_int_elem_is_the_unquantized_estimate():
    """An int `elem` (bytes of an unquantized element) keeps the former estimate."""
    for gemm, tiles in (("gate_up", 2), ("down", 1)):
        for c in (TILE, GemmConfig(64, 128, 64, 8, 8, 4), GemmConfig(16, 32, 256, 1, 4, 5)):
            for elem in (2, 4):
                old = c.num_stages * (c.block_m + tiles * c.block_n) * c.block_k * elem
                assert smem_bytes(gemm, c, elem) == old == smem_bytes(gemm, c, TileBytes(elem,
                                                                                        elem))


def test_estimate_bounds_the_measured_allocations():
    """ncu on the H100 (benchmarks/results/20261121T2322Z_H100_triton_quant_ncu_tuned.txt,
    deepseek int4 T = 16): 40960 and 49408 bytes of dynamic shared memory."""
    tb = tile_bytes(make_spec("int4_w4a16"), 2)
    assert 40960 <= smem_bytes("gate_up", TILE, tb) <= 1.5 * 40960
    down = GemmConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=5)
    assert 49408 <= smem_bytes("down", down, tb) <= 1.5 * 49408


def test_dequantized_tile_counted_only_below_ldmatrix_rows():
    """Packed formats: the extra dequantized tile [BK, BN] only with < 32 rows per warp."""
    tb = tile_bytes(make_spec("mxfp4"), 2)  # 4 e8m0 groups per K step of 128
    wide = replace(TILE, block_n=128)  # 32 rows per warp at 4 warps
    assert smem_bytes("gate_up", wide, tb) == 3 * (4096 + 256 * 64 + 256 * 4)
    two = replace(TILE, num_warps=2)  # 32 rows per warp at 2 warps
    assert smem_bytes("gate_up", two, tb) == 3 * (4096 + 128 * 64 + 128 * 4)
    assert smem_bytes("gate_up", TILE, tb) == smem_bytes("gate_up", two, tb) + 128 * 64 * 2
    # unpacked formats never add it
    tb8 = tile_bytes(make_spec("int8_w8a16"), 2)
    assert smem_bytes("down", TILE, tb8) == 3 * (4096 + 64 * 128 + 64 * 4)


# deepseek-v3 at EP8 (H = 7168, I = 2048) and qwen3 (H = 2048, I = 768)
SHAPES = [(2 * 2048, 7168), (2 * 768, 2048)]
PACKED = [("int4_w4a16", "int4_w4a16-g128-sym"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")]


@pytest.mark.parametrize("fmt,tag", PACKED)
@pytest.mark.parametrize("rows", [1, 20])
@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_gate_up_block_n_128_is_a_candidate(fmt, tag, rows, n, k):
    tb = tile_bytes(make_spec(fmt), 2)
    packed = tile_candidates("gate_up", rows, n, k, tb, tag)
    bf16 = tile_candidates("gate_up", rows, n, k, 2)
    # the gate_up tiles with 128 rows of gate and of up that bf16 cannot have: over the
    # shared-memory limit at 2 bytes a weight, within it at half a byte
    new = [c for c in packed if c.block_n == 128 and c not in bf16]
    assert new and all(smem_bytes("gate_up", c, 2) > SMEM_LIMIT for c in new)
    if rows == 1:  # decode: 16-row blocks, K steps of 128 / 256: bf16 has no block_n 128
        assert not any(c.block_n == 128 for c in bf16)
        assert {c.block_k for c in new} == {128, 256}
    assert all(smem_bytes("gate_up", c, tb) <= SMEM_LIMIT for c in packed)
    assert all(not c.tma for c in packed)


def _warps(variants):
    return {c.num_warps for c in variants}


@pytest.mark.parametrize("gemm,n,k", [("gate_up", 4096, 7168), ("down", 7168, 2048)])
def test_two_warps_only_for_small_weight_only_tiles(gemm, n, k):
    small = GemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
    large = replace(small, block_n=128)
    assert small.block_m * small.block_n <= TWO_WARPS_MAX_TILE < large.block_m * large.block_n
    for fmt in ("int4_w4a16", "mxfp4", "nvfp4", "int8_w8a16"):
        tb = tile_bytes(make_spec(fmt), 2)
        got = schedule_variants(gemm, small, n, k, tb)
        assert _warps(got) == {2, 4, 8}
        assert len(got) == len(set(got)) <= 10
        assert all(fits(gemm, c, n, k, tb) for c in got)
        assert 2 not in _warps(schedule_variants(gemm, large, n, k, tb))
        assert 2 not in _warps(schedule_variants(gemm, replace(small, block_m=32), n, k, tb))
    for spec in (None, make_spec("fp8_w8a8"), make_spec("int8_w8a8")):
        tb = tile_bytes(spec, 2)
        assert 2 not in _warps(schedule_variants(gemm, small, n, k, tb))
    assert 2 not in _warps(schedule_variants(gemm, small, n, k))  # int elem: unquantized


def test_round_2_tries_a_larger_fold_where_short_blocks_fold():
    """With unquantized weights and experts of a full block or more, round 2 also times the
    tile folding FOLD_TRY rows; not where folding cannot apply (quantized: None, fewer rows
    than a block, FOLD_TRY not under block_m, swapped or split tiles)."""
    tile = GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True)
    n, k = 14336, 4096
    got = schedule_variants("gate_up", tile, n, k, 2, fold_rows_per_expert=256.0)
    assert [c for c in got if c.fold_rows is not None] == [replace(tile, fold_rows=FOLD_TRY)]
    for blocked in (dict(fold_rows_per_expert=None), dict(fold_rows_per_expert=100.0)):
        assert all(c.fold_rows is None for c in schedule_variants("gate_up", tile, n, k, 2,
                                                                  **blocked))  # fmt: skip
    for other in (replace(tile, block_m=32), replace(tile, swap_ab=True, block_m=64),
                  replace(tile, split_k=2, reduce="atomic")):  # fmt: skip
        got = schedule_variants("down", other, 4096, 7168, 2, fold_rows_per_expert=256.0)
        assert all(c.fold_rows is None for c in got)


class _Stop(Exception):
    pass


def test_tune_point_sizes_tiles_with_the_weight_format(monkeypatch):
    """tune_point sizes the search's tiles with the weights' format (`tile_bytes` of their
    spec), not with the activation dtype."""
    from moekit import tune
    from moekit.bench import Ceilings
    from moekit.quant import quantize_experts

    shape = tune.TuneShape(4, 2, 64, 32, "float16", label="tiny")
    seen = []

    def spy(gemm, rows, n, k, elem=2, quant="unquantized"):
        seen.append((gemm, elem, quant))
        raise _Stop

    monkeypatch.setattr(tune, "tile_candidates", spy)
    for fmt, expected in (("nvfp4", tile_bytes(make_spec("nvfp4"), 2)),
                          (None, tile_bytes(None, 2))):  # fmt: skip
        w = tune.random_weights(shape, "cpu")
        if fmt is not None:
            w = quantize_experts(w, make_spec(fmt))
        with pytest.raises(_Stop):
            tune.tune_point(shape, w, 3, "cpu", Ceilings(1e10, 1e11, "float16"), limit=1)
        assert seen[-1] == ("gate_up", expected, fmt or "unquantized")


@pytest.mark.parametrize("fmt", ["mxfp4", "int4_w4a16", "int8_w8a16", "fp8_w8a8", None])
def test_row_per_program_candidates_at_decode(fmt):
    """Weight-only formats try block_m 1 (one pair per program, no MMA) at decode batches
    (at most ROW1_MAX_ROWS rows per used expert) and not above; the others never."""
    from moekit.runners._tables import quant_tag
    from moekit.tune import ROW1_MAX_ROWS, tile_candidates

    spec = make_spec(fmt) if fmt else None
    elem, quant = tile_bytes(spec, 2), quant_tag(spec)
    for gemm, n, k in (("gate_up", 5760, 2880), ("down", 2880, 2880)):
        decode = [c for c in tile_candidates(gemm, 0.25, n, k, elem, quant) if c.block_m == 1]
        above = [c for c in tile_candidates(gemm, 4 * ROW1_MAX_ROWS, n, k, elem, quant) if c.block_m == 1]
        assert not above
        if spec is not None and spec.weight_only:
            assert len(decode) >= 3 and not any(c.swap_ab for c in decode)
        else:
            assert not decode


def test_round_two_seeds_are_distinct_tile_shapes():
    """Round 2 refines the fastest config of each of the two fastest tile shapes: a shape's
    TMA twin is not a second seed, and a later shape's slower configs do not displace it."""
    from moekit.tune import best_shapes

    a = GemmConfig(128, 64, 128, group_m=8, num_warps=8, num_stages=3)
    b = GemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3)
    c = GemmConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3)
    ranked = [(359.5, a), (363.1, replace(a, tma=True)), (364.5, replace(b, tma=True)),
              (366.9, b), (395.1, c)]  # fmt: skip
    assert best_shapes(ranked) == [a, replace(b, tma=True)]
    assert best_shapes(ranked, n=3) == [a, replace(b, tma=True), c]
    swapped = replace(a, swap_ab=True)
    assert best_shapes([(1.0, a), (2.0, swapped), (3.0, b)]) == [a, swapped]
    assert best_shapes([(1.0, a)]) == [a]
    assert best_shapes([]) == []


def test_points_are_timed_on_as_many_routings_as_the_bench_times():
    """A point is tuned on the routings the bench would time it on (`bench.routings_for`: at
    least bench.MIN_ROUTINGS up to bench.MULTI_ROUTING_MAX_T tokens, more while the timed
    weights would sit in L2, at most bench.MAX_INPUT_SETS), and on at least tune.MIN_ROUTINGS."""
    from moekit import bench, tune

    big = tune.TuneShape(8, 2, 4096, 7168)  # 176 MB an expert
    small = tune.TuneShape(128, 8, 256, 64)
    l2 = 50 << 20
    assert tune.rotations(big, 4, None, l2) == bench.MIN_ROUTINGS > tune.MIN_ROUTINGS >= 4
    assert tune.rotations(big, 1024, None, l2) == tune.MIN_ROUTINGS
    assert tune.rotations(small, 4096, None, l2) == bench.MAX_INPUT_SETS  # 13 MB a routing
    for T in (1, 16, 256, 1024):  # T = 1 touches 2 experts, T >= 4 all 8
        n = bench.routings_for(T, min(8, 2 * T) * 3 * 4096 * 7168 * 2, l2)
        assert tune.rotations(big, T, None, l2) == max(tune.MIN_ROUTINGS, n)
