"""Small helpers several runners share: a cache key of weight tensors, and the expected number
of experts a batch touches under uniform routing (to size launches on the host)."""

from __future__ import annotations

import math

import torch


def tensors_key(*tensors: torch.Tensor | None) -> tuple:
    """A cache key for data derived from `tensors` (a permuted or padded copy): it changes when
    one is replaced (storage, shape, dtype) or written in place (its version counter)."""
    return tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.dtype)
                 for t in tensors)  # fmt: skip


def expected_experts_used(num_pairs: float, num_experts: int) -> float:
    """Experts that `num_pairs` (token, expert) pairs touch on average when each pair goes to
    one of `num_experts` uniformly at random: E (1 - (1 - 1/E)^pairs)."""
    if num_experts <= 1:
        return min(1.0, num_pairs)
    return -num_experts * math.expm1(num_pairs * math.log1p(-1 / num_experts))
