"""Checkpoint conventions -> QuantizedTensor in our layout (`moekit.quant.spec`).

Each loader takes the tensors of one weight (any leading dims, e.g. an expert dim) as a
checkpoint stores them and converts them without loss:

  fp8 (DeepSeek-V3)  weight float8_e4m3fn [.., N, K], weight_scale_inv float32
                     [.., ceil(N/128), ceil(K/128)] (a multiplier despite its name); per-tensor
                     (weight_scale [..] or [.., 1]) and per-channel ([.., N] or [.., N, 1]) too
  int8               weight int8 [.., N, K], weight_scale [.., N] or [.., N, 1]
  GPTQ int4          qweight int32 [.., K/8, N]: k = 8r + i in bits 4i..4i+3 of row r;
                     qzeros int32 [.., K/g, N/8] likewise along N, stored minus `zero_offset`
                     (1 in GPTQ 'v1' checkpoints, 0 in 'v2'); scales [.., K/g, N];
                     g_idx [.., K] must be k // g (act-order checkpoints are not supported)
  AWQ int4           qweight int32 [.., K, N/8]: nibble i of word c holds column 8c + AWQ_ORDER[i];
                     qzeros int32 [.., K/g, N/8] likewise; scales [.., K/g, N]; w = (q - z) * s
  gpt-oss mxfp4      *_blocks uint8 [.., N, K/32, 16] (low nibble first, as ours),
                     *_scales uint8 e8m0 [.., N, K/32]

  nvfp4 (ModelOpt)   weight uint8 [.., N, K/2], weight_scale float8_e4m3fn [.., N, K/16],
                     weight_scale_2 float32 [..]
  compressed-tensors weight_packed int32 [.., N, ceil(K*b/32)]: k = (32/b) c + i in bits
  pack-quantized     b*i..b*i+b-1 of word c, stored plus 2^(b-1); weight_shape [.., 2] = [N, K];
                     4 bits: weight_scale [.., N, K/g], weight_zero_point (asymmetric) int32
                     [.., ceil(N/8), K/g] packed likewise along N; weight_g_idx [.., K] must be
                     k // g; 8 bits (weight-only int8): weight_scale [.., N, 1]

int4 checkpoints whose zero points are all 8 load as the symmetric spec (no zero tensor).
`load_weight` finds one weight's convention from the keys and dtypes of a state dict;
`narrow` cuts a tensor-parallel slice; `cat_rows` and `stack` assemble per-expert tensors
(gate + up -> w13, experts -> [E, ..]).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from moekit.quant import packing
from moekit.quant.quantize import QuantizedTensor, dequantize, quantize
from moekit.quant.spec import (
    FP8_DTYPE,
    INT4_GROUP_SIZES,
    MXFP4,
    NVFP4,
    SCALE_DTYPES,
    Fp8W8A8,
    Int4W4A16,
    Int8W8A8,
    Int8W8A16,
)

# The keys under a weight's name that hold it: plain / fp8 / int8 / nvfp4, GPTQ / AWQ, and
# compressed-tensors pack-quantized
STORED_WEIGHT_SUFFIXES = (".weight", ".qweight", ".weight_packed")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def _unpack_int32(w: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..] -> int32 [.., 32 / bits]: field i (bits bits*i .. bits*i + bits - 1) at i."""
    if w.dtype != torch.int32:
        raise ValueError(f"packed int{bits} checkpoint tensors must be int32, got {w.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    return (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _float32(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    return t.float()


def load_fp8(
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    activation_scheme: str | None = None,
) -> QuantizedTensor:
    """fp8 e4m3 weight [.., N, K] and its scale (a multiplier) -> QuantizedTensor. The scale
    granularity is read from its shape: [..] / [.., 1] per tensor, [.., N] / [.., N, 1] per
    channel, [.., ceil(N/128), ceil(K/128)] block-wise (the DeepSeek-V3 `weight_scale_inv`)."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 weight must be {FP8_DTYPE} (e4m3fn), got {weight.dtype}")
    *lead, N, K = weight.shape
    lead = tuple(lead)
    s = _float32("fp8 weight scale", scale)
    bn, bk = 128, 128
    block = lead + (math.ceil(N / bn), math.ceil(K / bk))
    if tuple(s.shape) in (lead, lead + (1,)):  # (for N = 1, per tensor is per channel)
        kind, s = "tensor", s.reshape(lead)
    elif tuple(s.shape) in (lead + (N,), lead + (N, 1)):
        kind, s = "channel", s.reshape(lead + (N,))
    elif tuple(s.shape) == block:
        kind = "block"
    else:
        raise ValueError(
            f"fp8 weight scale for weight {list(weight.shape)} must be per tensor {list(lead)}, "
            f"per channel {list(lead + (N,))} or block-wise [128, 128] {list(block)}; "
            f"got {list(scale.shape)}"
        )
    spec = Fp8W8A8(kind, (bn, bk), activation_scheme)
    return QuantizedTensor(weight, s.contiguous(), spec, weight.shape)


def load_int8(
    weight: torch.Tensor, weight_scale: torch.Tensor, *, weight_only: bool = False
) -> QuantizedTensor:
    """int8 weight [.., N, K] with per-channel scale [.., N] or [.., N, 1] -> int8_w8a8 (or
    int8_w8a16 when weight_only)."""
    if weight.dtype != torch.int8:
        raise ValueError(f"int8 weight must be int8, got {weight.dtype}")
    *lead, N, K = weight.shape
    s = _float32("int8 weight_scale", weight_scale)
    if tuple(s.shape) not in (tuple(lead) + (N,), tuple(lead) + (N, 1)):
        raise ValueError(
            f"int8 weight_scale must be per channel {lead + [N]} or {lead + [N, 1]}, "
            f"got {list(weight_scale.shape)}"
        )
    spec = Int8W8A16() if weight_only else Int8W8A8()
    return QuantizedTensor(weight, s.reshape(*lead, N).contiguous(), spec, weight.shape)


def _int4(q_NK: torch.Tensor, z_NG: torch.Tensor, scales_NG: torch.Tensor, K: int):
    """Unpacked values [.., N, K], zeros [.., N, G], scales [.., N, G] -> QuantizedTensor."""
    G = z_NG.shape[-1]
    if G == 0 or K % G or K // G not in INT4_GROUP_SIZES:
        raise ValueError(
            f"int4 checkpoint: K = {K} with {G} scale groups gives group size "
            f"{K / G if G else 'undefined'}; supported group sizes: {INT4_GROUP_SIZES}"
        )
    scale_dtype = scales_NG.dtype if scales_NG.dtype in SCALE_DTYPES else torch.float32
    symmetric = bool((z_NG == 8).all())
    spec = Int4W4A16(K // G, symmetric, scale_dtype)
    zero = None if symmetric else z_NG.to(torch.uint8).contiguous()
    data = packing.pack_uint4(q_NK)
    return QuantizedTensor(data, scales_NG.to(scale_dtype).contiguous(), spec, q_NK.shape, zero)


def _check_g_idx(what: str, g_idx: torch.Tensor | None, K: int, G: int) -> None:
    """ValueError unless g_idx [.., K] is None or k // (K / G) (no act-order permutation)."""
    if g_idx is None:
        return
    trivial = torch.arange(K, device=g_idx.device) // max(K // G if G else 0, 1)
    if tuple(g_idx.shape[-1:]) != (K,) or not bool((g_idx.long() == trivial).all()):
        raise ValueError(f"{what} is not k // group_size (an act-order checkpoint); only "
                         "trivial g_idx is supported")  # fmt: skip


def load_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    zero_offset: int = 1,
) -> QuantizedTensor:
    """GPTQ 4-bit tensors (see the module docstring) -> int4_w4a16 QuantizedTensor [.., N, K]."""
    if zero_offset not in (0, 1):
        raise ValueError(f"load_gptq: zero_offset must be 0 (GPTQ v2) or 1 (v1), got {zero_offset}")
    *lead, K8, N = qweight.shape
    K = K8 * 8
    G = scales.shape[-2]
    if tuple(scales.shape) != (*lead, G, N) or tuple(qzeros.shape) != (*lead, G, N // 8) or N % 8:
        raise ValueError(
            f"GPTQ: qweight {list(qweight.shape)} needs scales [.., K/g, N] = [.., G, {N}] and "
            f"qzeros [.., G, N/8]; got scales {list(scales.shape)}, qzeros {list(qzeros.shape)}"
        )
    _check_g_idx("GPTQ: g_idx", g_idx, K, G)
    q = _unpack_int32(qweight).transpose(-1, -2).reshape(*lead, K, N).transpose(-1, -2)
    z = (_unpack_int32(qzeros).reshape(*lead, G, N) + zero_offset) & 0xF
    return _int4(q, z.transpose(-1, -2), scales.transpose(-1, -2), K)


def load_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """AWQ 4-bit tensors (see the module docstring) -> int4_w4a16 QuantizedTensor [.., N, K]."""
    *lead, K, N8 = qweight.shape
    N = N8 * 8
    G = scales.shape[-2]
    if tuple(scales.shape) != (*lead, G, N) or tuple(qzeros.shape) != (*lead, G, N8):
        raise ValueError(
            f"AWQ: qweight {list(qweight.shape)} needs scales [.., K/g, N] = [.., G, {N}] and "
            f"qzeros [.., G, N/8]; got scales {list(scales.shape)}, qzeros {list(qzeros.shape)}"
        )
    reverse = [AWQ_ORDER.index(j) for j in range(8)]  # column j of a word is in nibble reverse[j]

    def unpack(t):  # [.., R, N/8] -> [.., R, N]
        nib = _unpack_int32(t)[..., reverse]
        return nib.reshape(*t.shape[:-1], t.shape[-1] * 8)

    q, z = unpack(qweight), unpack(qzeros)
    return _int4(q.transpose(-1, -2), z.transpose(-1, -2), scales.transpose(-1, -2), K)


def load_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    *,
    int8_weight_only: bool = True,
) -> QuantizedTensor:
    """compressed-tensors pack-quantized tensors (module docstring) -> int4_w4a16 [.., N, K]
    (4 bits, group scales) or int8 [.., N, K] (8 bits, per channel; int8_w8a16 unless not
    `int8_weight_only`); the bit width is read from weight_shape's K against the packed words."""
    shape = weight_shape.reshape(-1, 2)
    if shape.shape[0] == 0 or not bool((shape == shape[0]).all()):
        raise ValueError(f"pack-quantized: weight_shape must hold one [N, K], got "
                         f"{weight_shape.tolist()}")  # fmt: skip
    N, K = (int(v) for v in shape[0])
    *lead, N_, P = weight_packed.shape
    bits = next((b for b in (4, 8) if P == -(-K * b // 32)), None)
    if N_ != N or bits is None:
        raise ValueError(
            f"pack-quantized: weight_packed {list(weight_packed.shape)} does not hold "
            f"weight_shape [{N}, {K}] as 4-bit ([.., N, ceil(K/8)]) or 8-bit ([.., N, ceil(K/4)])"
        )
    values = _unpack_int32(weight_packed, bits).reshape(*lead, N, -1)[..., :K]
    if bits == 8:
        if weight_zero_point is not None or weight_g_idx is not None:
            raise ValueError("pack-quantized 8-bit weights with a weight_zero_point or "
                             "weight_g_idx: moekit reads symmetric per-channel int8")  # fmt: skip
        return load_int8((values - 128).to(torch.int8), weight_scale,
                         weight_only=int8_weight_only)  # fmt: skip
    G = weight_scale.shape[-1]
    if tuple(weight_scale.shape) != (*lead, N, G):
        raise ValueError(f"pack-quantized: weight_scale must be [.., N, K/g] = [.., {N}, G], got "
                         f"{list(weight_scale.shape)}")  # fmt: skip
    _check_g_idx("pack-quantized: weight_g_idx", weight_g_idx, K, G)
    if weight_zero_point is None:
        zeros = torch.full_like(weight_scale, 8, dtype=torch.int32)
    elif tuple(weight_zero_point.shape) == (*lead, -(-N // 8), G):  # packed along N
        z = _unpack_int32(weight_zero_point).transpose(-1, -2)  # [.., N/8, 8, G]
        zeros = z.reshape(*lead, -1, G)[..., :N, :]
    elif tuple(weight_zero_point.shape) == (*lead, N, G) and (
        not weight_zero_point.is_floating_point()
    ):
        zeros = weight_zero_point.to(torch.int32) + 8  # stored unpacked, signed
    else:
        raise ValueError(
            f"pack-quantized: weight_zero_point must be int32 [.., ceil(N/8), G] = "
            f"[.., {-(-N // 8)}, {G}] (packed) or integer [.., N, G]; got "
            f"{weight_zero_point.dtype} {list(weight_zero_point.shape)}"
        )
    return _int4(values, zeros, weight_scale, K)


def load_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedTensor:
    """gpt-oss `*_blocks` uint8 [.., N, K/32, 16] and `*_scales` uint8 [.., N, K/32] ->
    mxfp4 QuantizedTensor [.., N, K]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(scales.shape) != blocks.shape[:-1]:
        raise ValueError(
            f"mxfp4: blocks must be [.., N, K/32, 16] and scales [.., N, K/32]; got blocks "
            f"{list(blocks.shape)}, scales {list(scales.shape)}"
        )
    *lead, N, G, _ = blocks.shape
    data = blocks.reshape(*lead, N, G * 16)
    return QuantizedTensor(data.contiguous(), scales.contiguous(), MXFP4(), (*lead, N, G * 32))


def load_nvfp4(
    weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor
) -> QuantizedTensor:
    """NVIDIA ModelOpt nvfp4: weight uint8 [.., N, K/2] (two e2m1 per byte, low nibble first),
    weight_scale float8_e4m3fn [.., N, K/16] (linear, not swizzled), weight_scale_2 float32
    global scale [..] or [.., 1] (a multiplier) -> nvfp4 QuantizedTensor [.., N, K]."""
    if weight.dtype != torch.uint8 or weight_scale.dtype != FP8_DTYPE:
        raise ValueError(
            f"nvfp4: weight must be uint8 and weight_scale {FP8_DTYPE}; got {weight.dtype} and "
            f"{weight_scale.dtype}"
        )
    *lead, N, K2 = weight.shape
    g = _float32("nvfp4 weight_scale_2", weight_scale_2)
    if tuple(g.shape) not in (tuple(lead), tuple(lead) + (1,)):
        raise ValueError(f"nvfp4: weight_scale_2 must be {lead} or {lead + [1]}, got {list(g.shape)}")
    g = g.reshape(tuple(lead)).contiguous()
    return QuantizedTensor(weight, weight_scale, NVFP4(), (*lead, N, 2 * K2), None, g)


def _cat_scale_dim(q: QuantizedTensor) -> int:
    """The dim of q.scale that follows N (None-able formats excluded)."""
    return -1 if q.scale.dim() == len(q.lead) + 1 else -2


def cat_rows(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Concatenate along N (e.g. gate [.., I, K] and up [.., I, K] -> w13 [.., 2I, K]).
    Formats with per-row scales concatenate exactly; fp8 per-tensor, nvfp4 with different
    global scales and fp8 blocks not aligned to 128 rows are requantized to one scale (what
    the serving engines do), which rounds the parts with the smaller scale once more."""
    spec = parts[0].spec
    *lead, _, K = parts[0].shape
    for p in parts:
        if p.spec != spec or tuple(p.shape[:-2]) != tuple(lead) or p.shape[-1] != K:
            raise ValueError("cat_rows: the parts must share format, leading dims and K")
    N = sum(p.shape[-2] for p in parts)
    fp8_tensor = isinstance(spec, Fp8W8A8) and spec.weight_scale == "tensor"
    block_misaligned = (
        isinstance(spec, Fp8W8A8)
        and spec.weight_scale == "block"
        and any(p.shape[-2] % spec.block_shape[0] for p in parts[:-1])
    )
    same_global = all(
        p.global_scale is None or torch.equal(p.global_scale, parts[0].global_scale) for p in parts
    )
    same_tensor_scale = fp8_tensor and all(torch.equal(p.scale, parts[0].scale) for p in parts)
    if (fp8_tensor and not same_tensor_scale) or block_misaligned or not same_global:
        w = torch.cat([dequantize(p) for p in parts], dim=-2)
        return quantize(w, spec)
    data = torch.cat([p.data for p in parts], dim=-2)
    if fp8_tensor:
        scale = parts[0].scale
    else:
        scale = torch.cat([p.scale for p in parts], dim=_cat_scale_dim(parts[0]))
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts], dim=-2)
    return QuantizedTensor(data, scale, spec, (*lead, N, K), zero, parts[0].global_scale)


def stack(parts: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """Stack same-shaped quantized weights along a new leading dim (experts -> [E, ..])."""
    first = parts[0]
    for p in parts:
        if p.spec != first.spec or p.shape != first.shape:
            raise ValueError("stack: the parts must share format and shape")

    def st(name):
        ts = [getattr(p, name) for p in parts]
        return None if ts[0] is None else torch.stack(ts)

    return QuantizedTensor(
        st("data"), st("scale"), first.spec, (len(parts), *first.shape), st("zero"),
        st("global_scale"),
    )


def _groups(q: QuantizedTensor) -> tuple[int, int]:
    """(rows, columns) that share one scale along N and along K: a cut must fall between
    groups. A per-tensor scale spans everything (0: any cut keeps it whole)."""
    spec = q.spec
    if isinstance(spec, Fp8W8A8):
        return {"tensor": (0, 0), "channel": (1, 0), "block": spec.block_shape}[spec.weight_scale]
    if isinstance(spec, (Int8W8A8, Int8W8A16)):
        return 1, 0
    return 1, spec.group_size  # int4, mxfp4, nvfp4: [.., N, K/g]


def narrow(q: QuantizedTensor, dim: int, start: int, length: int) -> QuantizedTensor:
    """Rows (dim -2) or columns (dim -1) [start, start + length) of q [.., N, K], scales
    and zero points with them, without requantizing (a tensor-parallel rank's share). The cut
    must fall on the format's scale groups (128 rows / columns of block fp8, g columns of int4,
    32 of mxfp4, 16 of nvfp4); a partial last group is kept whole."""
    if dim not in (-2, -1):
        raise ValueError(f"narrow: dim must be -2 (rows, N) or -1 (columns, K), got {dim}")
    size = q.shape[dim]
    end = start + length
    if start < 0 or length < 0 or end > size:
        raise ValueError(f"narrow: [{start}, {end}) is outside [0, {size}) of {list(q.shape)}")
    group = _groups(q)[dim + 2]
    what = "rows" if dim == -2 else "columns"
    if group > 1 and (start % group or (end % group and end != size)):
        raise ValueError(
            f"cannot cut {what} [{start}, {end}) out of a {q.spec.describe()} weight "
            f"{list(q.shape)}: its scales cover groups of {group} {what}; a tensor-parallel "
            f"split needs I / moe_tp_size to be a multiple of {group}"
        )
    lead = len(q.lead)
    pack = q.spec.pack_factor if dim == -1 else 1
    data = q.data.narrow(dim, start // pack, length // pack)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        """A scale / zero tensor: cut along the dim that follows `dim`'s groups, if any."""
        if t is None or group == 0:
            return t
        t_dim = lead + (dim + 2 if t.dim() == lead + 2 else 0)
        first = start // group
        return t.narrow(t_dim, first, math.ceil(end / group) - first)

    shape = (*q.shape[:-2], *(length if d == dim + 2 else q.shape[d - 2] for d in (0, 1)))
    return QuantizedTensor(data, cut(q.scale), q.spec, shape, cut(q.zero), q.global_scale)


def _input_scale(sd: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The static activation scale `{name}.input_scale` (one value) as float32 [], or None."""
    t = sd.get(name + ".input_scale")
    if t is None:
        return None
    if t.numel() != 1:
        raise ValueError(f"{name}.input_scale must hold one value, got shape {list(t.shape)}")
    return _float32(name + ".input_scale", t).reshape(())


def load_weight(
    sd: Mapping[str, torch.Tensor],
    name: str,
    *,
    gptq_zero_offset: int = 1,
    fp8_activation_scheme: str | None = None,
    int8_weight_only: bool | None = None,
) -> tuple[QuantizedTensor, torch.Tensor | None] | None:
    """The quantized weight `name` of a state dict (e.g. 'experts.3.gate_proj') from the keys
    under it, and its fp8 static activation scale `{name}.input_scale` ([] float32) or None.
    None when `{name}.weight` is a plain float tensor (unquantized). The convention is read from
    the keys and dtypes: fp8 `.weight` with `.weight_scale_inv` or `.weight_scale`; int8
    `.weight` with `.weight_scale`; nvfp4 uint8 `.weight` with `.weight_scale` and
    `.weight_scale_2`; GPTQ / AWQ `.qweight`, `.qzeros`, `.scales` (GPTQ's `.g_idx`), told
    apart by qweight's layout; compressed-tensors `.weight_packed`, `.weight_scale`,
    `.weight_shape` (and `.weight_zero_point`, `.weight_g_idx`). nvfp4's `.input_scale` (an fp4
    activation scale) is not read: nvfp4 runs weight-only here. What the tensors cannot show
    comes from the checkpoint's config: an fp8 weight with an input_scale takes static
    activation scales, one without takes `fp8_activation_scheme` (None: its scale's usual
    partner); int8 `.weight` is int8_w8a8 unless `int8_weight_only` (packed int8 is
    weight-only unless it is False)."""
    if not any(name + s in sd for s in STORED_WEIGHT_SUFFIXES):
        return None
    weight, packed = sd.get(name + ".weight"), sd.get(name + ".weight_packed")
    if weight is not None and weight.is_floating_point() and weight.dtype != FP8_DTYPE:
        return None

    def need(suffix: str) -> torch.Tensor:
        if name + suffix not in sd:
            raise KeyError(f"state dict has no {name + suffix!r} (the weight is quantized)")
        return sd[name + suffix]

    if packed is not None:
        return load_packed(packed, need(".weight_scale"), need(".weight_shape"),
                           sd.get(name + ".weight_zero_point"), sd.get(name + ".weight_g_idx"),
                           int8_weight_only=int8_weight_only is not False), None
    if weight is None:
        qweight, qzeros, scales = need(".qweight"), need(".qzeros"), need(".scales")
        if qweight.shape[-1] == scales.shape[-1]:  # GPTQ: [K/8, N]; AWQ: [K, N/8]
            return load_gptq(qweight, qzeros, scales, sd.get(name + ".g_idx"),
                             zero_offset=gptq_zero_offset), None  # fmt: skip
        return load_awq(qweight, qzeros, scales), None
    if weight.dtype == FP8_DTYPE:
        static = _input_scale(sd, name)
        scheme = "static_tensor" if static is not None else fp8_activation_scheme
        if name + ".weight_scale_inv" in sd:
            return load_fp8(weight, sd[name + ".weight_scale_inv"],
                            activation_scheme=scheme), static  # fmt: skip
        return load_fp8(weight, need(".weight_scale"), activation_scheme=scheme), static
    if weight.dtype == torch.int8:
        return load_int8(weight, need(".weight_scale"), weight_only=bool(int8_weight_only)), None
    if weight.dtype == torch.uint8 and name + ".weight_scale_2" in sd:
        return load_nvfp4(weight, need(".weight_scale"), sd[name + ".weight_scale_2"]), None
    raise ValueError(
        f"{name}.weight is {weight.dtype} {list(weight.shape)}: not a weight format moekit reads "
        "(float, fp8 e4m3fn, int8, nvfp4 uint8 with weight_scale_2, GPTQ / AWQ qweight, or "
        "compressed-tensors weight_packed)"
    )


__all__ = [
    "AWQ_ORDER",
    "STORED_WEIGHT_SUFFIXES",
    "cat_rows",
    "load_awq",
    "load_fp8",
    "load_gptq",
    "load_int8",
    "load_mxfp4_blocks",
    "load_nvfp4",
    "load_packed",
    "load_weight",
    "narrow",
    "stack",
]
