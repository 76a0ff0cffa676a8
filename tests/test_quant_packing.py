"""Bit layouts, checked bit-exactly on hand-made examples."""

import pytest
import torch

from moekit.quant.packing import (
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    e8m0_encode,
    pack_uint4,
    unpack_uint4,
)


def test_pack_uint4_low_nibble_first():
    v = torch.tensor([[1, 2, 3, 4, 15, 0], [0, 15, 7, 8, 10, 5]])
    p = pack_uint4(v)
    assert p.dtype == torch.uint8
    assert p.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x87, 0x5A]]
    assert torch.equal(unpack_uint4(p), v.to(torch.uint8))


def test_pack_uint4_round_trip_random_and_errors():
    v = torch.randint(0, 16, (3, 5, 64))
    assert torch.equal(unpack_uint4(pack_uint4(v)), v.to(torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_uint4(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="0..15"):
        pack_uint4(torch.tensor([16, 0]))


def test_e2m1_codes():
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for code, v in enumerate(values):
        assert e2m1_encode(torch.tensor([v])).item() == code
        assert e2m1_encode(torch.tensor([-v])).item() == code | 8
        assert e2m1_decode(torch.tensor([code])).item() == v
        assert e2m1_decode(torch.tensor([code | 8])).item() == -v


@pytest.mark.parametrize(
    "x, expect",
    [
        (0.25, 0.0),  # tie between 0 (code 0) and 0.5 (code 1): even code
        (0.75, 1.0),  # tie 0.5 (1) / 1.0 (2)
        (1.25, 1.0),  # tie 1.0 (2) / 1.5 (3)
        (1.75, 2.0),  # tie 1.5 (3) / 2.0 (4)
        (2.5, 2.0),  # tie 2 (4) / 3 (5)
        (3.5, 4.0),  # tie 3 (5) / 4 (6)
        (5.0, 4.0),  # tie 4 (6) / 6 (7)
        (0.26, 0.5),
        (2.6, 3.0),
        (5.01, 6.0),
        (100.0, 6.0),  # saturates
        (-3.6, -4.0),
    ],
)
def test_e2m1_rounding(x, expect):
    assert e2m1_decode(e2m1_encode(torch.tensor([x]))).item() == expect


def test_e2m1_is_nearest_on_random_values():
    x = torch.randn(4096) * 3
    got = e2m1_decode(e2m1_encode(x))
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = torch.cat([-grid.flip(0), grid])
    best = (x.clamp(-6, 6)[:, None] - grid[None]).abs().min(dim=1).values
    assert torch.equal((x.clamp(-6, 6) - got).abs(), best)


def test_e8m0():
    codes = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    d = e8m0_decode(codes)
    assert d[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(d[6])
    x = torch.tensor([1.0, 1.5, 0.75, 2.0**-3, 3.0, 0.0, 2.0**-140, 1e38])
    assert e8m0_encode(x).tolist() == [127, 128, 127, 124, 129, 0, 0, 254]
    assert e8m0_encode(x, rounding="down").tolist() == [127, 127, 126, 124, 128, 0, 0, 253]
    with pytest.raises(ValueError, match="non-negative"):
        e8m0_encode(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="rounding must be 'up' or 'down'"):
        e8m0_encode(x, rounding="nearest")
