"""Shared test helpers: relative error, the tolerance table, random expert weights and routing,
CUDA-graph capture."""

import torch

from moekit.experts import ExpertWeights
from moekit.router import TopKOutput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative-norm error bounds against the float64 reference, per activation dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are empty); NaN anywhere fails."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "output has NaN"
    if ref.numel() == 0:
        assert out.numel() == 0
        return 0.0
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_weights(E, H, I, dtype, bias, device=DEVICE) -> ExpertWeights:
    """Random experts: w13 [E, 2I, H], w2 [E, H, I] scaled to unit-size outputs; biases when
    `bias`."""
    w13 = torch.randn(E, 2 * I, H, device=device, dtype=dtype) / H**0.5
    w2 = torch.randn(E, H, I, device=device, dtype=dtype) / I**0.5
    b13 = b2 = None
    if bias:
        b13 = torch.randn(E, 2 * I, device=device, dtype=dtype) * 0.1
        b2 = torch.randn(E, H, device=device, dtype=dtype) * 0.1
    return ExpertWeights(w13, w2, b13, b2)


def make_topk(T, K, E, masked=0.0, one_expert=False, device=DEVICE) -> TopKOutput:
    """Random routing: K distinct experts per token (all E - 1 with `one_expert`), a fraction
    `masked` of the ids set to -1, positive weights summing to 1 per token."""
    if one_expert:
        ids = torch.full((T, K), E - 1, dtype=torch.int32, device=device)
    else:
        ids = torch.rand(T, E, device=device).argsort(dim=1)[:, :K].to(torch.int32)
    if masked:
        ids[torch.rand(T, K, device=device) < masked] = -1
    weights = torch.rand(T, K, device=device) + 0.1
    return TopKOutput((weights / weights.sum(1, keepdim=True)).contiguous(), ids.contiguous())


def capture_graph(step):
    """Run step() once on a side stream (warm-up: compiles, allocator pools), then capture it
    into a CUDA graph; returns (graph, step's output in the graph's memory)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
