"""The triton runner's config tables (lookup order, nearest batch size, validation), the shipped
files, and the tuner's pure parts (per-rank shapes, search space, resume, a tiny CPU run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moekit.config import ConfigError
from moekit.experts import ActivationSpec
from moekit.runners import _tables
from moekit.runners.triton import configs as tc
from moekit.runners.triton.configs import GemmConfig, Table, TableKey

KEY = TableKey("down", 8, 64, 32, "float32", "Test GPU 80GB", "3.6.0")


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """An empty user dir and an empty shipped dir."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(user))
    monkeypatch.setattr(tc, "shipped_dir", lambda: shipped)
    tc.clear_cache()
    yield user / "triton", shipped
    tc.clear_cache()


def test_gemm_config_validation():
    with pytest.raises(ValueError, match="block_m"):
        GemmConfig(block_m=24)
    assert GemmConfig(block_m=1).block_m == 1  # one row per program, no MMA
    with pytest.raises(ValueError, match="swap_ab must be False"):
        GemmConfig(block_m=1, swap_ab=True)
    with pytest.raises(ValueError, match="reduce"):
        GemmConfig(reduce="sum")
    with pytest.raises(ValueError, match="unknown keys"):
        GemmConfig.from_dict({"block_m": 16, "BLOCK_SIZE_M": 16})
    with pytest.raises(ValueError, match="split_k must be one of"):
        GemmConfig(reduce="atomic", split_k=3)
    c = GemmConfig(32, 64, 128, 1, 8, 5, True, "atomic", split_k=4)
    assert GemmConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    legacy = {k: v for k, v in c.to_dict().items() if k != "split_k"}  # tables from before it
    assert GemmConfig.from_dict(legacy).split_k == 1


def test_nearest_batch_size_in_log_distance():
    t = Table({1: GemmConfig(16), 64: GemmConfig(32), 1024: GemmConfig(128)}, "x")
    assert t.pick(0).block_m == 16
    assert t.pick(7).block_m == 16  # log2: 2.8 from 1, 3.2 from 64
    assert t.pick(9).block_m == 32
    assert t.pick(300).block_m == 128  # 2.1 from 64, 1.8 from 1024 (absolute would pick 64)
    assert t.pick(10**6).block_m == 128
    # EP ranks look up tokens' worth of local pairs, below 1 at decode sizes
    t = Table({0.125: GemmConfig(16), 1: GemmConfig(32), 4: GemmConfig(64)}, "x")
    assert t.pick(1 * 0.125).block_m == 16 and t.pick(0.01).block_m == 16
    assert t.pick(4 * 0.125).block_m == 32  # 0.5: log2 distance 2 from 0.125, 1 from 1
    assert t.pick(16 * 0.125).block_m == 32  # 2: a tie between 1 and 4 takes the smaller


def test_fractional_keys_round_trip_and_bad_keys(dirs):
    user, _ = dirs
    assert _tables.table_key(16, 0.125) == 2 and isinstance(_tables.table_key(16, 0.125), int)
    assert _tables.table_key(1, 0.125) == 0.125
    tc.write_table(user / KEY.filename(), KEY, {0.125: GemmConfig(block_m=16), 2: GemmConfig()},
                   {})  # fmt: skip
    data = json.loads((user / KEY.filename()).read_text())
    assert list(data["configs"]) == ["0.125", "2"]
    assert tc.find_table(KEY).configs[0.125].block_m == 16
    data["configs"]["0"] = data["configs"]["2"]
    (user / KEY.filename()).write_text(json.dumps(data))
    tc.clear_cache()
    with pytest.raises(ValueError, match=r"bad triton config file .*batch-size key '0'"):
        tc.find_table(KEY)


def test_user_dir_overrides_shipped_and_exact_version_first(dirs):
    user, shipped = dirs
    tc.write_table(shipped / KEY.filename(), KEY, {16: GemmConfig(block_m=16)}, {})
    assert tc.find_table(KEY).source.startswith(str(shipped))
    other = TableKey(**{**KEY.to_dict(), "triton": "3.5.0"})
    tc.write_table(user / other.filename(), other, {16: GemmConfig(block_m=32)}, {})
    tc.clear_cache()
    assert tc.find_table(KEY).configs[16].block_m == 16  # exact version beats the user dir
    tc.write_table(user / KEY.filename(), KEY, {16: GemmConfig(block_m=64)}, {})
    tc.clear_cache()
    assert tc.find_table(KEY).configs[16].block_m == 64
    newer = TableKey(**{**KEY.to_dict(), "triton": "3.10.0"})
    assert tc.find_table(newer).configs[16].block_m == 64  # other versions: newest (3.6 > 3.5)
    (user / KEY.filename()).unlink()
    tc.clear_cache()
    assert tc.find_table(newer).configs[16].block_m == 32  # the user dir still comes first



def test_a_table_of_a_few_batch_sizes_gives_way_beyond_their_reach(dirs, monkeypatch):
    """`moekit tune --batch-sizes 1,4,16` under a new Triton version writes a table of those
    sizes only: near them it is used; far from them, the next table in lookup order (here the
    shipped one of another version) that has an entry within TABLE_REACH is."""
    user, shipped = dirs
    monkeypatch.setattr(tc, "triton_version", lambda: "9.9.9")
    new = TableKey("gate_up", 8, 2 * 40, 48, "float32", "cpu", "9.9.9")
    old = TableKey(**{**new.to_dict(), "triton": "3.6.0"})
    tc.write_table(user / new.filename(), new, {1: GemmConfig(16), 16: GemmConfig(32)}, {})
    tc.write_table(shipped / old.filename(), old, {16: GemmConfig(64), 1024: GemmConfig(128)},
                   {})  # fmt: skip
    tc.clear_cache()

    def block_m(T):
        return tc.get_config("gate_up", T, 2, 8, 48, 40, "float32", "cpu").block_m

    assert [block_m(T) for T in (1, 16, 32)] == [16, 32, 32]  # within 2x of the new table's
    assert [block_m(T) for T in (512, 1024, 2048)] == [128] * 3  # beyond: the full table's
    assert block_m(64) == 32  # neither within 2x, both 4x off: the earlier table
    assert block_m(5000) == 128  # neither within 2x: the nearer entry (1024 against 16)
    assert tc.find_table(new).source == str(user / new.filename())  # without T: the first
    (shipped / old.filename()).unlink()
    tc.clear_cache()
    assert block_m(64) == 32  # the only table: its nearest entry, up to 4x its largest
    # past TABLE_SPAN_REACH x its largest entry (a table tuned for decode says nothing of
    # prefill): the heuristic default here, with no other tuned shape to borrow from
    rows = 1024 * 2 / 8
    assert tc.get_config("gate_up", 1024, 2, 8, 48, 40, "float32", "cpu") == \
        tc.default_config("gate_up", rows, 80, 48)
    assert tc.default_config("gate_up", rows, 80, 48).block_m != 32


def test_get_config_uses_table_else_heuristic(dirs):
    user, _ = dirs
    key = TableKey("gate_up", 8, 2 * 40, 48, "float32", "cpu", tc.triton_version())
    heuristic = tc.get_config("gate_up", 5, 2, 8, 48, 40, "float32", "cpu")
    assert heuristic == tc.default_config("gate_up", 5 * 2 / 8 if 5 * 2 > 8 else 1.0, 80, 48)
    tc.write_table(user / key.filename(), key, {4: GemmConfig(block_m=64, block_n=16)}, {})
    tc.clear_cache()
    assert tc.get_config("gate_up", 5, 2, 8, 48, 40, "float32", "cpu").block_m == 64


def test_table_of_another_triton_version_is_used_and_said(dirs, caplog, monkeypatch):
    user, _ = dirs
    monkeypatch.setattr(tc, "triton_version", lambda: "9.9.9")
    key = TableKey("gate_up", 8, 2 * 40, 48, "float32", "cpu", "3.6.0")
    tc.write_table(user / key.filename(), key, {4: GemmConfig(block_m=64, block_n=16)}, {})
    tc.clear_cache()
    with caplog.at_level("INFO", logger="moekit"):
        assert tc.get_config("gate_up", 5, 2, 8, 48, 40, "float32", "cpu").block_m == 64
    assert "tuned with Triton 3.6.0, running 9.9.9" in caplog.text
    assert _tables.table_triton_version(user / key.filename()) == "3.6.0"


def test_bad_file_names_itself(dirs):
    user, _ = dirs
    path = user / KEY.filename()
    path.parent.mkdir(parents=True)
    path.write_text('{"configs": {"16": {"block_m": 17}}}')
    with pytest.raises(ValueError, match=str(path.name)):
        tc.find_table(KEY)


GPU = "Test GPU 80GB"


def _tuned(directory, gemm, E, n, k, top_k, configs, device=GPU, quant="unquantized",
           capability=(9, 0)):  # fmt: skip
    """A table as `moekit tune` writes it (meta: top_k, capability) -> its key."""
    key = TableKey(gemm, E, n, k, "bfloat16", device, tc.triton_version(), quant)
    meta = {"top_k": top_k, **({"capability": list(capability)} if capability else {})}
    tc.write_table(directory / key.filename(), key, configs, meta)
    tc.clear_cache()
    return key


def test_untuned_shape_takes_the_nearest_tuned_regime_and_says_so(dirs, caplog):
    """A shape without a table takes the entry of a tuned one whose rows per used expert, output
    width and K are nearest, blocks cut to its size; the log line names where it came from."""
    _, shipped = dirs
    decode, mid, big = GemmConfig(16, 64, 128, 1, 4, 5, True), GemmConfig(32), GemmConfig(128, 256)
    _tuned(shipped, "down", 128, 2048, 768, 8, {1: decode, 64: mid, 4096: big})  # H 2048, I 768
    with caplog.at_level("INFO", logger="moekit"):  # H 4096, I 1536: width and K twice as large
        assert tc.get_config("down", 1, 8, 128, 4096, 1536, "bfloat16", GPU) == decode
    assert "nearest tuned shape E=128 N=2048 K=768 top_k=8 at batch 1" in caplog.text
    assert tc.get_config("down", 128, 8, 128, 4096, 1536, "bfloat16", GPU) == mid  # 8 rows: 4 / 64
    assert tc.get_config("down", 8192, 8, 128, 4096, 1536, "bfloat16", GPU) == big
    # E=32, top_k 4: T = 1 uses 4 experts, a row each, as the tuned T = 1 does (8 of 128)
    assert tc.get_config("down", 1, 4, 32, 2048, 768, "bfloat16", GPU) == decode
    # blocks are cut to the GEMM (gate_up: N / 2 output columns)
    assert tc.clamp("down", big, 100, 40) == GemmConfig(128, 128, 64)
    assert tc.clamp("gate_up", big, 100, 24) == GemmConfig(128, 64, 32)
    # nothing within MAX_REGIME_DISTANCE (rows per expert 64 times the tuned ones): the heuristic
    far = tc.get_config("down", 4096, 8, 2, 2048, 768, "bfloat16", GPU)
    assert far == tc.default_config("down", 4096 * 8 / 2, 2048, 768)


def test_transfer_keeps_to_gemm_dtype_format_and_device_family(dirs):
    _, shipped = dirs
    mine = GemmConfig(16, 32)
    _tuned(shipped, "gate_up", 8, 2 * 1024, 512, 2, {1: mine})  # H 512, I 1024
    want = ("gate_up", 1, 2, 8, 1024, 1024, "bfloat16")  # H 1024: no table of its own
    assert tc.get_config(*want, GPU) == mine
    assert tc.get_config("down", 1, 2, 8, 1024, 1024, "bfloat16", GPU) != mine  # other GEMM
    assert tc.get_config("gate_up", 1, 2, 8, 1024, 1024, "float16", GPU) != mine  # other dtype
    # another device: only with the same compute capability, stated by the table
    assert tc.get_config(*want, "Other GPU") != mine
    assert tc.get_config(*want, "Other GPU", capability=(9, 0)) == mine
    assert tc.get_config(*want, "Other GPU", capability=(8, 0)) != mine
    # equally near tables of two devices: the asking device's own wins
    theirs = GemmConfig(16, 64)
    _tuned(shipped, "gate_up", 8, 2 * 1024, 512, 2, {1: theirs}, device="Other GPU")
    assert tc.get_config(*want, GPU, capability=(9, 0)) == mine
    assert tc.get_config(*want, "Other GPU", capability=(9, 0)) == theirs
    # tables that do not say their top_k (or capability) are not lent out
    (shipped / "x.json").write_text("not json")
    tc.clear_cache()
    assert len(tc.tuned_shapes()) == 2
    tc.clear_cache()
    for path in shipped.glob("*.json"):
        if path.name != "x.json":
            path.unlink()
    _tuned(shipped, "gate_up", 8, 2 * 1024, 512, 2, {1: mine}, device="Fourth GPU",
           capability=None)  # fmt: skip
    assert tc.get_config(*want, "Fifth GPU", capability=(9, 0)) != mine
    assert tc.get_config(*want, "Fourth GPU") == mine


def test_masked_format_takes_its_tuned_entry_at_c_rows_per_expert(dirs, caplog):
    """The masked format looks its shape's table up at C rows per expert (T = C * E / the
    table's top_k), only for entries with MMA row blocks and within the table's span; otherwise
    (and without top_k in the table's meta) the heuristic at C rows, adapted to the format."""
    _, shipped = dirs
    E, H, I = 32, 256, 128
    decode, mid, big = GemmConfig(1, 64), GemmConfig(32, 64), GemmConfig(128, 128)
    _tuned(shipped, "down", E, H, I, 8, {1: decode, 64: mid, 4096: big})
    look = lambda c, quant="unquantized": tc.masked_config(  # noqa: E731
        "down", c, E, H, I, "bfloat16", GPU, quant)
    with caplog.at_level("INFO", logger="moekit"):
        assert look(16) == mid  # T = 16 * 32 / 8 = 64
    assert "triton runner masked down E=32 N=256 K=128" in caplog.text
    assert look(1024) == big  # T = 4096
    assert look(256) == big  # T = 1024: log2 distance 4 from 64, 2 from 4096
    # the nearest entry is the standard format's one-pair-per-program mode: the heuristic
    assert look(1) == tc.default_config("down", 1, H, I)
    # past TABLE_SPAN_REACH x the largest key: the heuristic
    assert look(4096 * tc.TABLE_SPAN_REACH) == tc.default_config("down", 16384, H, I)
    # another format has no table of its own: its heuristic, adapted
    fp8 = "fp8_w8a8-block128x128-token_group"
    assert look(16, fp8) == tc.adapt_config(tc.default_config("down", 16, H, I), fp8, "down")
    # a table whose meta does not name its top_k cannot map C to a batch size
    key = TableKey("gate_up", E, 2 * I, H, "bfloat16", GPU, tc.triton_version())
    tc.write_table(shipped / key.filename(), key, {64: mid}, {})
    tc.clear_cache()
    got = tc.masked_config("gate_up", 16, E, H, I, "bfloat16", GPU)
    assert got == tc.default_config("gate_up", 16, 2 * I, H) != mid


def test_a_decode_only_table_gives_way_to_a_near_shape_at_prefill(dirs, caplog):
    """kimi-k2's bf16 table was tuned for T <= 64 (keys up to 8 on an EP8 rank): at T = 4096 its
    T = 64 entry ran the layer at 5x the floor. Past TABLE_SPAN_REACH x its largest key the
    shape borrows the nearest tuned shape's entry (here deepseek-v3's E=32 of the same GEMM),
    and the log says why; within it, its own table still serves."""
    _, shipped = dirs
    decode, prefill = GemmConfig(16, 64), GemmConfig(128, 128, 64, 8, 8, 4)
    _tuned(shipped, "gate_up", 48, 4096, 7168, 8, {0.125: decode, 8: decode})
    _tuned(shipped, "gate_up", 32, 4096, 7168, 8, {8: decode, 512: prefill})
    want = ("gate_up", 512, 8, 48, 7168, 2048, "bfloat16", GPU)
    with caplog.at_level("INFO", logger="moekit"):
        assert tc.get_config(*want) == prefill
    assert "batches past 4 x the largest (8) of" in caplog.text
    assert "nearest tuned shape E=32 N=4096 K=7168 top_k=8 at batch 512" in caplog.text
    assert tc.get_config("gate_up", 32, 8, 48, 7168, 2048, "bfloat16", GPU) == decode


def test_quantized_shape_prefers_its_format_then_adapts_the_unquantized(dirs):
    _, shipped = dirs
    fp8 = "fp8_w8a8-block128x128-token_group"
    base = GemmConfig(64, 128, 64, num_warps=8)
    _tuned(shipped, "down", 16, 1024, 512, 4, {64: base})
    want = ("down", 64, 4, 16, 1024, 512, "bfloat16", GPU)
    assert tc.get_config(*want, fp8) == tc.adapt_config(base, fp8, "down")
    tuned_fp8 = GemmConfig(16, 64, 128, 1, 4, 5, True)
    _tuned(shipped, "down", 32, 2048, 1024, 8, {64: tuned_fp8}, quant=fp8)  # another shape
    assert tc.get_config(*want, fp8) == tuned_fp8
    assert tc.get_config(*want, "int4_w4a16-g128-sym") == tc.adapt_config(
        base, "int4_w4a16-g128-sym", "down")  # fmt: skip


@pytest.mark.parametrize("rows", [1, 4, 30, 100, 1000, 5000])
@pytest.mark.parametrize("gemm", ["gate_up", "down"])
def test_default_config_is_valid(gemm, rows):
    c = tc.default_config(gemm, rows, 1536, 2048)
    assert c.block_m >= 16 and (rows <= 16) == (c.block_m == 16)
    small = tc.default_config(gemm, rows, 40, 24)  # tiny GEMMs get small blocks
    assert small.block_n <= 32 and small.block_k <= 16


def test_shipped_files_parse_and_match_their_names():
    files = sorted(tc.shipped_dir().glob("*.json"))
    for path in files:
        data = json.loads(path.read_text())
        key = TableKey(**data["key"])
        assert key.filename() == path.name
        table = tc.read_table(path)
        assert all(b >= 1 or b in (0.125, 0.5) for b in table.configs)  # EP8 keys below 1
        for b, point in data["meta"].get("points", {}).items():
            assert _tables.parse_key(b) in table.configs
            if "tokens" in point:  # T tokens, a share of their pairs local (1 off EP ranks)
                assert _tables.parse_key(b) <= point["tokens"]


# ---------------------------------------------------------------------------------------------
# Tuner
# ---------------------------------------------------------------------------------------------


def test_shape_for_per_rank_sizes():
    from moekit.tune import shape_for

    s = shape_for("deepseek-v3", tp_size=8, ep_size=8)
    assert (s.num_experts, s.top_k, s.hidden, s.intermediate) == (32, 8, 7168, 2048)
    assert s.local_share == 0.125 and s.routed_experts == 256 and "local 0.125" in s.describe()
    s = shape_for("mixtral-8x7b", tp_size=2)
    assert (s.num_experts, s.top_k, s.intermediate) == (8, 2, 7168)
    assert s.local_share == 1 and s.routed_experts == 8
    s = shape_for("gpt-oss-120b")
    assert s.act.name == "swiglu_oai" and s.act.interleaved and s.has_bias
    with pytest.raises(ConfigError, match="--ep-size"):
        shape_for("qwen3-30b-a3b", tp_size=4, ep_size=3)
    with pytest.raises(ConfigError, match="--model"):
        shape_for("no-such-model")
    with pytest.raises(ConfigError, match="--dtype"):
        shape_for("qwen3-30b-a3b", dtype="int8")


@pytest.mark.parametrize("rows", [1, 20, 100, 2000])
def test_search_space_is_valid_and_bounded(rows):
    from moekit.tune import schedule_variants, tile_candidates

    for gemm, n, k in (("gate_up", 1536, 2048), ("down", 2048, 768)):
        tiles = tile_candidates(gemm, rows, n, k)
        assert 1 <= len(tiles) <= 40 and len(set(tiles)) == len(tiles)
        assert len(schedule_variants(gemm, tiles[0], n, k)) <= 8


def test_pending_batch_sizes_resume(tmp_path):
    from moekit.tune import pending_batch_sizes

    keys = {g: TableKey(g, 8, 64, 32, "float32", "cpu", "3.6.0") for g in ("gate_up", "down")}
    paths = {g: tmp_path / k.filename() for g, k in keys.items()}
    assert pending_batch_sizes(paths, [1, 4, 16], False) == [1, 4, 16]
    tc.write_table(paths["gate_up"], keys["gate_up"], {1: GemmConfig(), 4: GemmConfig()}, {})
    tc.write_table(paths["down"], keys["down"], {1: GemmConfig()}, {})
    assert pending_batch_sizes(paths, [1, 4, 16], False) == [4, 16]
    assert pending_batch_sizes(paths, [1, 4, 16], True) == [1, 4, 16]
    # an EP shape's T = 8 and 32 are stored under 1 and 4 (local share 1/8)
    assert pending_batch_sizes(paths, [8, 32], False, local_share=0.125) == [32]


def test_cli_rejects_bad_arguments(capsys):
    from moekit.cli.tune import main

    assert main(["--model", "no-such-model"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["--model", "qwen3-30b-a3b", "--batch-sizes", "1,x"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
def test_tiny_tune_writes_tables_and_resumes(tmp_path):
    pytest.importorskip("triton")
    from moekit.bench import Ceilings
    from moekit.tune import TuneShape, tune

    shape = TuneShape(4, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny")
    ceilings = Ceilings(1e10, 1e11, "float32")
    report = tune(
        shape, [3], out_dir=tmp_path, device="cpu", progress=False, limit=1, ceilings=ceilings
    )
    assert [r.num_tokens for r in report.results] == [3]
    assert report.results[0].rel_err < 1e-4
    for path in report.paths.values():
        table = tc.read_table(Path(path))
        assert list(table.configs) == [3]
        meta = json.loads(Path(path).read_text())["meta"]
        assert meta["points"]["3"]["floor_us"] > 0
    again = tune(shape, [3], out_dir=tmp_path, device="cpu", progress=False, limit=1)
    assert again.skipped == [3] and not again.results


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
def test_ep_tune_routes_over_all_experts_and_keys_by_local_tokens(tmp_path):
    pytest.importorskip("triton")
    from moekit.bench import Ceilings
    from moekit.tune import TuneShape, _Point, random_weights, tune

    shape = TuneShape(4, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny ep4",
                      local_share=0.25)  # fmt: skip
    w = random_weights(shape, "cpu")
    p = _Point(shape, w, 64, "cpu", seed=1)
    ids = p.topks[0].ids
    assert ids.dtype == torch.int32 and int(ids.max()) < 4
    assert 0.1 < float((ids >= 0).float().mean()) < 0.45  # about a quarter of the pairs local
    report = tune(shape, [2], out_dir=tmp_path, device="cpu", progress=False, limit=1,
                  ceilings=Ceilings(1e10, 1e11, "float32"))  # fmt: skip
    assert [r.num_tokens for r in report.results] == [2]
    for path in report.paths.values():
        assert list(tc.read_table(Path(path)).configs) == [0.5]
        assert json.loads(Path(path).read_text())["meta"]["points"]["0.5"]["tokens"] == 2
    with pytest.raises(ConfigError, match="local_share"):
        TuneShape(4, 2, 32, 24, local_share=0)


def test_tune_points_draw_the_bench_zipf_routing_and_reject_unknown_ones():
    from moekit.sweep import make_routing
    from moekit.tune import TuneShape, _Point, random_weights

    shape = TuneShape(8, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny ep2",
                      local_share=0.5)  # fmt: skip
    w = random_weights(shape, "cpu")
    p = _Point(shape, w, 256, "cpu", seed=3, routing="zipf")
    drawn = make_routing(256, 16, 2, routing="zipf", generator=torch.Generator().manual_seed(3))
    ids = p.topks[0].ids
    # the bench's draw over all 16 experts; the other rank's 8 are masked on this one
    assert torch.equal(ids, torch.where(drawn.ids < 8, drawn.ids, -1))
    assert torch.equal(p.topks[0].weights, drawn.weights)
    counts = torch.bincount(drawn.ids.flatten().long(), minlength=16)
    assert int(counts.max()) > 4 * int(counts.median())  # skewed, not uniform
    with pytest.raises(ConfigError, match="--routing.*allowed: uniform, zipf"):
        _Point(shape, w, 4, "cpu", seed=0, routing="hot")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
@pytest.mark.parametrize("faster", ["incumbent", "tuned"])
def test_tune_keeps_the_faster_of_the_tuned_pair_and_the_incumbent(tmp_path, monkeypatch, faster):
    """A re-tune replaces the pair the runner ran before only if the layer, timed in turns with
    both, is faster with the tuned one; the table's meta says which was kept."""
    pytest.importorskip("triton")
    import moekit.tune as tune_mod
    from moekit.bench import Ceilings

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))  # the runner's user tables
    shape = tune_mod.TuneShape(4, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny")
    incumbent = GemmConfig(16, 16, 16, 1, 4, 2)  # not what the search tries first
    keys = tune_mod.table_keys(shape, "cpu")
    for key in keys.values():
        tc.write_table(tmp_path / "triton" / key.filename(), key, {3: incumbent}, {})
    timed = []

    def in_turns(fns, device, R):
        timed.append(sorted(fns))
        return {"tuned": 2.0, "incumbent": 1.0} if faster == "incumbent" else {
            "tuned": 1.0, "incumbent": 2.0}  # fmt: skip

    monkeypatch.setattr(tune_mod, "_layers_in_turns", in_turns)
    report = tune_mod.tune(shape, [3], out_dir=tmp_path / "triton", device="cpu", progress=False,
                           limit=1, force=True, ceilings=Ceilings(1e10, 1e11, "float32"))  # fmt: skip
    r = report.results[0]
    assert timed == [["incumbent", "tuned"]]
    assert r.confirm["kept"] == faster
    assert r.confirm["pairs"]["incumbent"] == [incumbent.code()] * 2
    tuned = [GemmConfig.from_code(c) for c in r.confirm["pairs"]["tuned"]]
    assert tuned != [incumbent, incumbent]
    stored = {g: tc.read_table(Path(p)).configs[3] for g, p in report.paths.items()}
    assert [stored["gate_up"], stored["down"]] == ([incumbent] * 2 if faster == "incumbent"
                                                   else tuned)  # fmt: skip
    meta = json.loads(Path(report.paths["down"]).read_text())["meta"]["points"]["3"]
    assert meta["confirm"]["kept"] == faster and meta["rel_err"] < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
def test_tune_skips_the_turns_when_the_search_finds_the_incumbent(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    import moekit.tune as tune_mod
    from moekit.bench import Ceilings

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    shape = tune_mod.TuneShape(4, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny")
    keys = tune_mod.table_keys(shape, "cpu")
    first = {"gate_up": tune_mod.tile_candidates("gate_up", 1.5, 48, 32)[0],
             "down": tune_mod.tile_candidates("down", 1.5, 32, 24)[0]}  # fmt: skip
    for gemm, key in keys.items():  # the incumbent is the pair the one-candidate search picks
        tc.write_table(tmp_path / "triton" / key.filename(), key, {3: first[gemm]}, {})
    monkeypatch.setattr(tune_mod, "_layers_in_turns", lambda *a: pytest.fail("timed in turns"))
    report = tune_mod.tune(shape, [3], out_dir=tmp_path / "triton", device="cpu", progress=False,
                           limit=1, force=True, ceilings=Ceilings(1e10, 1e11, "float32"))  # fmt: skip
    assert report.results[0].confirm is None


def test_near_ties_are_the_configs_within_near_tie_of_the_fastest():
    from moekit.tune import NEAR_TIE, NEAR_TIE_MAX, near_ties

    a, b, c, d = (GemmConfig(16, n) for n in (16, 32, 64, 128))
    tried = {a.code(): 10.0, b.code(): 10.0 * NEAR_TIE, c.code(): 10.0 * NEAR_TIE + 0.01,
             d.code(): "OutOfResources: shared memory"}  # fmt: skip
    assert near_ties(tried) == [a, b]
    assert near_ties({**tried, b.code(): 9.9}) == [b, a][:NEAR_TIE_MAX]
    assert near_ties({**tried, b.code(): 10.0, c.code(): 10.0}) == [a, b, c][:NEAR_TIE_MAX]
    assert near_ties({d.code(): "error"}) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
@pytest.mark.parametrize("layer_prefers", ["tuned", "tie 1", "incumbent"])
def test_confirm_keeps_the_fastest_layer_of_tuned_ties_and_incumbent(monkeypatch, layer_prefers):
    """The GEMMs are timed alone; among the tuned pair, pairs of configs that tie with it alone
    and the incumbent, the layer timed in turns decides (a tie first by name: the tuned pair)."""
    import moekit.tune as tune_mod

    shape = tune_mod.TuneShape(4, 2, 32, 24, "float32", ActivationSpec("silu"), False, "tiny")
    w = tune_mod.random_weights(shape, "cpu")
    p = tune_mod._Point(shape, w, 3, "cpu", seed=0)
    g, d, d2, old = (GemmConfig(16, n) for n in (16, 32, 64, 128))
    us = {"tuned": 2.0, "tie 1": 2.0, "incumbent": 2.0}
    us[layer_prefers] = 1.0
    monkeypatch.setattr(tune_mod, "_layers_in_turns",
                        lambda fns, device, R: {n: us[n] for n in fns})  # fmt: skip
    pairs = {"tuned": (g, d), "tie 1": (g, d2), "incumbent": (old, old)}
    kept, info = tune_mod._confirm(p, w, (g, d), [(g, d2), (g, d)], (old, old))
    assert kept == pairs[layer_prefers] and info["kept"] == layer_prefers
    assert info["pairs"] == {n: [c.code() for c in pair] for n, pair in pairs.items()}
    monkeypatch.setattr(tune_mod, "_layers_in_turns", lambda *a: pytest.fail("timed in turns"))
    assert tune_mod._confirm(p, w, (g, d), [], (g, d)) == ((g, d), None)


def test_config_code_round_trips():
    """`GemmConfig.code` (how `moekit tune` logs configs and probes take them) and its parse."""
    for c in (GemmConfig(), GemmConfig(1, 16, 256), GemmConfig(16, 64, 128, 1, 4, 5, True, "atomic",
                                                              True, 4),
              GemmConfig(128, fold_rows=32), GemmConfig(128, fold_rows=0)):  # fmt: skip
        assert GemmConfig.from_code(c.code()) == c
        assert GemmConfig.from_dict(c.to_dict()) == c
    assert "fold_rows" not in GemmConfig().to_dict()  # tables that leave it unset stay as they were
    with pytest.raises(ValueError, match="fold_rows"):
        GemmConfig(fold_rows=-16)
    atomic_tma = GemmConfig(64, 128, 64, 8, 4, 3, reduce="atomic", tma=True)
    assert atomic_tma.code() == "m64n128k64g8w4s3AM"
    with pytest.raises(ValueError, match="bad config code"):
        GemmConfig.from_code("m64n128k64g8w4s3TAx4")


def test_shipped_mixtral_tp2_table_folds_32_rows_at_1024_tokens():
    """The H100 bf16 table of mixtral-8x7b TP2 sets fold_rows 32 at T = 1024 (256 +- 16 rows an
    expert), both GEMMs, and leaves the pipeline's 16 at T = 4096 (where 32 lost)."""
    dev = "NVIDIA H100 80GB HBM3"
    for gemm in ("gate_up", "down"):
        assert tc.get_config(gemm, 1024, 2, 8, 4096, 7168, "bfloat16", dev).fold_rows == 32
        assert tc.get_config(gemm, 4096, 2, 8, 4096, 7168, "bfloat16", dev).fold_rows is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter run")
@pytest.mark.parametrize("fmt", ["fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor",
                                 "int8_w8a8"])  # fmt: skip
def test_tiny_tune_of_a_w8a8_format(tmp_path, fmt):
    """`tune(quantization=...)` times and checks a w8a8 format (static fp8 scales calibrated for
    its N(0, 1) inputs) and keys the tables by the format."""
    pytest.importorskip("triton")
    from moekit.bench import Ceilings
    from moekit.tune import TuneShape, tune

    shape = TuneShape(4, 2, 128, 128, "float16", ActivationSpec("silu"), False, "tiny w8a8")
    sizes = [3, 9]  # direct rows, and sorted ones (above PIPELINE.direct_max_tokens)
    report = tune(shape, sizes, out_dir=tmp_path, device="cpu", progress=False, limit=1,
                  ceilings=Ceilings(1e10, 1e11, "float16"), quantization=fmt)  # fmt: skip
    assert [r.num_tokens for r in report.results] == sizes
    assert all(r.rel_err < 3e-2 for r in report.results)
    tag = "fp8_w8a8-tensor-static_tensor" if fmt.startswith("fp8") else "int8_w8a8"
    assert all(f"quant={tag}," in Path(p).name for p in report.paths.values())
