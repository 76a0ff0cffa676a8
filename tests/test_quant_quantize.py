"""quantize / dequantize reference twins: layouts on hand-made examples, rounding bounds on
random weights, value idempotence, zero groups, errors."""

import pytest
import torch

from moekit.quant import (
    MXFP4,
    NVFP4,
    Fp8W8A8,
    Int4W4A16,
    Int8W8A8,
    Int8W8A16,
    dequantize,
    quantize,
)
from moekit.quant.packing import e2m1_decode, e8m0_decode, unpack_uint4

SPECS = [
    Fp8W8A8("tensor"),
    Fp8W8A8("channel"),
    Fp8W8A8("block"),
    Int8W8A8(),
    Int8W8A16(),
    Int4W4A16(32, True),
    Int4W4A16(64, False),
    Int4W4A16(128, True, torch.float16),
    Int4W4A16(128, False, torch.float32),
    MXFP4(),
    NVFP4(),
]


def _id(spec):
    return spec.describe().replace(" ", "")


def _expand(s, n, dim=-1):
    return s.repeat_interleave(n, dim=dim)


def _per_element_scale(q):
    """The dequantization multiplier of each element [.., N, K] (float64)."""
    spec, (*lead, N, K) = q.spec, q.shape
    s = q.scale.double()
    if isinstance(spec, Fp8W8A8):
        if spec.weight_scale == "tensor":
            return s[..., None, None].expand(*lead, N, K)
        if spec.weight_scale == "channel":
            return s[..., None].expand(*lead, N, K)
        return _expand(_expand(s, 128, -2), 128)[..., :N, :K]
    if isinstance(spec, (Int8W8A8, Int8W8A16)):
        return s[..., None].expand(*lead, N, K)
    if isinstance(spec, MXFP4):
        return _expand(e8m0_decode(q.scale).double(), 32)
    if isinstance(spec, NVFP4):
        return _expand(s * q.global_scale.double()[..., None, None], 16)
    return _expand(s, spec.group_size)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
@pytest.mark.parametrize("lead", [(), (2, 2)])
def test_round_trip_error_bounds(spec, lead):
    N, K = 136, 128  # N not a multiple of 128: partial fp8 blocks
    w = torch.randn(*lead, N, K) * torch.rand(*lead, N, 1) * 3
    q = quantize(w, spec)
    assert q.shape == (*lead, N, K) and q.data.dtype == spec.data_dtype
    d = dequantize(q, torch.float64)
    assert d.shape == w.shape and torch.isfinite(d).all()
    s = _per_element_scale(q)
    err = (d - w.double()).abs()
    if isinstance(spec, Fp8W8A8):  # e4m3: half an ulp = 2^-4 relative, 2^-10 * s subnormal
        bound = torch.maximum(w.double().abs() * 2.0**-4, s * 2.0**-10)
    elif isinstance(spec, (MXFP4, NVFP4)):
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
        grid = torch.cat([-grid.flip(0), grid])
        x = (w.double() / s).clamp(-6, 6)
        nearest = (x[..., None] - grid).abs().min(dim=-1).values
        bound = nearest * s
        if isinstance(spec, MXFP4):  # scale = smallest power of two with amax / scale <= 6
            amax = w.abs().reshape(*lead, N, K // 32, 32).amax(-1).double()
            ratio = amax / e8m0_decode(q.scale).double()
            assert (ratio <= 6).all() and (ratio > 3).all()
        else:  # nvfp4 block scales round to e4m3: a value may saturate slightly past 6 * s
            bound = bound + (w.double().abs() - 6 * s).clamp(min=0)
    else:  # integers: round to nearest
        bound = s / 2
    bound = bound + w.double().abs() * 2.0**-22  # float32 arithmetic of the quantizer
    assert (err <= bound).all(), (err - bound).max()
    rel = ((d - w.double()).norm() / w.double().norm()).item()
    if isinstance(spec, Fp8W8A8):
        assert rel < 0.04
    elif isinstance(spec, (Int8W8A8, Int8W8A16)):
        assert rel < 0.01
    else:
        assert rel < 0.15


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.has_zero], ids=_id)
def test_values_are_idempotent(spec):
    """Requantizing dequantized values gives them back. (Not for int4 with zero points: the
    rounded zero point can leave code 15 unused, and the requantized range is then smaller.)"""
    w = torch.randn(2, 128, 256)
    d = dequantize(quantize(w, spec))
    d2 = dequantize(quantize(d, spec))
    torch.testing.assert_close(d2, d, rtol=2e-6, atol=0)


@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_zero_groups_and_extremes(spec):
    w = torch.randn(2, 128, 256)
    w[0, :, :128] = 0  # zero groups / blocks / a zero row half
    w[1, 5] = 0  # a zero row (per-channel scales)
    w[1, 7, 3] = 3e4  # an outlier
    w[1, 9] *= 1e-6  # a tiny row
    q = quantize(w, spec)
    for t in (q.scale, q.global_scale):
        if t is not None:
            assert torch.isfinite(t.float()).all()
    d = dequantize(q)
    assert torch.isfinite(d).all()
    assert (d[0, :, :128] == 0).all() and (d[1, 5] == 0).all()
    fp4 = isinstance(spec, (MXFP4, NVFP4))  # e2m1 rounds up to 20% (2.5 -> 2, 5 -> 4)
    assert d[1, 7, 3].item() == pytest.approx(3e4, rel=0.2 if fp4 else 0.07)
    big = torch.full((1, 16, 128), 1e30)
    big[0, 0, 0] = -2e30
    if getattr(spec, "scale_dtype", None) == torch.float16:
        with pytest.raises(ValueError, match="overflows scale_dtype torch.float16"):
            quantize(big, spec)
    else:
        assert torch.isfinite(dequantize(quantize(big, spec))).all()


def test_int4_symmetric_layout_by_hand():
    row = torch.zeros(32)
    row[:4] = torch.tensor([7.0, -7.0, 3.5, 0.0])  # amax 7 -> scale 1
    q = quantize(row[None], "int4_w4a16", group_size=32)
    assert q.scale.tolist() == [[1.0]] and q.zero is None
    # q = round(w / s) + 8: 15, 1, 12 (3.5 rounds to even 4), 8
    assert q.data[0, :2].tolist() == [0x1F, 0x8C]
    assert (q.data[0, 2:] == 0x88).all()


def test_int4_asymmetric_by_hand():
    row = torch.linspace(-1, 14, 32)  # min -1, max 14 -> scale 1, zero 1
    q = quantize(row[None], Int4W4A16(32, False, torch.float32))
    assert q.scale.item() == pytest.approx(1.0) and q.zero.tolist() == [[1]]
    v = unpack_uint4(q.data)[0].long()
    assert torch.equal(v, (torch.round(row) + 1).long())
    torch.testing.assert_close(dequantize(q)[0], torch.round(row))


def test_fp8_per_tensor_by_hand():
    w = torch.tensor([[896.0, -2.0, 1.0, 0.3]])  # amax 896 -> scale 2
    q = quantize(w, "fp8_w8a8", weight_scale="tensor")
    assert q.scale.shape == () and q.scale.item() == 2.0
    assert q.data.float().tolist() == [[448.0, -1.0, 0.5, 0.15625]]  # 0.15 -> e4m3 0.15625


def test_fp8_block_scales_by_hand():
    w = torch.zeros(130, 260)
    w[0, 0], w[129, 0], w[0, 259] = 448.0, 4.48, -44.8
    q = quantize(w, "fp8_w8a8")
    torch.testing.assert_close(q.scale, torch.tensor([[1.0, 1.0, 0.1], [0.01, 1.0, 1.0]]))
    torch.testing.assert_close(dequantize(q), w, rtol=2**-4, atol=0)


def test_mxfp4_by_hand():
    g = torch.zeros(32)
    g[:4] = torch.tensor([12.0, -3.0, 1.0, 0.5])  # amax 12 -> 12 / 6 = 2 -> scale 2^1
    q = quantize(g[None], "mxfp4")
    assert q.scale.tolist() == [[128]]
    # codes of w / 2 = 6, -1.5, 0.5, 0.25 (tie -> 0): 7, 8|3, 1, 0
    assert q.data[0, :2].tolist() == [7 | (11 << 4), 1]
    assert e2m1_decode(unpack_uint4(q.data))[0, :4].tolist() == [6.0, -1.5, 0.5, 0.0]


def test_nvfp4_by_hand():
    w = torch.zeros(1, 32)
    w[0, 0] = 6 * 448.0  # tensor amax -> global scale 1
    w[0, 16:18] = torch.tensor([3.0, -1.5])  # second block amax 3 -> block scale 0.5
    q = quantize(w, "nvfp4")
    assert q.global_scale.item() == 1.0
    assert q.scale.float().tolist() == [[448.0, 0.5]]
    assert q.data[0, 8].item() == 7 | ((8 | 5) << 4)  # 3 / 0.5 = 6 -> code 7; -3 -> code 8|5
    torch.testing.assert_close(dequantize(q), w)


def test_errors():
    with pytest.raises(ValueError, match="nothing to quantize"):
        quantize(torch.randn(4, 4), "unquantized")
    with pytest.raises(ValueError, match="needs a float tensor"):
        quantize(torch.ones(4, 32, dtype=torch.int32), "int8_w8a16")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(torch.tensor([[float("nan")] * 32]), "mxfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_cuda_matches_cpu(spec):
    w = torch.randn(2, 128, 256)
    qc, qg = quantize(w, spec), quantize(w.cuda(), spec)
    assert torch.equal(qg.data.cpu().view(torch.uint8), qc.data.view(torch.uint8))
    torch.testing.assert_close(dequantize(qg).cpu(), dequantize(qc), rtol=0, atol=0)
