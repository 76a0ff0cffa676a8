"""Bit layouts: 4-bit values two per byte, e2m1 (fp4) codes, e8m0 (power-of-two) scales.

Nibble order (int4 and e2m1 alike, along the last dim): element 2j is the LOW nibble of byte j,
element 2j+1 the HIGH nibble: byte = v[2j] | (v[2j+1] << 4). This is the order of gpt-oss
`*_blocks`, OpenAI triton_kernels and the common fp4 kernels.

e2m1 code (4 bits): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0. Codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 the same values negated (8 is -0).

e8m0 code (uint8): 2 ** (code - 127); code 255 is NaN.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes: |x| above _E2M1_MID[i] rounds to at least code i + 1.
_E2M1_MID = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E8M0_BIAS = 127
E8M0_NAN = 255


def pack_uint4(v: torch.Tensor) -> torch.Tensor:
    """v [.., K] integer values 0..15 (any integer dtype) -> uint8 [.., K/2] (K even)."""
    if v.shape[-1] % 2:
        raise ValueError(f"pack_uint4: the last dim must be even, got {v.shape[-1]}")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("pack_uint4: values must be in 0..15")
    v = v.to(torch.uint8)
    return v[..., 0::2] | (v[..., 1::2] << 4)


def unpack_uint4(p: torch.Tensor) -> torch.Tensor:
    """uint8 [.., K/2] -> uint8 [.., K] values 0..15 (inverse of pack_uint4)."""
    if p.dtype != torch.uint8:
        raise ValueError(f"unpack_uint4: needs uint8, got {p.dtype}")
    out = torch.stack((p & 0x0F, p >> 4), dim=-1)
    return out.reshape(*p.shape[:-1], p.shape[-1] * 2)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e2m1 codes 0..15: round to nearest, ties to even code, saturate at +-6.
    NaN is not representable (the caller must not pass it)."""
    x = x.float()
    mag = x.abs()
    mid = torch.tensor(_E2M1_MID, device=x.device)
    down = torch.bucketize(mag, mid, right=False)  # ties round down
    up = torch.bucketize(mag, mid, right=True)  # ties round up
    code = torch.where(down == up, down, torch.where(down % 2 == 0, down, up)).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes 0..15 -> float32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=code.device)
    return lut[code.long()]


def e8m0_encode(x: torch.Tensor, rounding: str = "up") -> torch.Tensor:
    """Positive float32 x -> uint8 e8m0 code of a power of two next to x: the smallest power of
    two >= x ('up') or the largest <= x ('down'). Exact powers of two encode exactly; the
    exponent is clamped to [-127, 127] (x = 0 gives code 0)."""
    if rounding not in ("up", "down"):
        raise ValueError(f"e8m0_encode: rounding must be 'up' or 'down', got {rounding!r}")
    x = x.float()
    if bool((x < 0).any()) or bool(x.isnan().any()):
        raise ValueError("e8m0_encode: needs non-negative, non-NaN values")
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    floor_log2 = exp - 1
    if rounding == "up":
        e = torch.where(mant == 0.5, floor_log2, exp)
    else:
        e = floor_log2
    e = torch.where(x == 0, torch.full_like(e, -E8M0_BIAS), e)
    return (e.clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 code -> float32 2 ** (code - 127); code 255 -> NaN."""
    if code.dtype != torch.uint8:
        raise ValueError(f"e8m0_decode: needs uint8, got {code.dtype}")
    e = code.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(code == E8M0_NAN, torch.full_like(out, float("nan")), out)
