"""The `deep_gemm` runner on the GPU (marked): bf16 and fp8 block-scaled weights, contiguous
(standard) and masked layouts, against the reference runner, on preset shapes and on shapes that
are not multiples of the kernels' tiles or scale groups; CUDA-graph replay.
Skipped where DeepGEMM cannot run (no SM90 GPU, sgl-deep-gemm not installed)."""

from __future__ import annotations

import pytest
import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import detect
from moekit.quant import quantize_experts
from moekit.router import TopKOutput
from moekit.runners import registry
from moekit.runners.torch import TorchRunner, moe_reference_fp64
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput
from tests.helpers import TOLERANCE, capture_graph, rel_err

pytestmark = pytest.mark.gpu

# fp8 vs the reference runner's fake quantization (float32 matmuls, bf16 intermediate): see
# tests/test_cutlass_runner.py (about 0.3% seen for the same quantization on CPU)
FP8_VS_REFERENCE = 2e-2

SHAPES = {  # per-rank E, K, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3-ep8": (32, 8, 7168, 2048),
}
# H and I off the 128 grid: partial K blocks and scale groups, and column tiles that end past N
# (2I = 416 and H = 336 are not multiples of any column tile; the next expert's weight rows are
# read into the columns that are not stored)
ODD_SHAPES = {
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "odd": (6, 2, 336, 208),
}
GPT_OSS_ACT = ActivationSpec("swiglu_oai", interleaved=True, alpha=1.702, limit=7.0)


@pytest.fixture(scope="module", autouse=True)
def _needs_deep_gemm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    avail = registry.availability("deep_gemm", detect())
    if not avail:
        pytest.skip(f"deep_gemm unavailable: {avail.reason}")


def _weights(E, H, I, fp8: bool, bias=False) -> ExpertWeights:
    dev = "cuda"
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).to(torch.bfloat16)
    b13 = (torch.randn(E, 2 * I, device=dev) * 0.1).to(torch.bfloat16) if bias else None
    b2 = (torch.randn(E, H, device=dev) * 0.1).to(torch.bfloat16) if bias else None
    w = ExpertWeights(w13, w2, b13, b2)
    return quantize_experts(w, "fp8_w8a8") if fp8 else w


def _topk(T, E, K, masked=False) -> TopKOutput:
    ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :K].to(torch.int32)
    if masked:
        ids[torch.rand(T, K, device="cuda") < 0.3] = -1
    return TopKOutput(torch.rand(T, K, device="cuda"), ids)


def _runner():
    return registry.runner_class("deep_gemm")()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("T", [1, 100, 2048])
def test_standard_contiguous(shape, T, fp8):
    E, K, H, I = SHAPES[shape]
    w = _weights(E, H, I, fp8, bias=(T == 100))
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    topk = _topk(T, E, K, masked=(T == 100))
    act = ActivationSpec("silu")
    out = _runner().run(StandardDispatchOutput(x, topk), w, act).out
    if fp8:
        ref = TorchRunner().run(StandardDispatchOutput(x, topk), w, act).out
        assert rel_err(out, ref) <= FP8_VS_REFERENCE
    else:
        assert rel_err(out, moe_reference_fp64(x, topk, w, act)) <= TOLERANCE[torch.bfloat16]


def test_fp8_gather_quantization_paths_agree():
    """The fp8 gather quantizes the tokens first (all-local pairs) or each gathered row (an EP
    rank's local share, `ROW_QUANT_MAX_PAIRS`): the same output bit for bit."""
    from moekit.runners import deep_gemm

    E, K, H, I = SHAPES["deepseek-v3-ep8"]
    w = _weights(E, H, I, True)
    x = torch.randn(300, H, device="cuda").to(torch.bfloat16)
    topk = _topk(300, E, K, masked=True)
    act = ActivationSpec("silu")
    share = deep_gemm.ROW_QUANT_MAX_PAIRS / K  # rows: K * share is not above the bound
    rows = _runner().run(StandardDispatchOutput(x, topk, local_share=share), w, act).out
    tokens = _runner().run(StandardDispatchOutput(x, topk, local_share=1.0), w, act).out
    assert torch.equal(rows, tokens)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", list(ODD_SHAPES))
@pytest.mark.parametrize("T", [3, 700])
def test_standard_off_grid_shapes(shape, T, fp8):
    """gpt-oss (swiglu_oai, interleaved, biases) and a small odd shape, against the reference."""
    E, K, H, I = ODD_SHAPES[shape]
    w = _weights(E, H, I, fp8, bias=True)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    topk = _topk(T, E, K, masked=True)
    d = StandardDispatchOutput(x, topk)
    out = _runner().run(d, w, GPT_OSS_ACT).out
    if fp8:
        ref = TorchRunner().run(d, w, GPT_OSS_ACT).out
        assert rel_err(out, ref) <= FP8_VS_REFERENCE
    else:
        assert (
            rel_err(out, moe_reference_fp64(x, topk, w, GPT_OSS_ACT)) <= TOLERANCE[torch.bfloat16]
        )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_masked_off_grid_shape(fp8):
    E, K, H, I = ODD_SHAPES["odd"]
    C = 40
    w = _weights(E, H, I, fp8, bias=True)
    x = torch.randn(E, C, H, device="cuda").to(torch.bfloat16)
    counts = torch.tensor([0, C, 1, 17, 39, 5], device="cuda", dtype=torch.int32)
    out = _runner().run(MaskedDispatchOutput(x, counts), w, GPT_OSS_ACT).out
    ref = TorchRunner().run(MaskedDispatchOutput(x, counts), w, GPT_OSS_ACT).out
    valid = torch.arange(C, device="cuda").unsqueeze(0) < counts.unsqueeze(1)
    tol = FP8_VS_REFERENCE if fp8 else TOLERANCE[torch.bfloat16]
    assert rel_err(out[valid], ref[valid]) <= tol


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("C, hint", [(16, None), (128, None), (128, 4)])
def test_masked(C, hint, fp8):
    """hint: the dispatcher's expected rows per expert (4 in C = 128: the 64-row tile, the
    counts still up to C)."""
    E, K, H, I = SHAPES["deepseek-v3-ep8"]
    w = _weights(E, H, I, fp8)
    x = torch.randn(E, C, H, device="cuda").to(torch.bfloat16)
    counts = torch.randint(0, C + 1, (E,), device="cuda", dtype=torch.int32)
    counts[0], counts[1] = 0, C
    act = ActivationSpec("silu")
    out = _runner().run(MaskedDispatchOutput(x, counts, expected_rows=hint), w, act).out
    ref = TorchRunner().run(MaskedDispatchOutput(x, counts), w, act).out
    valid = torch.arange(C, device="cuda").unsqueeze(0) < counts.unsqueeze(1)
    tol = FP8_VS_REFERENCE if fp8 else TOLERANCE[torch.bfloat16]
    assert rel_err(out[valid], ref[valid]) <= tol


def test_empty_batch():
    E, K, H, I = SHAPES["qwen3-30b-a3b"]
    w = _weights(E, H, I, fp8=False)
    x = torch.empty(0, H, device="cuda", dtype=torch.bfloat16)
    out = _runner().run(StandardDispatchOutput(x, _topk(0, E, K)), w, ActivationSpec()).out
    assert out.shape == (0, H)


def test_cuda_graph_replay():
    E, K, H, I = SHAPES["qwen3-30b-a3b"]
    w = _weights(E, H, I, fp8=True)
    x = torch.randn(64, H, device="cuda").to(torch.bfloat16)
    topk = _topk(64, E, K, masked=True)
    act = ActivationSpec("silu")
    runner = _runner()
    d = StandardDispatchOutput(x, topk)
    runner.run(d, w, act)  # JIT compile and warm up outside the capture
    graph, static_out = capture_graph(lambda: runner.run(d, w, act).out)
    new = _topk(64, E, K, masked=True)
    topk.ids.copy_(new.ids)
    topk.weights.copy_(new.weights)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = TorchRunner().run(StandardDispatchOutput(x, topk), w, act).out
    assert rel_err(static_out, ref) <= FP8_VS_REFERENCE
