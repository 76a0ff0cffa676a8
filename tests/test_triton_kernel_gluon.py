"""The `triton_kernel` runner's Gluon engine (`gluon_ops`): the engine choice on CPU (pure
rules, environment injected), the kernels compiled for sm_90 on the host (Triton >= 3.9, no
GPU needed); on an sm_90 GPU with Triton >= 3.9 (marked gpu, skipped with the
reason elsewhere) its output against the reference on odd and preset shapes, both reductions,
and CUDA graph replay against eager."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
from helpers import TOLERANCE, capture_graph, make_topk, make_weights, rel_err  # noqa: E402

from moekit import envs  # noqa: E402
from moekit.experts import ActivationSpec  # noqa: E402
from moekit.router import TopKOutput  # noqa: E402
from moekit.runners.torch import moe_reference_fp64  # noqa: E402
from moekit.runners.triton.ops import kernel_inputs  # noqa: E402
from moekit.runners.triton_kernel import gluon_ops, ops  # noqa: E402

ENV = envs.MOEKIT_TRITON_KERNEL_ENGINE.name


def test_engine_choice_rules(monkeypatch):
    w = make_weights(4, 64, 32, torch.float32, False, device="cpu")
    act = ActivationSpec()
    big = torch.zeros(1024, 64)  # 1024 * 2 / 4 = 512 rows per expert
    monkeypatch.setattr(gluon_ops, "MIN_ROWS_PER_EXPERT", 256)
    monkeypatch.setenv(ENV, "triton")
    assert gluon_ops.engine_for(big, w, act, 2) == "triton"
    monkeypatch.setenv(ENV, "auto")
    assert gluon_ops.engine_for(torch.zeros(8, 64), w, act, 2) == "triton"  # few rows
    assert gluon_ops.engine_for(big, w, act, 2) == "triton"  # CPU: cannot run, not an error
    monkeypatch.setattr(gluon_ops, "unavailable_reason", lambda *a: None)  # as on an H100
    assert gluon_ops.engine_for(big, w, act, 2) == "gluon"
    assert gluon_ops.engine_for(torch.zeros(8, 64), w, act, 2) == "triton"  # few rows
    # an EP rank's share of local pairs: 512 * 1/4 = 128 rows per expert, under the bound
    assert gluon_ops.engine_for(big, w, act, 2, local_share=0.25) == "triton"
    monkeypatch.setattr(gluon_ops, "MIN_ROWS_PER_EXPERT", 128)
    assert gluon_ops.engine_for(big, w, act, 2, local_share=0.25) == "gluon"  # at the bound
    monkeypatch.undo()
    monkeypatch.setenv(ENV, "gluon")
    with pytest.raises(ValueError, match=f"{ENV}=gluon: the Gluon engine runs on CUDA only"):
        gluon_ops.engine_for(big, w, act, 2)
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match=f"{ENV}='fast'; allowed: auto, triton, gluon"):
        gluon_ops.engine_for(big, w, act, 2)


def test_config_for_gathers_below_the_intermediate_bound():
    narrow = make_weights(2, 64, 32, torch.float32, False, device="cpu")
    assert gluon_ops.config_for(narrow).gather
    wide = make_weights(1, 16, gluon_ops.GATHER_MAX_INTERMEDIATE, torch.float32, False,
                        device="cpu")  # fmt: skip
    assert not gluon_ops.config_for(wide).gather


def test_config_consumers_is_one_or_two():
    assert gluon_ops.FP8.consumers == 2 and gluon_ops.FP8.num_warps == 4
    assert gluon_ops.DEFAULT.num_warps == 8
    with pytest.raises(ValueError, match=r"GluonConfig.consumers=3; allowed: 1, 2"):
        replace(gluon_ops.DEFAULT, consumers=3)


def test_config_fold_rows_and_where_folding_applies():
    w = make_weights(2, 64, 32, torch.float32, False, device="cpu")
    fold = replace(gluon_ops.DEFAULT, fold_rows=16)
    assert fold.fold_for(w) == 16 and gluon_ops.DEFAULT.fold_for(w) == gluon_ops.DEFAULT.fold_rows
    assert replace(fold, consumers=2).fold_for(w) == 0  # one consumer partition only
    assert replace(fold, gate_up_fused=True).fold_for(w) == 0
    assert fold.fold_for(_fp8_weights()) == 0  # unquantized weights only
    with pytest.raises(ValueError, match=r"GluonConfig.fold_rows=8; allowed: 0, 16"):
        replace(gluon_ops.DEFAULT, fold_rows=8)
    # the engine folds at one or two tiles an expert (the measured window), not elsewhere
    lo, hi = gluon_ops.FOLD_MIN_ROWS, gluon_ops.FOLD_MAX_ROWS
    for rows, want in ((None, 0), (lo - 1, 0), (lo, 16), (hi, 16), (hi + 1, 0)):
        assert gluon_ops.config_for(w, rows).fold_rows == want, rows
    assert gluon_ops.config_for(_fp8_weights(), lo) == gluon_ops.FP8


def test_config_small_tiles_up_to_their_rows():
    """Narrow six-stage tiles where an expert has at most SMALL_TILES_MAX_ROWS mean rows (and
    the fold rule still applies on its own); DEFAULT's tiles above, and where rows are unknown."""
    w = make_weights(2, 64, 32, torch.float32, False, device="cpu")
    top = gluon_ops.SMALL_TILES_MAX_ROWS
    for rows, small in ((None, False), (1, True), (top, True), (top + 1, False)):
        cfg = gluon_ops.config_for(w, rows)
        tiles = {k: getattr(cfg, k) for k in gluon_ops.SMALL_TILES}
        default = {k: getattr(gluon_ops.DEFAULT, k) for k in gluon_ops.SMALL_TILES}
        assert tiles == (gluon_ops.SMALL_TILES if small else default), rows
    assert gluon_ops.config_for(w, top).fold_rows == gluon_ops.FOLD_AUTO  # top is in the fold window
    assert gluon_ops.config_for(_fp8_weights(), 1) == gluon_ops.FP8


def test_runner_gives_the_engine_its_local_share(monkeypatch):
    """The fold rule counts an EP rank's local rows: the runner passes its share on."""
    seen = {}

    def engine(x, ids, weights, w, act, cfg=None, local_share=1.0):
        seen["share"] = local_share
        return x

    monkeypatch.setattr(gluon_ops, "engine_for", lambda *a, **k: "gluon")
    monkeypatch.setattr(gluon_ops, "fused_moe", engine)
    w = make_weights(4, 64, 32, torch.float32, False, device="cpu")
    ops.fused_moe(torch.zeros(8, 64), make_topk(8, 2, 4, device="cpu"), w, ActivationSpec(),
                  local_share=0.125)  # fmt: skip
    assert seen["share"] == 0.125


def test_engine_status_for_moekit_env():
    assert gluon_ops.engine_status((8, 0), "3.9.0") == (
        "Gluon engine: off (needs an sm_90 GPU; fp8 block-wise weights need it)"
    )
    assert gluon_ops.engine_status((9, 0), "3.6.0") == (
        "Gluon engine: off (needs Triton >= 3.9, have 3.6.0; fp8 block-wise weights need it)"
    )
    assert gluon_ops.engine_status((9, 0), "3.9.0").startswith("Gluon engine: on from 32 rows")


def _fp8_weights(E=4, H=256, I=128, spec=None):
    from moekit.quant import quantize_experts
    from moekit.quant.spec import Fp8W8A8

    w = make_weights(E, H, I, torch.float32, False, device="cpu")
    return quantize_experts(w, spec or Fp8W8A8())


def test_fp8_runs_in_the_engine_only(monkeypatch):
    """fp8 block-wise weights take the Gluon engine at any batch size; where it cannot run, or
    with the Triton engine forced, the call fails naming why (nothing falls back silently)."""
    from moekit.quant.spec import Fp8W8A8

    w, act, x = _fp8_weights(), ActivationSpec(), torch.zeros(2, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Gluon engine only, which runs on CUDA only"):
        gluon_ops.engine_for(x, w, act, 2)
    monkeypatch.setattr(gluon_ops, "unavailable_reason", lambda *a: None)  # as on an H100
    assert gluon_ops.engine_for(x, w, act, 2) == "gluon"  # two tokens: still this engine
    assert gluon_ops.config_for(w) == gluon_ops.FP8
    monkeypatch.setenv(ENV, "triton")
    with pytest.raises(ValueError, match=f"which {ENV}=triton turns off"):
        gluon_ops.engine_for(x, w, act, 2)
    assert gluon_ops.fp8_problem(Fp8W8A8()) is None
    assert "block scales" in gluon_ops.fp8_problem(Fp8W8A8(weight_scale="channel"))
    assert "per-token-group" in gluon_ops.fp8_problem(Fp8W8A8(activation_scheme="token"))


def test_fp8_selection_rules():
    """moekit.select sees the fp8 recipe, the shape rule and the platform's engine."""
    from moekit.hardware import Platform
    from moekit.quant.spec import Fp8W8A8
    from moekit.runners.triton_kernel import TritonKernelRunner
    from moekit.select import Workload

    def work(spec=Fp8W8A8(), H=2048, I=768):
        return Workload(4096, weight_format="fp8_w8a8", weight_spec=spec, num_experts=8,
                        hidden_size=H, intermediate_size=I, top_k=2)  # fmt: skip

    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"triton": "3.9.0"})
    old = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"triton": "3.6.0"})
    a100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 1, {"triton": "3.9.0"})
    problem = TritonKernelRunner.workload_problem
    assert problem(work(), h100) is None
    assert problem(Workload(4096), a100) is None  # unquantized: no rule here
    assert "needs Triton >= 3.9, have 3.6.0" in problem(work(), old)
    assert "needs an sm_90 GPU" in problem(work(), a100)
    assert "I of 64, got H=2048, I=96" in problem(work(I=96), h100)
    assert "block scales" in problem(work(Fp8W8A8(weight_scale="tensor")), h100)


def test_runner_availability_carries_the_engine_status():
    from moekit.hardware import Platform
    from moekit.runners.triton_kernel import TritonKernelRunner

    h100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"triton": "3.9.0"})
    a = TritonKernelRunner.availability(h100)
    assert a.ok and a.reason.startswith("Gluon engine: on")


def test_triton_version_gate(monkeypatch):
    gluon_ops._gluon_import_error.cache_clear()
    monkeypatch.setattr(gluon_ops.triton, "__version__", "3.6.0")
    try:
        assert gluon_ops._gluon_import_error() == (
            "needs Triton >= 3.9 (Gluon warp specialization); this is 3.6.0"
        )
    finally:
        gluon_ops._gluon_import_error.cache_clear()


def _compile_sm90(kernel, signature: dict, constexprs: dict, attrs=None):
    """Compile a Gluon kernel for sm_90 on the host (no GPU needed); returns its PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from moekit.runners.triton_kernel import _gluon_kernels as gk

    src = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": constexprs["num_warps"], "maxnreg": gk.MAX_REGS}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def test_kernels_compile_for_sm90_on_the_host():
    """The three kernels build for Hopper with this Triton (CI's CPU machine runs 3.9): the
    warp-specialized partitions (setmaxnreg), wgmma, TMA and, in the gathering gate_up, the
    cp.async copies with their barrier arrival are all in the PTX. In a fresh process without
    TRITON_INTERPRET: once a kernel has run in the interpreter, compiling Gluon in the same
    process fails ('block_argument' object has no attribute 'dtype', Triton 3.9)."""
    if gluon_ops._gluon_import_error() is not None:
        pytest.skip(gluon_ops._gluon_import_error())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import {Path(__file__).stem} as t; t.compile_kernels_for_sm90()"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def compile_kernels_for_sm90() -> None:
    """The body of the test above (asserts on the PTX of each kernel)."""
    from triton.experimental.gluon import language as gl

    from moekit.runners.triton_kernel import _gluon_kernels as gk

    E, H, I, P = 4, 256, 192, 512
    x = torch.empty(P, H, dtype=torch.bfloat16)
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16)
    h = torch.empty(P, I, dtype=torch.bfloat16)
    bm, cfg = gk.BLOCK_M, gluon_ops.DEFAULT
    wd = gluon_ops._desc(w13, [E * 2 * I, H], [H, 1], [cfg.gate_up_block_n, cfg.gate_up_block_k])
    tiles = {n: "*i32" for n in ("tile_expert_ptr", "tile_row0_ptr", "tile_rows_ptr",
                                 "num_tiles_ptr")}  # fmt: skip
    gate_up_sig = {"w_desc": wd.__mangle__(), "w_up_desc": wd.__mangle__(), "bias_ptr": "*bf16",
                   "h_ptr": "*bf16", **tiles, "N": "i32", "K": "i32", "b_row_step": "i32",
                   "up_row_off": "i32", "stride_be": "i32", "stride_hm": "i32", "alpha": "fp32",
                   "limit": "fp32", "zero_ptr": "*bf16", "zero_numel": "i32"}  # fmt: skip
    consts = {"ACT": 2, "HAS_BIAS": True, "INTERLEAVED": False, "STAGES": 4, "GROUP_M": 8,
              "CONSUMERS": 1, "FOLD": 0, "EVICT_W": False, "num_warps": gk.NUM_WARPS}  # fmt: skip
    xd = gluon_ops._desc(x, [P, H], [H, 1], [bm, cfg.gate_up_block_k])
    sig = {"xs_desc": xd.__mangle__(), "side_desc": xd.__mangle__(), **gate_up_sig}
    ptx = _compile_sm90(gk.gate_up_kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, consts)
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "n16k16" not in ptx  # no side rows without FOLD
    # FOLD: side rows through their own [16, BK] box, multiplied with swapped operands
    fold = 16
    sd = gluon_ops._desc(x, [P, H], [H, 1], [fold, cfg.gate_up_block_k])
    sig = {**sig, "side_desc": sd.__mangle__()}
    ptx = _compile_sm90(gk.gate_up_kernel, {**sig, **dict.fromkeys(consts, "constexpr")},
                        {**consts, "FOLD": fold})  # fmt: skip
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in ptx
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, cfg.gate_up_block_k], gl.bfloat16)
    bb_layout = gl.NVMMASharedLayout.get_default_for([2 * cfg.gate_up_block_n,
                                                      cfg.gate_up_block_k], gl.bfloat16)  # fmt: skip
    gather_consts = {**consts, "BM": bm, "A_LAYOUT": a_layout, "SCALED": False, "FUSED": False,
                     "BB_LAYOUT": bb_layout}  # fmt: skip
    aligned = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    scales = {"x_scale_ptr": "*fp32", "stride_xs": "i32", "w_scale_ptr": "*fp32",
              "stride_wse": "i32", "stride_wsn": "i32"}  # fmt: skip
    gather_sig = {"x_ptr": "*bf16", "stride_xm": "i32", "sorted_pairs_ptr": "*i32",
                  "top_k": "i32", **gate_up_sig, **scales}  # fmt: skip
    ptx = _compile_sm90(gk.gate_up_gather_kernel,
                        {**gather_sig, **dict.fromkeys(gather_consts, "constexpr")},
                        gather_consts, aligned)  # fmt: skip
    assert "cp.async.cg.shared.global" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    ptx = _compile_sm90(gk.gate_up_gather_kernel,
                        {**gather_sig, **dict.fromkeys(gather_consts, "constexpr")},
                        {**gather_consts, "EVICT_W": True}, aligned)  # fmt: skip
    assert ptx.count(".L2::cache_hint") == 2  # the gate and the up tile
    ptx = _compile_sm90(gk.gate_up_gather_kernel,
                        {**gather_sig, **dict.fromkeys(gather_consts, "constexpr")},
                        {**gather_consts, "FOLD": fold}, aligned)  # fmt: skip
    assert "m64n16k16.f32.bf16.bf16" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    ptx = _compile_sm90(gk.gate_up_gather_kernel,
                        {**gather_sig, **dict.fromkeys(gather_consts, "constexpr")},
                        {**gather_consts, "FUSED": True}, aligned)  # fmt: skip
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx  # gate and up at once
    # fp8 block-wise: e4m3 wgmma, one fresh product a K step scaled into the accumulators
    fp8 = gluon_ops.FP8
    w13q = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn)
    wq = gluon_ops._desc(w13q, [E * 2 * I, H], [H, 1], [fp8.gate_up_block_n, fp8.gate_up_block_k])
    a_layout = gl.NVMMASharedLayout.get_default_for([bm, fp8.gate_up_block_k], gl.float8e4nv)
    bb_layout = gl.NVMMASharedLayout.get_default_for([2 * fp8.gate_up_block_n,
                                                      fp8.gate_up_block_k], gl.float8e4nv)  # fmt: skip
    fp8_consts = {**gather_consts, "A_LAYOUT": a_layout, "STAGES": fp8.gate_up_stages,
                  "SCALED": True, "BB_LAYOUT": bb_layout}  # fmt: skip
    sig = {**gather_sig, "x_ptr": "*fp8e4nv", "w_desc": wq.__mangle__(),
           "w_up_desc": wq.__mangle__(), **dict.fromkeys(fp8_consts, "constexpr")}  # fmt: skip
    split = {"CONSUMERS": 2, "num_warps": gk.NUM_WARPS // 2}  # a partition per warpgroup
    for variant in ({"FUSED": False}, {"FUSED": True}, {"FUSED": True, **split}):
        ptx = _compile_sm90(gk.gate_up_gather_kernel, sig, {**fp8_consts, **variant}, aligned)
        assert "e4m3.e4m3" in ptx and "cp.async.cg.shared.global" in ptx
    assert "m64n128k32.f32.e4m3.e4m3" in ptx and "bar.sync 0, 256" not in ptx
    hd = gluon_ops._desc(h, [P, I], [I, 1], [bm, cfg.down_block_k])
    w2d = gluon_ops._desc(w2, [E * H, I], [I, 1], [cfg.down_block_n, cfg.down_block_k])
    down_consts = {"HAS_BIAS": False, "ATOMIC": False, "STAGES": 4, "GROUP_M": 8,
                   "SCALED": False, "CONSUMERS": 1, "FOLD": 0, "EVICT_W": False, "EARLY": False,
                   "num_warps": gk.NUM_WARPS}  # fmt: skip
    down_sig = {"h_desc": hd.__mangle__(), "side_desc": hd.__mangle__(),
                "w_desc": w2d.__mangle__(), "bias_ptr": "*bf16",
                "y_ptr": "*bf16", "topk_weights_ptr": "*fp32", "sorted_pairs_ptr": "*i32",
                **tiles, "top_k": "i32", "N": "i32", "K": "i32", "stride_be": "i32",
                "stride_ym": "i32", "h_scale_ptr": "*fp32", "stride_hs": "i32",
                "w_scale_ptr": "*fp32", "stride_wse": "i32", "stride_wsn": "i32",
                **dict.fromkeys(down_consts, "constexpr")}  # fmt: skip
    ptx = _compile_sm90(gk.down_kernel, down_sig, down_consts)
    assert "setmaxnreg" in ptx and "wgmma.mma_async" in ptx and "cache_hint" not in ptx
    # EARLY: a tile's pairs and routing weights load once, before its K loop, not per half
    # of the epilogue
    early = _compile_sm90(gk.down_kernel, down_sig, {**down_consts, "EARLY": True})
    assert 0 < early.count("ld.global") < ptx.count("ld.global")
    # EVICT_W: a weight tile's TMA load carries an L2 evict-first policy where its expert has
    # one work tile (a branch beside the plain load), an A tile's never
    ptx = _compile_sm90(gk.down_kernel, down_sig, {**down_consts, "EVICT_W": True})
    assert "createpolicy.fractional.L2::evict_first" in ptx
    assert ptx.count(".L2::cache_hint") == 1 and ptx.count("cp.async.bulk.tensor") == 3
    sd = gluon_ops._desc(h, [P, I], [I, 1], [fold, cfg.down_block_k])
    for atomic in (False, True):
        ptx = _compile_sm90(gk.down_kernel, {**down_sig, "side_desc": sd.__mangle__()},
                            {**down_consts, "FOLD": fold, "ATOMIC": atomic})  # fmt: skip
        assert "m64n16k16.f32.bf16.bf16" in ptx
    hq = torch.empty(P, I, dtype=torch.float8_e4m3fn)
    w2q = torch.empty(E, H, I, dtype=torch.float8_e4m3fn)
    hd = gluon_ops._desc(hq, [P, I], [I, 1], [bm, fp8.down_block_k])
    w2d = gluon_ops._desc(w2q, [E * H, I], [I, 1], [fp8.down_block_n, fp8.down_block_k])
    down_consts = {**down_consts, "STAGES": fp8.down_stages, "SCALED": True}
    down_sig = {**down_sig, "h_desc": hd.__mangle__(), "side_desc": hd.__mangle__(),
                "w_desc": w2d.__mangle__()}  # fmt: skip
    for variant in ({}, split, {**split, "ATOMIC": True, "EARLY": True}):  # the last: FP8's
        ptx = _compile_sm90(gk.down_kernel, down_sig, {**down_consts, **variant})
        assert "e4m3.e4m3" in ptx
    assert "red.global" in ptx


def _skip_unless_engine(x, w, act):
    reason = gluon_ops.unavailable_reason(x, w, act)
    if reason is not None:
        pytest.skip(f"the Gluon engine {reason}")


def _gluon(x, topk, w, act, cfg=gluon_ops.DEFAULT):
    x_TH, ids, weights = kernel_inputs(x, topk)
    return gluon_ops.fused_moe(x_TH, ids, weights, w, act, cfg)


SUM = replace(gluon_ops.DEFAULT, reduce="sum")  # DEFAULT adds into the output ('atomic')
COPY = replace(gluon_ops.DEFAULT, gather=False)
FUSED = replace(gluon_ops.DEFAULT, gate_up_fused=True)
SPLIT = replace(gluon_ops.DEFAULT, consumers=2)  # a partition per consumer warpgroup
NO_EVICT = replace(gluon_ops.DEFAULT, evict_weights=False)
# DEFAULT's gate_up zeroes the output down adds into, its down loads the rows' pairs and weights
# early; this config zeroes it with a fill kernel and loads them in the epilogue
FILL_LATE = replace(gluon_ops.DEFAULT, zero_in_gate_up=False, early_pairs=False)
PRESETS = [("qwen3-30b-a3b", 1, 1), ("mixtral-8x7b", 2, 1), ("deepseek-v3", 8, 8),
           ("gpt-oss-120b", 1, 1)]  # fmt: skip
# (E, H, I, T, K, act, interleaved, bias, dtype, masked, one_expert, config)
ODD_CASES = [
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, gluon_ops.DEFAULT),
    (5, 200, 136, 700, 2, "silu", False, False, torch.bfloat16, 0.0, False, gluon_ops.DEFAULT),
    (7, 256, 384, 513, 4, "gelu", False, True, torch.float16, 0.2, False, gluon_ops.DEFAULT),
    (3, 512, 256, 400, 2, "silu", False, False, torch.bfloat16, 0.0, True, gluon_ops.DEFAULT),
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, SUM),
    (4, 256, 128, 64, 2, "silu", False, False, torch.bfloat16, 1.0, False, SUM),
    (4, 256, 128, 64, 2, "silu", False, False, torch.bfloat16, 1.0, False, gluon_ops.DEFAULT),
    (7, 256, 384, 513, 4, "gelu", False, True, torch.float16, 0.2, False, COPY),
    (6, 320, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, gluon_ops.DEFAULT),
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, FUSED),
    (5, 200, 136, 700, 2, "silu", False, False, torch.bfloat16, 0.0, False, FUSED),
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, SPLIT),
    (3, 512, 256, 400, 2, "silu", False, False, torch.bfloat16, 0.0, True, SPLIT),
    (4, 256, 128, 64, 2, "silu", False, False, torch.bfloat16, 1.0, False, SPLIT),
    (7, 256, 384, 513, 4, "gelu", False, True, torch.float16, 0.2, False,
     replace(COPY, consumers=2)),
    # experts of one and of several work tiles (evict-first weights on the first only)
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, NO_EVICT),
    (7, 256, 384, 513, 4, "gelu", False, True, torch.float16, 0.2, False,
     replace(COPY, reduce="sum")),
    (5, 200, 136, 700, 2, "silu", False, False, torch.bfloat16, 0.0, False,
     replace(gluon_ops.DEFAULT, fold_rows=16)),
    (6, 328, 200, 301, 3, "swiglu_oai", True, True, torch.bfloat16, 0.1, False, FILL_LATE),
]


def _case_id(c) -> str:
    tags = ("-masked" if c[9] else "") + ("-skew" if c[10] else "")
    return (f"E{c[0]}H{c[1]}I{c[2]}T{c[3]}{c[5]}{tags}-{c[11].reduce}"
            f"{'-gather' if c[11].gather else '-copy'}{'-fused' if c[11].gate_up_fused else ''}"
            f"{'-split' if c[11].consumers == 2 else ''}{'-evict' if c[11].evict_weights else ''}"
            f"{f'-fold{c[11].fold_rows}' if c[11].fold_rows else ''}"
            f"{'' if c[11].zero_in_gate_up else '-fill'}"
            f"{'' if c[11].early_pairs else '-late'}")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", ODD_CASES, ids=_case_id)
def test_odd_shapes_match_reference_gpu(case):
    E, H, I, T, K, name, inter, bias, dtype, masked, skew, cfg = case
    w = make_weights(E, H, I, dtype, bias)
    act = ActivationSpec(name, inter)
    x = torch.randn(T, H, device="cuda", dtype=dtype)
    _skip_unless_engine(x, w, act)
    topk = make_topk(T, K, E, masked=masked, one_expert=skew)
    out = _gluon(x, topk, w, act, cfg)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_reference_fp64(x, topk, w, act)) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["gather", "copy", "fused", "split", "fold", "fp8"])
@pytest.mark.parametrize("masked", [0.0, 1.0])
def test_gate_up_zeroes_the_tensor_it_is_given_gpu(variant, masked):
    """gate_up(zero=t) leaves every element of t zero, whatever it held: pieces zeroed during
    the K steps and the rest after (all of them where every id is masked: no work items), in
    each consumer variant (fp8: FP8's scaled, fused gate_up of two consumer partitions)."""
    from moekit.quant import quantize_experts
    from moekit.quant.act_quant import quantize_act
    from moekit.quant.spec import FP8_DTYPE
    from moekit.runners.triton_kernel.routing import route

    E, H, I, T, K = 6, 328, 200, 1500, 3
    if variant == "fp8":  # the fp8 engine's shape rules: H a multiple of 16, I of 64
        H, I = 320, 192
    cfg = {"gather": gluon_ops.DEFAULT, "copy": COPY, "fused": FUSED, "split": SPLIT,
           "fold": replace(gluon_ops.DEFAULT, fold_rows=16), "fp8": gluon_ops.FP8}[variant]  # fmt: skip
    w = make_weights(E, H, I, torch.bfloat16, True)
    if variant == "fp8":
        w = quantize_experts(w, "fp8_w8a8")
    act = ActivationSpec("swiglu_oai", interleaved=True)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _skip_unless_engine(x, w, act)
    topk = make_topk(T, K, E, masked=masked)
    r = route(topk.ids, E, 128, cfg.fold_for(w))
    # several 2048-element pieces a program beyond its few K steps, and a short last piece
    zero = torch.full((5 * 132 * 2048 + 8,), float("nan"), device="cuda", dtype=torch.bfloat16)
    if variant == "fp8":
        xq, xs = quantize_act(x, "token_group", FP8_DTYPE, group_size=gluon_ops.FP8_BLOCK[1])
        gluon_ops.gate_up(xq, r, w, act, cfg, K, x_scale=xs, out_dtype=x.dtype, zero=zero)
    else:
        gluon_ops.gate_up(x, r, w, act, cfg, K, zero=zero)
    torch.cuda.synchronize()
    assert int(torch.count_nonzero(zero)) == 0 and not zero.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("model,tp,ep", PRESETS)
def test_presets_through_the_runner_gpu(monkeypatch, model, tp, ep):
    """The runner's own path (engine forced), against float32 math on the experts in use."""
    from test_triton_kernel_runner import reference_fp32_sparse

    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    w = random_weights(shape, "cuda")
    x = torch.randn(2048, shape.hidden, device="cuda", dtype=torch.bfloat16)
    _skip_unless_engine(x, w, shape.act)
    monkeypatch.setenv(ENV, "gluon")
    topk = make_topk(2048, shape.top_k, shape.num_experts, masked=0.02)
    out = ops.fused_moe(x, topk, w, shape.act)
    err = rel_err(out, reference_fp32_sparse(x, topk, w, shape.act))
    assert err < TOLERANCE[torch.bfloat16], (model, err)


# fp8 block-wise (E, H, I, T, K, act, interleaved, bias, masked, one_expert): partial 128-wide
# K blocks in both GEMMs (H 208 / 2880, I 192 / 2880), interleaved gate/up with biases
FP8_CASES = [
    (5, 208, 192, 301, 3, "silu", False, False, 0.1, False),
    (6, 256, 128, 700, 2, "swiglu_oai", True, True, 0.0, False),
    (3, 384, 256, 400, 2, "gelu", False, True, 0.0, True),
    (4, 2880, 2880, 257, 4, "swiglu_oai", True, True, 0.05, False),
]


def _fp8_reference(x, topk, w, act):
    """The torch runner on the same fp8 weights (activations quantized as the format says)."""
    from moekit.runners.torch import TorchRunner
    from moekit.stages import StandardDispatchOutput

    return TorchRunner().run(StandardDispatchOutput(x, topk), w, act).out


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"E{c[0]}H{c[1]}I{c[2]}T{c[3]}{c[5]}")
def test_fp8_block_matches_reference_gpu(case):
    """fp8 block-wise through the runner against the torch runner's dequantized math, within
    the w8a8 bound of tests/test_triton_quant.py (the activation roundings may differ by a
    step)."""
    from moekit.quant import quantize_experts
    from moekit.quant.spec import Fp8W8A8

    E, H, I, T, K, name, inter, bias, masked, skew = case
    w = quantize_experts(make_weights(E, H, I, torch.bfloat16, bias), Fp8W8A8())
    act = ActivationSpec(name, inter)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _skip_unless_engine(x, w, act)
    topk = make_topk(T, K, E, masked=masked, one_expert=skew)
    out = ops.fused_moe(x, topk, w, act)  # fp8: the engine at any T
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = _fp8_reference(x, topk, w, act)
    assert rel_err(out, ref) < 3e-2
    fused = replace(gluon_ops.FP8, gate_up_fused=not gluon_ops.FP8.gate_up_fused)
    assert rel_err(_gluon(x, topk, w, act, fused), ref) < 3e-2  # the other gate_up layout
    split = replace(gluon_ops.FP8, consumers=3 - gluon_ops.FP8.consumers)
    assert rel_err(_gluon(x, topk, w, act, split), ref) < 3e-2  # the other consumer count
    # the deterministic sum over K (rows stored by pair), pairs loaded in the epilogue
    summed = replace(gluon_ops.FP8, reduce="sum", early_pairs=False)
    assert rel_err(_gluon(x, topk, w, act, summed), ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("model,tp,ep", PRESETS)
def test_fp8_presets_gpu(model, tp, ep):
    from moekit.quant import quantize_experts
    from moekit.quant.spec import Fp8W8A8
    from moekit.tune import random_weights, shape_for

    shape = shape_for(model, tp, ep)
    w = quantize_experts(random_weights(shape, "cuda"), Fp8W8A8())
    for T in (1, 2048):
        x = torch.randn(T, shape.hidden, device="cuda", dtype=torch.bfloat16)
        _skip_unless_engine(x, w, shape.act)
        topk = make_topk(T, shape.top_k, shape.num_experts, masked=0.02 if T > 1 else 0.0)
        err = rel_err(ops.fused_moe(x, topk, w, shape.act), _fp8_reference(x, topk, w, shape.act))
        assert err < 3e-2, (model, T, err)


FOLD = replace(gluon_ops.DEFAULT, fold_rows=16)
FOLD_CONFIGS = {"gather": FOLD, "copy": replace(FOLD, gather=False),
                "sum": replace(FOLD, reduce="sum")}  # fmt: skip


def _topk_with_counts(counts: list[int], K: int) -> TopKOutput:
    """A routing in which expert e takes exactly counts[e] pairs (shuffled over T = sum / K
    tokens; a token may take an expert twice), random weights."""
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel())].view(-1, K).cuda()
    weights = torch.rand(ids.shape, device="cuda") + 0.1
    return TopKOutput((weights / weights.sum(1, keepdim=True)).contiguous(), ids.contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(FOLD_CONFIGS))
def test_fold_matches_reference_gpu(name):
    """Tiles that take an expert's last 1 ... 16 rows (129, 143, 144, 272 = 128 + 144 rows) as
    side rows, beside experts whose tails keep their own tiles (145, 300 rows), a lone short
    tile (16) and an empty expert: against the float64 reference and the unfolded engine, with
    interleaved swiglu_oai and biases."""
    from moekit.runners.triton_kernel.routing import route

    counts = [128, 129, 143, 144, 145, 272, 16, 0, 300, 129]
    E, H, I, K = len(counts), 328, 200, 2
    cfg = FOLD_CONFIGS[name]
    w = make_weights(E, H, I, torch.bfloat16, True)
    act = ActivationSpec("swiglu_oai", interleaved=True)
    topk = _topk_with_counts(counts, K)
    x = torch.randn(topk.num_tokens, H, device="cuda", dtype=torch.bfloat16)
    _skip_unless_engine(x, w, act)
    r = route(topk.ids, E, 128, cfg.fold_for(w))
    nt = int(r.num_tiles.item())
    assert sorted(r.tile_rows[:nt].tolist()) == sorted(
        [128, 129, 143, 144, 128, 17, 128, 144, 16, 128, 128, 44, 129])  # fmt: skip
    out = _gluon(x, topk, w, act, cfg)
    ref = moe_reference_fp64(x, topk, w, act)
    assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]
    plain = _gluon(x, topk, w, act, replace(cfg, fold_rows=0))
    assert rel_err(out, plain) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["unquantized", "unquantized-sum", "fp8_w8a8", "fp8_w8a8-sum",
                                 "unquantized-fold"])  # fmt: skip
def test_cuda_graph_replay_equals_eager_gpu(fmt):
    """Replay equals eager: bit-identical with reduce 'sum', within rounding with 'atomic' (the
    default: the order of the bf16 additions varies). The graph's output holds the previous
    replay's result, so a piece gate_up failed to zero would show."""
    from moekit.quant import quantize_experts

    E, K, H, I, T = 32, 4, 1024, 512, 1500
    w = quantize_experts(make_weights(E, H, I, torch.bfloat16, False), fmt.split("-")[0])
    act = ActivationSpec()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _skip_unless_engine(x, w, act)
    topk = make_topk(T, K, E)
    static_x, static_w, static_ids = x.clone(), topk.weights.clone(), topk.ids.clone()
    cfg = gluon_ops.config_for(w)
    if fmt.endswith("-sum"):
        cfg = replace(cfg, reduce="sum")
    elif fmt.endswith("-fold"):
        cfg = FOLD

    def step():
        return _gluon(static_x, TopKOutput(static_w, static_ids), w, act, cfg)

    graph, static_out = capture_graph(step)
    for skew in (False, True):  # new inputs and a new routing (tile count) each replay
        x2 = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        topk2 = make_topk(T, K, E, masked=0.1, one_expert=skew)
        static_x.copy_(x2), static_w.copy_(topk2.weights), static_ids.copy_(topk2.ids)
        graph.replay()
        eager = _gluon(x2, topk2, w, act, cfg)
        if cfg.reduce == "sum":
            assert torch.equal(static_out, eager)  # deterministic
        else:
            assert rel_err(static_out, eager) < 1e-2
        ref = (moe_reference_fp64 if fmt == "unquantized" else _fp8_reference)(x2, topk2, w, act)
        assert rel_err(static_out, ref) < 3e-2
