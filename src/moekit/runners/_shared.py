"""Small helpers several runners share: copies derived from the weights (permuted, padded) that
follow the weights, and the expected number of experts a batch touches under uniform routing
(to size launches on the host)."""

from __future__ import annotations

import math
from typing import Any, Callable, Generic, TypeVar

import torch

T = TypeVar("T")


def _storage_key(tensors) -> tuple:
    return tuple(None if t is None else (t.data_ptr(), tuple(t.shape), t.dtype) for t in tensors)


def _versions(tensors) -> tuple:
    return tuple(None if t is None else t._version for t in tensors)


def copy_into_(dst, src) -> None:
    """Write `src` into `dst` in place: tensors, tuples and lists of them, objects whose
    attributes are (a dataclass). Raises ValueError, writing nothing, where the two differ in
    layout: a tensor's shape or dtype, or another value (a size, a flag, None)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    _tensor_pairs(dst, src, pairs)
    for d, s in pairs:
        d.copy_(s)


def _tensor_pairs(dst, src, pairs: list) -> None:
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        if (dst.shape, dst.dtype) != (src.shape, src.dtype):
            raise ValueError(f"cannot write a {src.dtype} {tuple(src.shape)} tensor into a "
                             f"{dst.dtype} {tuple(dst.shape)} one")  # fmt: skip
        pairs.append((dst, src))
    elif isinstance(dst, (tuple, list)) and type(dst) is type(src) and len(dst) == len(src):
        for d, s in zip(dst, src):
            _tensor_pairs(d, s, pairs)
    elif hasattr(dst, "__dict__") and type(dst) is type(src):
        for name, value in vars(dst).items():
            _tensor_pairs(value, getattr(src, name), pairs)
    elif isinstance(dst, torch.Tensor) or isinstance(src, torch.Tensor) or dst != src:
        raise ValueError(f"cannot write {src!r} into {dst!r} in place")


class DerivedCopies(Generic[T]):
    """Copies derived from weight tensors (a permuted or padded layout), at most `max_entries`.

    `get(tensors, tag, build)` returns the copy of those tensors (`tag`: anything else it depends
    on), building it on first use. When the tensors were written in place since (same storage,
    a newer version counter: a weight load, an EPLB move), the copy is built again *into its own
    tensors*, so a CUDA graph captured with it reads the new values (unless the new values change
    the copy's layout, e.g. a flag of the packed format: then it is a new copy); `refresh` does
    that alone, for the copies that exist."""

    def __init__(self, max_entries: int = 1) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple, tuple[tuple, T]] = {}  # storage key -> (versions, copy)

    def get(self, tensors: tuple, tag, build: Callable[[], T]) -> T:
        key = (tag, *_storage_key(tensors))
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()  # free the old copies before building the new one
            self._entries[key] = (_versions(tensors), build())
        elif entry[0] != _versions(tensors):
            fresh = build()
            try:
                copy_into_(entry[1], fresh)
                fresh = entry[1]
            except ValueError:  # the new values change the layout (a flag): a new copy
                pass
            self._entries[key] = (_versions(tensors), fresh)
        return self._entries[key][1]

    def refresh(self, tensors: tuple, build: Callable[[Any], T]) -> None:
        """Bring every existing copy of `tensors` up to date, whatever its tag (`build(tag)`
        makes the copy for that tag); makes none that does not exist."""
        storage = _storage_key(tensors)
        for tag, *rest in list(self._entries):
            if tuple(rest) == storage:
                self.get(tensors, tag, lambda tag=tag: build(tag))

    def copies(self) -> list[T]:
        return [copy for _, copy in self._entries.values()]


def expected_experts_used(num_pairs: float, num_experts: int) -> float:
    """Experts that `num_pairs` (token, expert) pairs touch on average when each pair goes to
    one of `num_experts` uniformly at random: E (1 - (1 - 1/E)^pairs)."""
    if num_experts <= 1:
        return min(1.0, num_pairs)
    return -num_experts * math.expm1(num_pairs * math.log1p(-1 / num_experts))
