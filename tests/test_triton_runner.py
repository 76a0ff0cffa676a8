"""The triton runner against the torch reference: CPU through the Triton interpreter (float32 /
float16, tiny shapes), GPU (marked) in bfloat16 on the preset shapes and under CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch

pytest.importorskip("triton")

from helpers import TOLERANCE, capture_graph, make_topk, make_weights, rel_err  # noqa: E402

from moekit.experts import ActivationSpec, ExpertWeights  # noqa: E402
from moekit.hardware import Platform  # noqa: E402
from moekit.router import TopKOutput  # noqa: E402
from moekit.runners.base import RunnerError  # noqa: E402
from moekit.runners.registry import runner_class  # noqa: E402
from moekit.runners.torch import moe_reference_fp64, run_masked, run_standard  # noqa: E402
from moekit.runners.triton import TritonRunner, ops  # noqa: E402
from moekit.runners.triton.configs import GemmConfig  # noqa: E402
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@dataclass(frozen=True)
class Case:
    name: str
    T: int = 7
    K: int = 2
    E: int = 5
    H: int = 48
    I: int = 40
    act: str = "silu"
    interleaved: bool = False
    bias: bool = False
    dtype: torch.dtype = torch.float32
    masked: float = 0.0
    one_expert: bool = False
    configs: tuple[GemmConfig, GemmConfig] | None = None


SWAP = (GemmConfig(16, 16, 16, swap_ab=True), GemmConfig(16, 32, 32, swap_ab=True))
ATOMIC = (GemmConfig(16, 32, 32), GemmConfig(32, 16, 16, reduce="atomic"))
MIXED_BM = (GemmConfig(32, 16, 32, group_m=2), GemmConfig(16, 16, 16, group_m=1))

TMA = (GemmConfig(16, 16, 16, tma=True), GemmConfig(16, 16, 16, tma=True, reduce="atomic"))
TMA_SWAP = (GemmConfig(32, 16, 32, tma=True, swap_ab=True), GemmConfig(16, 32, 16, tma=True))
# split-K down: 2 shares of 3 K steps of 16 (I = 48 below), 8 shares of ceil(3 / 8) = 1 step
# (five programs of each tile get no step and add zeros)
SPLIT_K = (GemmConfig(16, 16, 16), GemmConfig(16, 32, 16, reduce="atomic", split_k=2))
SPLIT_K8_TMA = (GemmConfig(16, 16, 16), GemmConfig(16, 16, 16, reduce="atomic", split_k=8,
                                                    tma=True, swap_ab=True))

# split-K gate_up: float32 sums per share (2 shares of 3 K steps of 16, H = 48 below; 4 shares of
# ceil(4 / 4) = 1 step, H = 64), added up and activated by the last program of each tile
SPLIT_GATE_UP = (GemmConfig(16, 16, 16, split_k=2), GemmConfig(16, 32, 16))
SPLIT_GATE_UP4_TMA = (GemmConfig(16, 16, 16, split_k=4, tma=True, swap_ab=True),
                      GemmConfig(16, 16, 16, reduce="atomic", split_k=2, tma=True))  # fmt: skip

# one pair per program, products summed on the CUDA cores (block_m 1): alone (alignment blocks of
# one row), beside a 16-row GEMM (rows of 16-row blocks), with TMA, atomics and split-K
ROW1 = (GemmConfig(1, 16, 16), GemmConfig(1, 32, 32))
ROW1_MIXED_TMA = (GemmConfig(1, 16, 32, tma=True), GemmConfig(16, 16, 16, reduce="atomic", tma=True))
ROW1_SPLIT = (GemmConfig(1, 32, 16, split_k=2), GemmConfig(1, 16, 16, reduce="atomic", split_k=4,
                                                           tma=True))  # fmt: skip

CASES = [
    Case("T0", T=0),
    Case("T1", T=1),
    Case("silu"),
    Case("gelu-interleaved", act="gelu", interleaved=True),
    Case("swiglu_oai-bias-interleaved", act="swiglu_oai", interleaved=True, bias=True),
    Case("swiglu_oai-bias", act="swiglu_oai", bias=True, K=3, E=7),
    Case("masked-ids", masked=0.3, T=9),
    Case("one-expert", one_expert=True, T=6, K=1),
    Case("fp16", dtype=torch.float16, bias=True, act="gelu"),
    Case("swap-ab", configs=SWAP, T=5, E=6),
    Case("atomic-reduce", configs=ATOMIC, masked=0.2, bias=True, dtype=torch.float16),
    Case("gate_up-bm-larger", configs=MIXED_BM, T=11, H=40, I=24),
    Case("T1-direct-atomic-bias", T=1, K=3, configs=ATOMIC, bias=True, act="gelu"),
    Case("T1-direct-masked-id", T=1, K=3, masked=0.5, dtype=torch.float16),
    Case("tma", configs=TMA, T=9, H=64, I=48, masked=0.2, bias=True),
    Case("tma-swap-interleaved", configs=TMA_SWAP, T=6, H=64, I=40, act="swiglu_oai",
         interleaved=True, bias=True, dtype=torch.float16),  # fmt: skip
    Case("split-k-bias", configs=SPLIT_K, T=9, H=40, I=48, masked=0.2, bias=True),
    Case("T1-split-k8-tma", configs=SPLIT_K8_TMA, T=1, K=3, H=64, I=48, bias=True,
         dtype=torch.float16),  # fmt: skip
    Case("split-gate_up-bias", configs=SPLIT_GATE_UP, T=9, H=48, I=40, masked=0.2, bias=True,
         act="gelu"),  # fmt: skip
    Case("T1-split-gate_up4-oai", configs=SPLIT_GATE_UP4_TMA, T=1, K=3, H=64, I=48, bias=True,
         act="swiglu_oai", interleaved=True, dtype=torch.float16),  # fmt: skip
    Case("row1", configs=ROW1, T=9, masked=0.2, bias=True),
    Case("T1-row1-oai-interleaved", configs=ROW1, T=1, K=3, act="swiglu_oai", interleaved=True,
         bias=True, dtype=torch.float16),  # fmt: skip
    Case("row1-mixed-tma", configs=ROW1_MIXED_TMA, T=7, H=64, I=48, act="gelu", one_expert=True),
    Case("row1-split", configs=ROW1_SPLIT, T=6, H=64, I=48, bias=True, masked=0.3),
    Case("split-gate_up-oai", configs=SPLIT_GATE_UP, T=10, H=48, I=40, masked=0.3, bias=True,
         act="swiglu_oai", one_expert=True),  # fmt: skip    # routing widths of models `--model` can name by their config.json: 512 experts, 10 a token
    # (Qwen3-Next), 384 (Kimi-K2), one a token (Llama 4)
    Case("E512-K10", E=512, K=10, T=13, H=32, I=32),
    Case("E384-K8-masked", E=384, K=8, T=9, H=32, I=32, masked=0.2),
    Case("K1", K=1, E=16, T=21),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_standard_matches_reference(case: Case):
    w = make_weights(case.E, case.H, case.I, case.dtype, case.bias)
    act = ActivationSpec(case.act, case.interleaved)
    x = torch.randn(case.T, case.H, device=DEVICE, dtype=case.dtype)
    topk = make_topk(case.T, case.K, case.E, case.masked, case.one_expert)
    if case.configs is None:
        out = TritonRunner().run(StandardDispatchOutput(x, topk), w, act).out
    else:
        out = ops.fused_moe(x, topk, w, act, configs=case.configs)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = moe_reference_fp64(x, topk, w, act)
    assert rel_err(out, ref) < TOLERANCE[case.dtype]
    if case.T:  # same function as the torch runner, not only close to fp64
        assert rel_err(out, run_standard(x, topk, w, act)) < TOLERANCE[case.dtype]


# direct rows (no alignment) above one token: an expert's pairs gathered into the block of its
# first pair, 16 at a time (one expert taking 20 pairs: two groups), or one pair per block
DIRECT_CASES = [
    Case("direct-repeats", T=9, K=3, E=4, masked=0.2, bias=True),
    Case("direct-one-expert-20", T=20, K=1, one_expert=True, configs=ATOMIC),
    Case("direct-tma-oai", configs=TMA, T=6, H=64, I=48, E=3, act="swiglu_oai", interleaved=True,
         bias=True, dtype=torch.float16),  # fmt: skip
    Case("direct-row1", configs=ROW1, T=7, K=2, E=3, masked=0.2),
    Case("direct-split", configs=SPLIT_GATE_UP4_TMA, T=5, K=3, E=4, H=64, I=48, bias=True,
         act="swiglu_oai", interleaved=True),  # fmt: skip
]


@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: c.name)
def test_direct_rows_match_reference(case: Case, monkeypatch):
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, direct_max_tokens=32))
    test_standard_matches_reference(case)


def masked_reference(x_ECH, counts, w: ExpertWeights, act):
    to64 = {n: (None if t is None else t.double()) for n, t in vars(w).items()
            if isinstance(t, torch.Tensor) or t is None}  # fmt: skip
    w64 = ExpertWeights(to64["w13"], to64["w2"], to64["b13"], to64["b2"])
    return run_masked(x_ECH.double(), counts, w64, act)


@pytest.mark.parametrize("reduce", ["atomic", "kernel"])
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("T", [50, 130])
def test_tail_blocks_match_reference(levels, T, reduce):
    """Blocks of both GEMMs whose valid rows fit in block_m / 2^j (j <= tail_levels) multiply
    only those rows; with experts of 8-90 rows in 64-row blocks, blocks take each path."""
    E, K, H, I = 3, 2, 48, 40
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    w = make_weights(E, H, I, dtype, True)
    act = ActivationSpec("silu")
    x = torch.randn(T, H, device=DEVICE, dtype=dtype)
    topk = make_topk(T, K, E, masked=0.1)
    configs = (GemmConfig(64, 16, 16), GemmConfig(64, 32, 16, reduce=reduce))
    pipe = replace(ops.PIPELINE, tail_levels=levels, few_blocks_tail_levels=levels)
    with mock.patch.object(ops, "PIPELINE", pipe):
        out = ops.fused_moe(x, topk, w, act, configs=configs)
    assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[dtype]


def _routing_with_counts(counts: list[int], K: int, masked: int = 0) -> TopKOutput:
    """Routing in which expert e gets exactly counts[e] pairs (sum(counts) + masked = T * K,
    K distinct experts a token where the counts allow), `masked` ids of -1, in shuffled order."""
    pairs = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]
                      + [torch.full((masked,), -1, dtype=torch.int32)])  # fmt: skip
    T = pairs.numel() // K
    assert T * K == pairs.numel()
    ids = pairs.view(K, T).t().contiguous()  # pair j of expert e goes to token j % T, slot j // T
    ids = ids[torch.randperm(T)].to(DEVICE)
    weights = torch.rand(T, K, device=DEVICE) + 0.1
    return TopKOutput((weights / weights.sum(1, keepdim=True)).contiguous(), ids)


# experts with a last block of 1..side rows after full ones (folded), with side + 1 (not folded:
# the tail path), with only a short block (nothing to fold into), unused; side = fold_rows
# (levels: fold_rows / 2^j down to 16)
FOLD_CASES = [
    ("atomic-levels", (32, 2), "silu", False,
     (GemmConfig(64, 16, 16), GemmConfig(64, 32, 16, reduce="atomic"))),
    ("atomic", (16, 1), "silu", False,
     (GemmConfig(64, 16, 16), GemmConfig(64, 32, 16, reduce="atomic"))),
    ("kernel-oai", (16, 1), "swiglu_oai", True, (GemmConfig(64, 16, 16), GemmConfig(64, 16, 16))),
    ("tma-mixed-bm", (16, 2), "gelu", False, (GemmConfig(32, 16, 16, tma=True),
                                              GemmConfig(64, 16, 16, tma=True, reduce="atomic"))),
    # the pipeline's 16 rows replaced by the configs' 32 (GemmConfig.fold_rows)
    ("config-32", (16, 1), "silu", False,
     (GemmConfig(64, 16, 16, fold_rows=32), GemmConfig(64, 32, 16, reduce="atomic", fold_rows=32))),
]


@pytest.mark.parametrize("name,fold,act_name,interleaved,configs", FOLD_CASES,
                         ids=[c[0] for c in FOLD_CASES])  # fmt: skip
def test_folded_tails_match_reference(name, fold, act_name, interleaved, configs):
    """A short last block folded into the full block before it (`PipelineConfig.fold_rows`,
    `.fold_levels`), in both GEMMs: every pair computed once (atomic reduction: a pair computed
    twice counts twice)."""
    E, K, H, I = 6, 2, 64, 48
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    bm = max(c.block_m for c in configs)
    side = configs[0].fold_rows or fold[0]
    counts = [bm + 3, 2 * bm + side, bm + side + 1, side - 2, 0, 2 * bm + 1]
    masked = (-sum(counts)) % K + K
    topk = _routing_with_counts(counts, K, masked)
    T = topk.ids.shape[0]
    w = make_weights(E, H, I, dtype, True)
    act = ActivationSpec(act_name, interleaved)
    x = torch.randn(T, H, device=DEVICE, dtype=dtype)
    folds = []
    fold_meta = ops._fold_meta

    def spy(gemm, *args):
        folds.append((gemm, fold_meta(gemm, *args)))
        return folds[-1][1]

    pipe = replace(ops.PIPELINE, fold_rows=fold[0], fold_levels=fold[1])
    with mock.patch.object(ops, "PIPELINE", pipe), mock.patch.object(ops, "_fold_meta", spy):
        out = ops.fused_moe(x, topk, w, act, configs=configs)
    assert [(g, meta["FOLD"]) for g, meta in folds if meta] == [("gate_up", side), ("down", side)]
    assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[dtype]


def test_fold_meta_conditions():
    """FOLD with fold_rows set (16 or more, under block_m), for sorted rows, unquantized weights,
    one K share, unswapped, experts of at least a block, the GEMMs in fold_gemms; levels down
    to 16 rows."""
    from types import SimpleNamespace

    sorted_rows = SimpleNamespace(mode=0, rows_per_expert=300.0)
    cfg = GemmConfig(128, 64, 64)
    with mock.patch.object(ops, "PIPELINE", replace(ops.PIPELINE, fold_rows=0)):
        assert ops._fold_meta("gate_up", cfg, sorted_rows, None) == {}
    pipe = replace(ops.PIPELINE, fold_rows=32, fold_levels=3, fold_gemms=("down",))
    with mock.patch.object(ops, "PIPELINE", pipe):
        assert ops._fold_meta("down", cfg, sorted_rows, None) == {"FOLD": 32, "FOLD_LEVELS": 2}
        assert ops._fold_meta("gate_up", cfg, sorted_rows, None) == {}
        assert ops._fold_meta("down", GemmConfig(32, 64, 64), sorted_rows, None) == {}
        assert ops._fold_meta("down", replace(cfg, swap_ab=True), sorted_rows, None) == {}
        assert ops._fold_meta("down", replace(cfg, split_k=2, reduce="atomic"), sorted_rows,
                              None) == {}  # fmt: skip
        assert ops._fold_meta("down", cfg, sorted_rows, SimpleNamespace(quant=3)) == {}
        assert ops._fold_meta("down", cfg, SimpleNamespace(mode=2, rows_per_expert=300.0),
                              None) == {}  # fmt: skip
        assert ops._fold_meta("down", cfg, SimpleNamespace(mode=0, rows_per_expert=100.0),
                              None) == {}  # fmt: skip
        assert ops._fold_meta("down", cfg, SimpleNamespace(mode=0, rows_per_expert=None),
                              None) == {"FOLD": 32, "FOLD_LEVELS": 2}  # fmt: skip
    with mock.patch.object(ops, "PIPELINE", replace(ops.PIPELINE, fold_rows=8)):
        assert ops._fold_meta("down", cfg, sorted_rows, None) == {}
    # as shipped: 16 rows, one level; a config's fold_rows replaces that, but not when the
    # pipeline turns folding off
    assert ops._fold_meta("gate_up", GemmConfig(64, 64, 64), sorted_rows, None) == {
        "FOLD": 16, "FOLD_LEVELS": 1}  # fmt: skip
    assert ops._fold_meta("gate_up", replace(cfg, fold_rows=32), sorted_rows, None) == {
        "FOLD": 32, "FOLD_LEVELS": 1}  # fmt: skip
    assert ops._fold_meta("gate_up", replace(cfg, fold_rows=0), sorted_rows, None) == {}
    with mock.patch.object(ops, "PIPELINE", replace(ops.PIPELINE, fold_rows=0)):
        assert ops._fold_meta("gate_up", replace(cfg, fold_rows=32), sorted_rows, None) == {}


def test_tail_levels_follow_the_blocks_per_expert():
    """More tail levels where a used expert gets few blocks; sorted rows of the GEMMs in
    tail_gemms only, not w8a8, down to 16 rows."""
    from types import SimpleNamespace

    pipe = replace(ops.PIPELINE, tail_levels=1, few_blocks_tail_levels=2, few_blocks=2.0,
                   tail_gemms=("down",))  # fmt: skip
    few, many = (SimpleNamespace(mode=0, rows_per_expert=r) for r in (256.0, 257.0))
    unknown = SimpleNamespace(mode=0, rows_per_expert=None)
    direct = SimpleNamespace(mode=2, rows_per_expert=1.0)
    w8a8 = SimpleNamespace(quant=1)
    cfg = GemmConfig(128, 64, 64)
    with mock.patch.object(ops, "PIPELINE", pipe):
        assert ops._tail_meta("down", cfg, few, None) == {"TAIL_LEVELS": 2}
        assert ops._tail_meta("down", cfg, many, None) == {"TAIL_LEVELS": 1}
        assert ops._tail_meta("down", cfg, unknown, None) == {"TAIL_LEVELS": 1}
        assert ops._tail_meta("down", GemmConfig(32, 64, 64), few, None) == {"TAIL_LEVELS": 1}
        assert ops._tail_meta("down", GemmConfig(16, 64, 64), few, None) == {}
        assert ops._tail_meta("down", cfg, direct, None) == {}
        assert ops._tail_meta("down", cfg, few, w8a8) == {}
        assert ops._tail_meta("gate_up", cfg, few, None) == {}
    # uniform routing: T * K pairs over the experts they use
    assert ops.rows_per_expert(4096, 8, 128) == pytest.approx(256, rel=1e-6)
    assert ops.rows_per_expert(1, 8, 128) == pytest.approx(8 / (128 * (1 - (127 / 128) ** 8)))
    assert ops.rows_per_expert(3, 2, 1) == 6


@pytest.mark.parametrize(
    "act,bias,dtype",
    [("silu", False, torch.float32), ("swiglu_oai", True, torch.float16)],
)
def test_masked_matches_reference(act, bias, dtype):
    E, C, H, I = 3, 20, 40, 24
    w = make_weights(E, H, I, dtype, bias)
    spec = ActivationSpec(act, interleaved=bias)
    x = torch.randn(E, C, H, device=DEVICE, dtype=dtype)
    counts = torch.tensor([0, 17, 25], dtype=torch.int32, device=DEVICE)  # empty, partial, > C
    out = TritonRunner().run(MaskedDispatchOutput(x, counts), w, spec).out
    assert out.shape == x.shape
    ref = masked_reference(x, counts, w, spec)
    valid = torch.arange(C, device=DEVICE)[None, :] < counts.clamp(max=C)[:, None]
    assert rel_err(out[valid], ref[valid]) < TOLERANCE[dtype]


def test_masked_runs_split_k_configs_unsplit():
    """The masked format stores rows (no atomics): a split-K down config runs unsplit there."""
    E, C, H, I = 3, 16, 40, 48
    w = make_weights(E, H, I, torch.float32, True)
    x = torch.randn(E, C, H, device=DEVICE)
    counts = torch.tensor([5, 16, 0], dtype=torch.int32, device=DEVICE)
    act = ActivationSpec()
    split = ops.fused_moe_masked(x, counts, w, act, configs=SPLIT_K)
    plain = ops.fused_moe_masked(x, counts, w, act,
                                 configs=(SPLIT_K[0], replace(SPLIT_K[1], split_k=1)))  # fmt: skip
    valid = torch.arange(C, device=DEVICE)[None, :] < counts[:, None]
    assert torch.equal(split[valid], plain[valid])
    assert rel_err(split[valid], masked_reference(x, counts, w, act)[valid]) < TOLERANCE[torch.float32]


def test_masked_split_gate_up():
    """The masked format with a split gate_up."""
    E, C, H, I = 3, 16, 48, 40
    w = make_weights(E, H, I, torch.float32, True)
    x = torch.randn(E, C, H, device=DEVICE)
    counts = torch.tensor([5, 16, 0], dtype=torch.int32, device=DEVICE)
    act = ActivationSpec("swiglu_oai")
    out = ops.fused_moe_masked(x, counts, w, act, configs=SPLIT_GATE_UP)
    valid = torch.arange(C, device=DEVICE)[None, :] < counts[:, None]
    assert rel_err(out[valid], masked_reference(x, counts, w, act)[valid]) < TOLERANCE[torch.float32]


def test_split_gate_up_leaves_counts_zeroed():
    """The arrival counts of a split gate_up are kept between calls: every launch must leave
    them at zero (a second call with other inputs is as exact as the first)."""
    w = make_weights(4, 48, 40, torch.float32, False)
    act = ActivationSpec()
    for T in (9, 5):
        x = torch.randn(T, 48, device=DEVICE)
        topk = make_topk(T, 2, 4)
        out = ops.fused_moe(x, topk, w, act, configs=SPLIT_GATE_UP)
        assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[torch.float32]
        counts = ops.split_counts(x.device, 1)  # the buffer that call used
        assert counts.numel() >= 1 << 14 and not counts.any()


def test_split_down_needs_atomic():
    w = make_weights(2, 32, 16, torch.float32, False)
    x = torch.randn(3, 32, device=DEVICE)
    cfgs = (GemmConfig(16), GemmConfig(16, split_k=2))
    with pytest.raises(ValueError, match="split_k=2 needs reduce='atomic'"):
        ops.fused_moe(x, make_topk(3, 2, 2), w, ActivationSpec(), configs=cfgs)


def test_masked_empty_capacity():
    w = make_weights(2, 32, 16, torch.float32, False)
    x = torch.randn(2, 0, 32, device=DEVICE)
    counts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = ops.fused_moe_masked(x, counts, w, ActivationSpec())
    assert out.shape == (2, 0, 32)


def test_registered_and_caps():
    assert runner_class("triton") is TritonRunner
    caps = TritonRunner.caps
    assert caps.cuda_graph and caps.formats == {"standard", "masked"}
    assert caps.activations == {"silu", "gelu", "swiglu_oai"}
    assert caps.weight_formats == set(ops.SUPPORTED_FORMATS)  # quantized: test_triton_quant.py


def test_refuses_what_it_cannot_run():
    why = TritonRunner.unsupported("standard", "unquantized", "silu", "bfloat16", "cpu", False)
    if ON_GPU:  # no interpreter there (conftest sets it only without a GPU): no cpu at all
        assert why and "'cpu'" in why
    else:
        assert why and "float16" in why and "interpreter" in why
    why = TritonRunner.unsupported("standard", "int2_w2a16", "silu", "float16", "cuda", False)
    assert why and "unquantized" in why
    w = make_weights(2, 32, 16, torch.float32, False)
    w.format = "int2_w2a16"
    x = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(RunnerError, match="weight format"):
        TritonRunner().run(StandardDispatchOutput(x, make_topk(3, 1, 2)), w, ActivationSpec())


def test_availability_says_why():
    no_triton = Platform("cuda", "gpu", (9, 0), 1, {"triton": None})
    assert "triton" in TritonRunner.availability(no_triton).reason
    old_gpu = Platform("cuda", "gpu", (7, 0), 1, {"triton": "3.6.0"})
    assert not TritonRunner.availability(old_gpu)
    assert TritonRunner.availability(Platform("cuda", "H100", (9, 0), 1, {"triton": "3.6.0"}))
    cpu = Platform("cpu", "cpu", None, 0, {"triton": "3.6.0"})
    assert bool(TritonRunner.availability(cpu)) == (not ON_GPU)  # conftest interprets on CPU


def test_bad_shapes_are_refused():
    w = make_weights(2, 32, 16, torch.float32, False)
    x = torch.randn(3, 24, device=DEVICE)
    with pytest.raises(ValueError, match="hidden size"):
        ops.fused_moe(x, make_topk(3, 1, 2), w, ActivationSpec())
    with pytest.raises(ValueError, match="activation"):
        ops.fused_moe(torch.randn(3, 32, device=DEVICE), make_topk(3, 1, 2), w,
                      ActivationSpec("relu"))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

PRESET_SHAPES = [
    ("qwen3-30b-a3b", 1, 1),
    ("mixtral-8x7b", 2, 1),
    ("deepseek-v3", 8, 8),
    ("gpt-oss-120b", 1, 1),
]


def reference_fp32_sparse(x, topk: TopKOutput, w: ExpertWeights, act):
    """Float32 reference (no TF32) that converts only the experts in use: preset weights are
    too large for float64; float32 is ~1e-6 accurate, far below the bf16 tolerance."""
    used = torch.unique(topk.ids[topk.ids >= 0]).long()
    remap = torch.full((w.num_experts,), -1, dtype=torch.int32, device=x.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=x.device)
    ids = torch.where(topk.ids >= 0, remap[topk.ids.long().clamp(min=0)], -1)

    def pick(t):
        return None if t is None else t[used].float()

    w32 = ExpertWeights(pick(w.w13), pick(w.w2), pick(w.b13), pick(w.b2))
    assert not torch.backends.cuda.matmul.allow_tf32
    return run_standard(x.float(), TopKOutput(topk.weights, ids), w32, act)


@pytest.mark.gpu
@pytest.mark.parametrize("model,tp,ep", PRESET_SHAPES, ids=lambda v: str(v))
def test_presets_bf16_gpu(model, tp, ep):
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    w = random_weights(shape, "cuda")
    for T in (1, 37, 1024, 4096):
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.02 if T > 1 else 0.0)
        out = TritonRunner().run(StandardDispatchOutput(x, topk), w, shape.act).out
        err = rel_err(out, reference_fp32_sparse(x, topk, w, shape.act))
        assert err < TOLERANCE[torch.bfloat16], (model, T, err)
    # masked format on the same weights
    E, C = shape.num_experts, 48
    xm = torch.randn(E, C, shape.hidden, device="cuda", dtype=torch.bfloat16)
    counts = torch.randint(0, C + 1, (E,), dtype=torch.int32, device="cuda")
    out = TritonRunner().run(MaskedDispatchOutput(xm, counts), w, shape.act).out
    valid = torch.arange(C, device="cuda")[None, :] < counts[:, None]
    ref = run_masked(xm, counts, w, shape.act)  # bf16 torch runner (fp64 would be too big)
    assert rel_err(out[valid], ref[valid]) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_ep_rank_decode_entries_gpu(T):
    """An EP8 rank of deepseek-v3 sees every token and holds 32 of 256 experts: the runner looks
    its tables up for T / 8 tokens (the shipped decode entries 0.125, 0.5 and 2), on routings
    with none to several local pairs."""
    from moekit.tune import random_weights, shape_for

    shape = shape_for("deepseek-v3", 8, 8)
    w = random_weights(shape, "cuda")
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        topk = make_topk(T, shape.top_k, shape.routed_experts)
        local = TopKOutput(topk.weights, torch.where(topk.ids < shape.num_experts, topk.ids, -1))
        d = StandardDispatchOutput(x, local, local_share=shape.local_share)
        out = TritonRunner().run(d, w, shape.act).out
        if (local.ids < 0).all():  # no local pair: this rank adds nothing
            assert not out.any()
            continue
        err = rel_err(out, reference_fp32_sparse(x, local, w, shape.act))
        assert err < TOLERANCE[torch.bfloat16], (T, seed, err)


VARIANTS = {"swap": SWAP, "atomic": ATOMIC, "mixed": MIXED_BM, "tma": TMA, "tma-swap": TMA_SWAP,
            "split-k": SPLIT_K, "split-k8-tma": SPLIT_K8_TMA, "lookup": None}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [1, 3, 300])
@pytest.mark.parametrize("interleaved", [False, True])
def test_config_variants_gpu(variant, T, interleaved):
    configs = VARIANTS[variant]
    w = make_weights(16, 512, 384, torch.bfloat16, True)
    act = ActivationSpec("swiglu_oai" if interleaved else "silu", interleaved=interleaved)
    x = torch.randn(T, 512, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, 4, 16, masked=0.05)
    out = ops.fused_moe(x, topk, w, act, configs=configs)
    assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("reduce", ["kernel", "atomic"])
def test_cuda_graph_replay_equals_eager(reduce):
    """Replays with new inputs equal eager calls: 'atomic' with a split-K gate_up and one pair
    per program (its arrival counts live in a buffer of the capture stream), 'kernel' with
    the MMA path."""
    E, K, H, I, T = 32, 4, 1024, 512, 200
    w = make_weights(E, H, I, torch.bfloat16, False)
    act = ActivationSpec()
    if reduce == "kernel":
        configs = (GemmConfig(32, 64, 64), GemmConfig(32, 64, 64, reduce=reduce))
    else:
        configs = (GemmConfig(1, 32, 128, split_k=4), GemmConfig(32, 64, 64, reduce=reduce))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, K, E)
    static_x, static_w, static_ids = x.clone(), topk.weights.clone(), topk.ids.clone()

    def step():
        return ops.fused_moe(static_x, TopKOutput(static_w, static_ids), w, act, configs=configs)

    graph, static_out = capture_graph(step)
    for _ in range(3):  # new inputs and a new routing each replay
        x2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk2 = make_topk(T, K, E, masked=0.1)
        static_x.copy_(x2), static_w.copy_(topk2.weights), static_ids.copy_(topk2.ids)
        graph.replay()
        eager = ops.fused_moe(x2, topk2, w, act, configs=configs)
        if reduce == "kernel":
            assert torch.equal(static_out, eager)
        else:  # atomics add in any order
            assert rel_err(static_out, eager) < 1e-2
        assert rel_err(static_out, moe_reference_fp64(x2, topk2, w, act)) < 3e-2


@pytest.mark.gpu
def test_whole_layer_cuda_graph():
    from moekit.config import MoEConfig, RunnerConfig
    from moekit.layer import MoE

    cfg = MoEConfig(num_experts=16, top_k=4, hidden_size=512, intermediate_size=256)
    layer = MoE(cfg, runner=RunnerConfig(moe_runner_backend="triton"), device="cuda")
    T = 96
    x = torch.randn(T, 512, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(T, 16, device="cuda")
    eager = layer(x, logits)
    graph, out = capture_graph(lambda: layer(x, logits))
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    assert torch.equal(out, layer(x, logits))
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["unquantized", "fp8_w8a8"])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_decode_pdl_gpu(fmt, T):
    """Kernels chained as programmatic dependent launches (`PipelineConfig.pdl`: alignment,
    quantization, GEMMs) give the plain launches' result, eager and in CUDA-graph replay with
    new inputs (sm_90+)."""

    from moekit.quant import quantize_experts

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launches need compute capability 9.0+")
    E, K, H, I = 16, 4, 512, 384
    w = make_weights(E, H, I, torch.bfloat16, True)
    if fmt != "unquantized":
        w = quantize_experts(w, fmt)
    act = ActivationSpec("swiglu_oai", interleaved=True)
    configs = ops.configs_for(T, K, w, torch.bfloat16, torch.device("cuda"))
    plain_pipe = replace(ops.PIPELINE, pdl=False)
    pdl_pipe = replace(ops.PIPELINE, pdl=True, decode_max_pairs=1 << 20)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    topk = make_topk(T, K, E, masked=0.1)
    with mock.patch.object(ops, "PIPELINE", plain_pipe):
        assert not ops.decode_pdl(x, T * K)
        plain = ops.fused_moe(x, topk, w, act, configs=configs)
    with mock.patch.object(ops, "PIPELINE", pdl_pipe):
        assert ops.decode_pdl(x, T * K)
        eager = ops.fused_moe(x, topk, w, act, configs=configs)
        assert rel_err(eager, plain) < 1e-2  # atomics add in any order
        static_x, static_w, static_ids = x.clone(), topk.weights.clone(), topk.ids.clone()
        graph, out = capture_graph(lambda: ops.fused_moe(
            static_x, TopKOutput(static_w, static_ids), w, act, configs=configs))
    for _ in range(3):
        x2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk2 = make_topk(T, K, E, masked=0.1)
        static_x.copy_(x2), static_w.copy_(topk2.weights), static_ids.copy_(topk2.ids)
        graph.replay()
        with mock.patch.object(ops, "PIPELINE", plain_pipe):
            assert rel_err(out, ops.fused_moe(x2, topk2, w, act, configs=configs)) < 1e-2
