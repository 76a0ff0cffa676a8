"""The reference twins: `quantize(w, fmt)` and `dequantize(q)` in plain PyTorch (CPU or CUDA).

w is one weight [.., N, K] (leading dims, e.g. the expert dim E, are kept): N output rows, K the
input (reduction) dim. Scales are computed from the absolute maximum of their group (values round
to nearest, ties to even, and saturate); a group of zeros gets scale 1 (dequantizes to exact
zeros). Scales are rounded to their storage dtype before the values are quantized (int4 scales
round up, so the group's range stays covered), and `dequantize` reproduces exactly what was
meant. Layouts: see `moekit.quant.spec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.quant import packing
from moekit.quant.spec import (
    E2M1_MAX,
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    MXFP4,
    NVFP4,
    Fp8W8A8,
    Int4W4A16,
    Int8W8A8,
    Int8W8A16,
    QuantSpec,
    make_spec,
)


@dataclass
class QuantizedTensor:
    """One quantized weight of logical shape `shape` = [.., N, K] in format `spec`.

    data [.., N, K / pack], scale (shape per format), zero (int4 asymmetric) [.., N, K/g] uint8,
    global_scale (nvfp4) [..] float32."""

    data: torch.Tensor
    scale: torch.Tensor
    spec: QuantSpec
    shape: tuple[int, ...]
    zero: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        if len(self.shape) < 2:
            raise ValueError(f"a quantized weight is [.., N, K]; got shape {list(self.shape)}")
        *lead, N, K = self.shape
        self.spec.check_tensors(
            tuple(lead), N, K, self.data, self.scale, self.zero, self.global_scale, "weight"
        )

    @property
    def lead(self) -> tuple[int, ...]:
        return self.shape[:-2]

    def __getitem__(self, i: int) -> "QuantizedTensor":
        """Index i of the first leading dim (expert i's [N, K] of an [E, N, K] weight)."""
        if not self.lead:
            raise IndexError(f"a quantized weight of shape {list(self.shape)} has no leading dim")
        pick = lambda t: None if t is None else t[i]  # noqa: E731
        return QuantizedTensor(self.data[i], self.scale[i], self.spec, self.shape[1:],
                               pick(self.zero), pick(self.global_scale))  # fmt: skip

    def nbytes(self) -> int:
        """Bytes of data + scales + zeros + global scales (what a kernel reads)."""
        ts = (self.data, self.scale, self.zero, self.global_scale)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c correctly rounded on every device (CUDA turns a division by a Python scalar into a
    multiplication by its reciprocal, one ulp off the CPU result)."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def _safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax in float32, with 1 where that is 0 (a group of zeros)."""
    s = _div(amax.float(), qmax)
    return torch.where(s > 0, s, torch.ones_like(s))


def _round_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s (float32, > 0) in `dtype`, rounded up so that the group's range stays covered."""
    r = s.to(dtype)
    r = torch.where(r.float() < s, torch.nextafter(r, torch.full_like(r, float("inf"))), r)
    if not bool(torch.isfinite(r).all()):
        raise ValueError(
            f"int4_w4a16: a group scale of {s.max().item():.3g} overflows scale_dtype {dtype}; "
            "use scale_dtype torch.bfloat16 or torch.float32"
        )
    return r


def _groups(w: torch.Tensor, g: int) -> torch.Tensor:
    """[.., N, K] -> [.., N, K/g, g] (g divides K)."""
    return w.reshape(*w.shape[:-1], w.shape[-1] // g, g)


def _expand_blocks(s: torch.Tensor, bn: int, bk: int, N: int, K: int) -> torch.Tensor:
    """[.., nb, kb] block scales -> [.., N, K] (edge blocks cut)."""
    s = s.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return s[..., :N, :K]


def _block_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """max |w| per [bn, bk] block of [.., N, K] -> [.., ceil(N/bn), ceil(K/bk)]."""
    *lead, N, K = w.shape
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    a = w.abs().float()
    a = torch.nn.functional.pad(a, (0, kb * bk - K, 0, nb * bn - N))
    return a.reshape(*lead, nb, bn, kb, bk).amax(dim=(-3, -1))


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize(w: torch.Tensor, fmt: str | QuantSpec, **params) -> QuantizedTensor:
    """Quantize w [.., N, K] (float; N, K >= 1) to format `fmt` (a name, with optional spec
    parameters, or a QuantSpec). Returns a QuantizedTensor."""
    spec = make_spec(fmt, **params)
    if spec is None:
        raise ValueError("quantize: format 'unquantized' has nothing to quantize")
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"quantize: needs a float tensor [.., N, K], got {w.dtype} {list(w.shape)}")
    *lead, N, K = w.shape
    spec.check_k(N, K)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize: the weight has NaN or inf values")
    if not lead:
        return _quantize_matrix(w, spec)
    # Every scale is per matrix or finer, so one matrix (expert) at a time gives the same result
    # with a fraction of the float32 temporaries (gigabytes for a whole preset layer).
    parts = [_quantize_matrix(m, spec) for m in w.reshape(-1, N, K)]

    def stacked(name: str) -> torch.Tensor | None:
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.stack(ts).reshape(*lead, *ts[0].shape)

    return QuantizedTensor(
        stacked("data"), stacked("scale"), spec, (*lead, N, K), stacked("zero"),
        stacked("global_scale"),
    )


def _quantize_matrix(w: torch.Tensor, spec: QuantSpec) -> QuantizedTensor:
    """quantize() of one matrix w [N, K]."""
    *lead, N, K = w.shape
    w = w.float()
    zero = global_scale = None
    if isinstance(spec, Fp8W8A8):
        if spec.weight_scale == "tensor":
            scale = _safe_scale(w.abs().amax(dim=(-2, -1)), FP8_MAX)
            data = _fp8(w / scale[..., None, None])
        elif spec.weight_scale == "channel":
            scale = _safe_scale(w.abs().amax(dim=-1), FP8_MAX)
            data = _fp8(w / scale[..., None])
        else:
            bn, bk = spec.block_shape
            scale = _safe_scale(_block_amax(w, bn, bk), FP8_MAX)
            data = _fp8(w / _expand_blocks(scale, bn, bk, N, K))
    elif isinstance(spec, (Int8W8A8, Int8W8A16)):
        scale = _safe_scale(w.abs().amax(dim=-1), INT8_MAX)
        data = torch.round(w / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif isinstance(spec, Int4W4A16):
        wg = _groups(w, spec.group_size)
        if spec.symmetric:
            scale = _round_up(_safe_scale(wg.abs().amax(dim=-1), 7.0), spec.scale_dtype)
            q = torch.round(wg / scale.float()[..., None]).clamp(-8, 7) + 8
        else:
            lo = wg.amin(dim=-1).clamp(max=0)
            hi = wg.amax(dim=-1).clamp(min=0)
            scale = _round_up(_safe_scale(hi - lo, 15.0), spec.scale_dtype)
            s = scale.float()
            zero = torch.round(-lo / s).clamp(0, 15)
            q = torch.round(wg / s[..., None]) + zero[..., None]
            zero = zero.to(torch.uint8)
        data = packing.pack_uint4(q.clamp(0, 15).reshape(*lead, N, K))
    elif isinstance(spec, MXFP4):
        wg = _groups(w, spec.group_size)
        scale = packing.e8m0_encode(_div(wg.abs().amax(dim=-1), E2M1_MAX), rounding="up")
        s = packing.e8m0_decode(scale)
        data = packing.pack_uint4(packing.e2m1_encode(wg / s[..., None]).reshape(*lead, N, K))
    elif isinstance(spec, NVFP4):
        global_scale = _safe_scale(w.abs().amax(dim=(-2, -1)), E2M1_MAX * FP8_MAX)
        wg = _groups(w, spec.group_size)
        g = global_scale[..., None, None]
        scale = _fp8(_div(wg.abs().amax(dim=-1), E2M1_MAX) / g)
        eff = scale.float() * g  # the multiplier dequantize will use
        safe = torch.where(eff > 0, eff, torch.ones_like(eff))[..., None]
        codes = packing.e2m1_encode(torch.where(eff[..., None] > 0, wg / safe, 0.0))
        data = packing.pack_uint4(codes.reshape(*lead, N, K))
    else:  # pragma: no cover - every spec class is handled above
        raise NotImplementedError(spec.name)
    return QuantizedTensor(data, scale, spec, (*lead, N, K), zero, global_scale)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """QuantizedTensor -> w [.., N, K] in `dtype`, computed in float32 (float64 if asked)."""
    spec = q.spec
    *lead, N, K = q.shape
    f = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(spec, Fp8W8A8):
        s = q.scale.to(f)
        if spec.weight_scale == "tensor":
            s = s[..., None, None]
        elif spec.weight_scale == "channel":
            s = s[..., None]
        else:
            s = _expand_blocks(s, *spec.block_shape, N, K)
        w = q.data.to(f) * s
    elif isinstance(spec, (Int8W8A8, Int8W8A16)):
        w = q.data.to(f) * q.scale.to(f)[..., None]
    elif isinstance(spec, Int4W4A16):
        v = _groups(packing.unpack_uint4(q.data).to(f), spec.group_size)
        dev = q.data.device
        z = q.zero.to(f) if q.zero is not None else torch.full((), 8.0, dtype=f, device=dev)
        w = ((v - z[..., None]) * q.scale.to(f)[..., None]).reshape(*lead, N, K)
    elif isinstance(spec, (MXFP4, NVFP4)):
        v = _groups(packing.e2m1_decode(packing.unpack_uint4(q.data)).to(f), spec.group_size)
        if isinstance(spec, MXFP4):
            s = packing.e8m0_decode(q.scale).to(f)
        else:
            s = q.scale.to(f) * q.global_scale.to(f)[..., None, None]
        w = (v * s[..., None]).reshape(*lead, N, K)
    else:  # pragma: no cover
        raise NotImplementedError(spec.name)
    return w.to(dtype)
