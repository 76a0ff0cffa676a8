"""`runners._shared.DerivedCopies`: the weight copies runners keep (padded, packed) follow the
weights, in their own storage when the weights were written in place."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moekit.runners._shared import DerivedCopies, copy_into_


@dataclass(frozen=True)
class Doubled:
    w: torch.Tensor
    big: bool  # a layout flag that depends on the values


def _double(w: torch.Tensor) -> Doubled:
    return Doubled(w * 2, bool((w.abs() > 10).any()))


def test_copy_follows_in_place_writes_in_its_own_storage():
    w = torch.randn(4, 3)
    cache = DerivedCopies()
    first = cache.get((w,), "t", lambda: _double(w))
    assert cache.get((w,), "t", lambda: pytest.fail("built again")) is first
    ptr = first.w.data_ptr()
    w.add_(1)  # written in place: the same copy, rewritten
    again = cache.get((w,), "t", lambda: _double(w))
    assert again is first and first.w.data_ptr() == ptr and torch.equal(first.w, w * 2)
    w.mul_(100)  # the flag changes: a new copy (the old one is left as it was)
    old_values = first.w.clone()
    third = cache.get((w,), "t", lambda: _double(w))
    assert third is not first and third.big and torch.equal(first.w, old_values)
    assert cache.copies() == [third]


def test_refresh_rewrites_existing_copies_only_and_new_tensors_replace():
    w, other = torch.randn(4, 3), torch.randn(4, 3)
    cache = DerivedCopies(max_entries=1)
    cache.refresh((w,), lambda tag: pytest.fail("no copy of w yet"))
    first = cache.get((w,), "t", lambda: _double(w))
    w.sub_(1)
    cache.refresh((w,), lambda tag: _double(w))
    assert torch.equal(first.w, w * 2)
    second = cache.get((other,), "t", lambda: _double(other))
    assert second is not first and cache.copies() == [second]  # at most one entry


def test_copy_into_refuses_another_layout_and_writes_nothing():
    dst = Doubled(torch.zeros(2), False)
    with pytest.raises(ValueError, match="into"):
        copy_into_(dst, Doubled(torch.ones(2), True))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        copy_into_(dst, Doubled(torch.ones(3), False))
    assert torch.equal(dst.w, torch.zeros(2))
    copy_into_((dst, None), (Doubled(torch.ones(2), False), None))
    assert torch.equal(dst.w, torch.ones(2))
