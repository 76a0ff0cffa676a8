"""Availability of the cutlass / deep_gemm / flashinfer_* runners on injected platforms, and
their errors: every unavailable backend says why, SM100-only ones never run elsewhere."""

from __future__ import annotations

import pytest
import torch

from moekit.config import RUNNER_BACKENDS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Platform, detect
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.base import RunnerError
from moekit.stages import StandardDispatchOutput

CPU = Platform("cpu", "cpu", None, 0, {})
A100 = Platform("cuda", "NVIDIA A100", (8, 0), 1, {"triton": "3.6.0"})
H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1, {"triton": "3.6.0"})
H100_LIBS = Platform(
    "cuda", "NVIDIA H100 80GB HBM3", (9, 0), 1,
    {"triton": "3.6.0", "sgl-deep-gemm": "0.2.2", "flashinfer-python": "0.7.2"},
)
B200 = Platform("cuda", "NVIDIA B200", (10, 0), 1, {"triton": "3.6.0"})
B200_FI = Platform("cuda", "NVIDIA B200", (10, 0), 1, {"flashinfer-python": "0.7.2"})
RTX5090 = Platform("cuda", "NVIDIA GeForce RTX 5090", (12, 0), 1, {"flashinfer-python": "0.7.2"})

# (backend, platform, available, words in the reason)
CASES = [
    ("cutlass", CPU, True, []),
    ("cutlass", A100, False, ["SM90+", "SM80"]),
    ("cutlass", H100, True, []),
    ("cutlass", B200, True, []),
    ("deep_gemm", CPU, False, ["SM90", "no CUDA GPU"]),
    ("deep_gemm", A100, False, ["SM90", "SM80"]),
    ("deep_gemm", H100, False, ["sgl-deep-gemm", "pip install"]),
    ("deep_gemm", H100_LIBS, True, []),
    ("deep_gemm", B200, False, ["SM90", "SM100", "UE8M0"]),
    ("flashinfer_cutlass", CPU, False, ["no CUDA GPU"]),
    ("flashinfer_cutlass", A100, False, ["SM90+", "SM80"]),
    ("flashinfer_cutlass", H100, False, ["flashinfer-python", "not installed"]),
    ("flashinfer_cutlass", H100_LIBS, True, []),
    ("flashinfer_trtllm", CPU, False, ["needs SM100 (Blackwell); no CUDA GPU"]),
    ("flashinfer_trtllm", H100_LIBS, False, ["needs SM100 (Blackwell); this GPU is SM90"]),
    ("flashinfer_trtllm", B200, False, ["flashinfer-python", "not installed"]),
    ("flashinfer_trtllm", B200_FI, False, ["not implemented"]),
    ("flashinfer_mxfp4", A100, False, ["needs SM100 (Blackwell); this GPU is SM80"]),
    ("flashinfer_mxfp4", B200_FI, False, ["not implemented"]),
    ("flashinfer_cutedsl", H100, False, ["needs SM100 (Blackwell); this GPU is SM90"]),
    ("flashinfer_cutedsl", RTX5090, False, ["needs SM100 (Blackwell); this GPU is SM120"]),
]


@pytest.mark.parametrize(
    "backend, platform, ok, words", CASES, ids=[f"{c[0]}-{c[1].device_name}" for c in CASES]
)
def test_availability(backend, platform, ok, words, monkeypatch):
    # the platform's rules alone: this machine's toolchain is tested below
    monkeypatch.setattr(registry.runner_class("deep_gemm"), "toolchain_problem", lambda: None)
    avail = registry.availability(backend, platform)
    assert bool(avail) is ok, avail.reason
    for w in words:
        assert w in avail.reason


def test_deep_gemm_unavailable_without_its_toolchain(monkeypatch):
    why = "needs nvcc (CUDA 12.3+) to build DeepGEMM's kernels: set CUDA_HOME or add it to PATH"
    monkeypatch.setattr(registry.runner_class("deep_gemm"), "toolchain_problem", lambda: why)
    avail = registry.availability("deep_gemm", H100_LIBS)
    assert not avail and avail.reason == why
    # the platform's rules come first: no GPU / no library says so, not the toolchain
    assert "sgl-deep-gemm" in registry.availability("deep_gemm", H100).reason


def test_deep_gemm_toolchain_here(monkeypatch, tmp_path):
    """The toolchain check names what is missing: the package's headers, then nvcc."""
    from moekit.runners import deep_gemm_jit as jit

    if jit.include_dir() is None:
        assert "include/deep_gemm" in jit.problem()
    fake = tmp_path / "deep_gemm" / "include" / "deep_gemm" / "impls"
    fake.mkdir(parents=True)
    (fake / "sm90_fp8_gemm_1d2d.cuh").write_text("")
    (tmp_path / "deep_gemm" / "__init__.py").write_text("")
    (tmp_path / "fake_deep_gemm").symlink_to(tmp_path / "deep_gemm")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(jit, "PACKAGE", "fake_deep_gemm")  # never imported, unlike deep_gemm
    assert jit.include_dir() == tmp_path / "fake_deep_gemm" / "include"
    monkeypatch.setenv("PATH", str(tmp_path))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(jit, "DEFAULT_CUDA_HOMES", (str(tmp_path),))
    assert "nvcc" in jit.problem()


@pytest.mark.parametrize("platform", [CPU, A100, H100, H100_LIBS, B200, B200_FI, RTX5090],
                         ids=lambda p: p.device_name)
def test_every_unavailable_backend_says_why(platform):
    for name in RUNNER_BACKENDS:
        if name == "auto":
            continue
        avail = registry.availability(name, platform)
        assert avail.ok or len(avail.reason) > 10, (name, avail)


def test_all_backends_of_this_issue_are_registered():
    names = set(registry.registered())
    assert {"cutlass", "deep_gemm", "flashinfer_cutlass", "flashinfer_trtllm",
            "flashinfer_mxfp4", "flashinfer_cutedsl"} <= names


@pytest.mark.parametrize("backend", ["flashinfer_trtllm", "flashinfer_mxfp4", "flashinfer_cutedsl"])
def test_sm100_only_runners_refuse_to_run(backend):
    cls = registry.runner_class(backend)
    w = ExpertWeights(torch.randn(2, 8, 4), torch.randn(2, 4, 4))
    d = StandardDispatchOutput(torch.randn(1, 4), TopKOutput(torch.ones(1, 1),
                                                             torch.zeros(1, 1, dtype=torch.int32)))
    with pytest.raises(RunnerError, match="not implemented"):
        cls().run(d, w, ActivationSpec())


def test_detect_matches_what_is_installed():
    """On this machine: deep_gemm / flashinfer are importable only if installed; the runners'
    availability follows detect()."""
    plat = detect()
    pairs = (("sgl-deep-gemm", "deep_gemm"), ("flashinfer-python", "flashinfer_cutlass"))
    for dist, backend in pairs:
        if not plat.has(dist):
            assert not registry.availability(backend, plat)
            assert dist in registry.availability(backend, plat).reason or not plat.is_cuda
