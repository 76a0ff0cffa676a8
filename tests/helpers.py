"""Shared test helpers: relative error and the tolerance table."""

import torch

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
