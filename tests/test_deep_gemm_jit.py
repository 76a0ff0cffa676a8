"""moekit's builder of DeepGEMM kernels (`runners/deep_gemm_jit.py`) on CPU: configuration
choice, the shared-memory budget, and the argument checks made before any kernel is built.
The kernels themselves run in tests/test_deep_gemm_runner.py (GPU)."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.runners import deep_gemm_jit as jit

PROBLEMS = [  # (n, k, groups): the gate_up and down GEMMs of the presets deep_gemm runs
    (4096, 7168, 32), (7168, 2048, 32), (1536, 2048, 128), (2048, 768, 128),
]  # fmt: skip


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("masked, rows", [(False, 128), (True, 16), (True, 64), (True, 200)])
@pytest.mark.parametrize("n, k, groups", PROBLEMS)
def test_choose_fits_shared_memory(fp8, masked, rows, n, k, groups):
    cfg = jit.choose(fp8, masked, n, k, groups, rows, num_sms=132)
    assert cfg.smem_bytes() <= jit.SMEM_LIMIT
    assert 2 <= cfg.stages <= jit.MAX_STAGES
    # one more stage would not fit (or the cap is reached): the pipeline is as deep as it can be
    deeper = jit._smem_bytes(fp8, cfg.block_m, cfg.block_n, k, cfg.stages + 1)
    assert cfg.stages == jit.MAX_STAGES or deeper > jit.SMEM_LIMIT
    assert cfg.block_m == (64 if masked and rows <= 64 else 128)
    assert (cfg.block_n * 2) % cfg.swizzle_d == 0 and cfg.swizzle_d in (32, 64, 128)
    assert cfg.block_n == jit.block_n(fp8, masked, n)
    # DeepGEMM's static assert: a column tile spans at most two 128-wide weight scale blocks
    assert cfg.block_n <= 128 or math.gcd(cfg.block_n, 128) == cfg.block_n - 128
    assert f"-DMK_N={n}" in cfg.defines() and f"-DMK_FP8={int(fp8)}" in cfg.defines()
    assert cfg.multicast == 1 and "-DMK_MULTICAST=1" in cfg.defines()
    assert jit.choose(fp8, masked, n, k, groups, rows, 132, multicast=2).multicast == 2


def test_smem_counts_every_buffer():
    # fp8, 128 x 128 tiles, K = 7168: D 32 KiB, per stage A 16 KiB + B 16 KiB + A scales 512 B,
    # B scales 56 floats, two 8-byte barriers per stage
    assert jit._smem_bytes(True, 128, 128, 7168, 5) == 32768 + 5 * (32768 + 512) + 224 + 80
    # fp8 with 192 columns: two rows of B scales (a tile straddles two 128-wide blocks)
    assert jit._smem_bytes(True, 128, 192, 7168, 4) == 49152 + 4 * (40960 + 512) + 448 + 64
    # bf16: 64 columns of K per stage (one 128-byte swizzle atom)
    assert jit._smem_bytes(False, 64, 128, 2048, 4) == 16384 + 4 * (192 * 128) + 64


def _cfg(**kw):
    base = dict(fp8=False, masked=False, n=256, k=128, groups=2, block_m=128, block_n=128,
                stages=4, swizzle_d=128, num_sms=132)  # fmt: skip
    return jit.KernelConfig(**{**base, **kw})


def test_launch_checks_shapes_before_building():
    cfg = _cfg()
    a, b = torch.zeros(256, 128), torch.zeros(512, 128)
    d, layout = torch.zeros(256, 256), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a: expected a contiguous \[256, 128\]"):
        jit.launch(cfg, a[:100], b, d, layout, 256)
    with pytest.raises(ValueError, match="b: expected"):
        jit.launch(cfg, a, b[:256], d, layout, 256)
    with pytest.raises(ValueError, match="multiple of block_m=128"):
        jit.launch(cfg, a[:200], b, d[:200], layout, 200)
    with pytest.raises(ValueError, match="layout"):
        jit.launch(cfg, a, b, d, layout.long(), 256)
    with pytest.raises(ValueError, match=r"layout: int32 \[2\]"):  # one entry per group
        jit.launch(cfg, a, b, d, torch.zeros(256, dtype=torch.int32), 256)
    fp8 = _cfg(fp8=True)
    with pytest.raises(ValueError, match="sfa"):
        jit.launch(fp8, a, b, d, layout, 256, sfa=torch.zeros(256, 1), sfb=torch.zeros(2, 2, 1))


def test_build_needs_the_toolchain(monkeypatch):
    monkeypatch.setattr(jit, "problem", lambda: "needs nvcc")
    jit.library.cache_clear()
    with pytest.raises(RuntimeError, match="needs nvcc"):
        jit.library(_cfg())


def test_masked_expected_m_prefers_the_override_then_the_dispatchers_hint():
    """The masked GEMMs' expected_m: the runner's own setting, else the dispatcher's expected
    rows per expert, else the capacity; always within [1, C]. With the hint, a decode batch in
    a wide capacity gets the 64-row tile."""
    from moekit.runners.deep_gemm import masked_expected_m

    assert masked_expected_m(1024, None, None) == 1024
    assert masked_expected_m(1024, None, 4) == 4
    assert masked_expected_m(1024, 200, 4) == 200
    assert masked_expected_m(16, None, 40) == 16  # never past C
    assert masked_expected_m(16, None, 0) == 16  # an empty batch's hint says nothing
    assert jit.row_tile(True, masked_expected_m(1024, None, 4)) == 64
    assert jit.row_tile(True, masked_expected_m(1024, None, None)) == 128
