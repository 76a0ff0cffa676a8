"""Activation quantizers for the w8a8 formats: `quantize_act_ref` (pure PyTorch) and its fast
twin `quantize_act` (one Triton kernel), with the same signature and bit-identical results.

x [T, H] -> (q [T, H] in `dtype` (float8_e4m3fn or int8), scale float32), per scheme:
  'static_tensor'   scale given (one value), returned as given
  'dynamic_tensor'  scale [1] = max(amax(|x|), eps) / qmax over the whole tensor
  'token'           scale [T, 1], one per row
  'token_group'     scale [T, ceil(H / group_size)], one per row and group of columns (the last
                    group may be partial)
with q = clamp(x / scale, -qmax, qmax) rounded to nearest (ties to even) and x ~= q * scale.
qmax is 448 (fp8 e4m3) or 127 (int8); eps = 1e-10 keeps all-zero rows/groups finite (their
scale is eps / qmax and their values 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.quant.spec import ACT_SCHEMES, FP8_DTYPE, FP8_MAX, INT8_MAX

ACT_DTYPES = {FP8_DTYPE: FP8_MAX, torch.int8: INT8_MAX}
EPS = 1e-10


@dataclass(frozen=True)
class ActQuantTiles:
    """Launch shape of the kernel: at most `max_elems` values per program (several groups of a
    row); 'static_tensor'/'dynamic_tensor' tile rows by `static_block` columns.

    max_elems 1024 (8 groups of 128) against 4096, fp8 block-wise layers timed in turns on the
    H100 (scripts/gpu_probe_act_quant_tiles.py; benchmarks/triton_notes.md, session 30): at
    decode batches, where a row's one or two programs sat on the critical path between the
    GEMMs, the `triton` layer took 1.5-10% less at T = 1 (deepseek-v3 EP8 10%) and up to 3.4%
    at T = 4-64; at T = 4096 / 16384 the deep_gemm layers moved by -1.5 to +1.1%. 512 gained
    1-3% more at T = 1 but lost up to 40% on the kernel alone at T = 16384."""

    max_elems: int = 1024
    static_block: int = 1024
    num_warps: int = 4


TILES = ActQuantTiles()


def _check(x: torch.Tensor, scheme: str, dtype: torch.dtype, scale, group_size: int) -> float:
    if scheme not in ACT_SCHEMES:
        raise ValueError(f"activation scheme must be one of {', '.join(ACT_SCHEMES)}; got {scheme!r}")
    if dtype not in ACT_DTYPES:
        allowed = ", ".join(str(d) for d in ACT_DTYPES)
        raise ValueError(f"activation quant dtype must be one of {allowed}; got {dtype}")
    if not x.is_floating_point():
        raise ValueError(f"activation quant needs a float tensor, got {x.dtype}")
    if scheme == "static_tensor" and scale is None:
        raise ValueError("activation scheme 'static_tensor' needs the calibrated `scale`")
    if scheme in ("token", "token_group") and scale is not None:
        raise ValueError(f"activation scheme {scheme!r} computes its scales; do not pass `scale`")
    if scheme == "token_group" and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"token_group: group_size must be a positive integer, got {group_size!r}")
    return ACT_DTYPES[dtype]


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c correctly rounded on every device, as the kernel's div_rn (CUDA would multiply by
    the reciprocal of a Python scalar)."""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def tensor_scale(x: torch.Tensor, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
    """The 'dynamic_tensor' scale of x: [1] float32 = max(amax(|x|), eps) / qmax (eps if empty)."""
    qmax = ACT_DTYPES[dtype]
    amax = x.abs().amax().float().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
    return _div(amax.clamp_min(EPS), qmax)


def _round_cast(y: torch.Tensor, dtype: torch.dtype, qmax: float) -> torch.Tensor:
    y = y.clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)  # half to even
    return y.to(dtype)


def quantize_act_ref(
    x: torch.Tensor,
    scheme: str,
    dtype: torch.dtype = FP8_DTYPE,
    *,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: x [.., H] -> (q [.., H] dtype, scale float32) as in the module docstring.
    For the tensor schemes `scale` may be any float32 tensor broadcastable to x (e.g. one
    static scale per expert [E, 1, 1] for x [E, C, H])."""
    qmax = _check(x, scheme, dtype, scale, group_size)
    xf = x.float()
    if scheme in ("static_tensor", "dynamic_tensor"):
        s = tensor_scale(x, dtype) if scale is None else scale.float()
        return _round_cast(xf / s, dtype, qmax), s
    lead, H = x.shape[:-1], x.shape[-1]
    g = max(H, 1) if scheme == "token" else group_size
    n = -(-H // g)  # groups per row (the last may be partial)
    xg = torch.nn.functional.pad(xf, (0, n * g - H)).reshape(*lead, n, g)
    s = _div(xg.abs().amax(dim=-1).clamp_min(EPS), qmax)  # [.., n]
    q = _round_cast(xg / s[..., None], dtype, qmax).reshape(*lead, n * g)[..., :H]
    if scheme == "token" and n == 0:  # H = 0: still one scale per row
        s = xf.new_full((*lead, 1), EPS / qmax)
    return q, s


def dequantize_act(
    q: torch.Tensor, scale: torch.Tensor, scheme: str, *, group_size: int = 128
) -> torch.Tensor:
    """(q [.., H], scale) -> float32 [.., H] = q * scale (scales broadcast along their group)."""
    qf = q.float()
    if scheme in ("static_tensor", "dynamic_tensor", "token"):
        return qf * scale
    s = scale.repeat_interleave(group_size, dim=-1)[..., : q.shape[-1]]
    return qf * s


def fake_quantize_act(
    x: torch.Tensor,
    scheme: str,
    dtype: torch.dtype = FP8_DTYPE,
    *,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """dequantize(quantize(x)) in `out_dtype` (default x's dtype): the activations a w8a8
    kernel actually multiplies (used by the reference runner, in float32)."""
    q, s = quantize_act_ref(x, scheme, dtype, scale=scale, group_size=group_size)
    return dequantize_act(q, s, scheme, group_size=group_size).to(out_dtype or x.dtype)


def quantize_act(
    x: torch.Tensor,
    scheme: str,
    dtype: torch.dtype = FP8_DTYPE,
    *,
    scale: torch.Tensor | None = None,
    group_size: int = 128,
    out_dtype: torch.dtype | None = None,
    pdl: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `quantize_act_ref` for x [T, H] (float32/float16/bfloat16, last dim
    contiguous); tensor schemes need a one-value scale. 'dynamic_tensor' without a given
    scale: one small kernel takes partial amaxes per block of rows, and the quantizing kernel
    reduces them to the scale (two launches in all).

    out_dtype (default `dtype`): float32 returns the values just before the final cast (int8:
    already rounded; fp8: scaled and clamped). The Triton 3.6 CPU interpreter casts to fp8
    wrongly (ties away from zero, and a carry across a power of two halves the value), so the
    CPU tests check the fp8 path through float32 output; on a GPU the cast is exact.
    pdl: (wait, launch) flags of a programmatic dependent launch (`_act_kernels.launch_quant_rows`;
    the triton runner's decode pipelining)."""
    qmax = _check(x, scheme, dtype, scale, group_size)
    if x.dim() != 2:
        raise ValueError(f"quantize_act: x must be [T, H], got {list(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = dtype if out_dtype is None else out_dtype
    T, H = x.shape
    q = torch.empty(T, H, dtype=out_dtype, device=x.device)
    static = scheme in ("static_tensor", "dynamic_tensor")
    fused_amax = scheme == "dynamic_tensor" and scale is None and T > 0 and H > 0
    if fused_amax:
        s = torch.empty(1, device=x.device)  # written by the kernel from the partial amaxes
    elif static:
        s = tensor_scale(x, dtype) if scale is None else scale
    if static:
        if s.numel() != 1:
            raise ValueError(f"quantize_act: a tensor scale must hold one value, got {list(s.shape)}")
        s = s.float()
        static_s = s.reshape(1).contiguous()
        g = min(TILES.static_block, max(H, 1))
        s_out = torch.empty(1, 1, device=x.device)  # unused by the kernel
    else:
        g = max(H, 1) if scheme == "token" else group_size
        n = -(-H // g)
        s = s_out = torch.empty(T, max(n, 1) if scheme == "token" else n, device=x.device)
        static_s = s_out
    n_groups = -(-H // g)
    if T == 0 or H == 0:
        if scheme == "token":
            s.fill_(EPS / qmax)
        return q, s
    from moekit.quant._act_kernels import launch_amax_parts, launch_quant_rows

    part = launch_amax_parts(x) if fused_amax else None
    launch_quant_rows(
        x, q, s_out, static_s, g, n_groups, qmax, EPS, static, dtype == torch.int8, TILES, part,
        pdl,
    )
    return q, s


def _check_expert_rows(x, scale_E, num_rows, src_div, experts, expert_div, dtype) -> float:
    qmax = _check(x, "static_tensor", dtype, scale_E, 128)
    if x.dim() != 2:
        raise ValueError(f"quantize_expert_rows: x must be [T, H], got {list(x.shape)}")
    if scale_E.dim() != 1 or scale_E.numel() == 0 or scale_E.dtype != torch.float32:
        raise ValueError(f"quantize_expert_rows: scale_E must be float32 [E], E >= 1, got "
                         f"{scale_E.dtype} {list(scale_E.shape)}")  # fmt: skip
    for name, d in (("src_div", src_div), ("expert_div", expert_div)):
        if not isinstance(d, int) or d < 1:
            raise ValueError(f"quantize_expert_rows: {name} must be a positive integer, got {d!r}")
    if num_rows and -(-num_rows // src_div) > x.shape[0]:
        raise ValueError(f"quantize_expert_rows: {num_rows} rows read rows of x up to "
                         f"{(num_rows - 1) // src_div}; x has {x.shape[0]}")  # fmt: skip
    if experts is not None and (experts.dim() != 1 or experts.is_floating_point()
                                or experts.numel() < -(-num_rows // expert_div)):  # fmt: skip
        raise ValueError(f"quantize_expert_rows: experts must be an integer [>= "
                         f"{-(-num_rows // expert_div)}], got {experts.dtype} "
                         f"{list(experts.shape)}")  # fmt: skip
    return qmax


def expert_rows_ref(
    x: torch.Tensor, scale_E: torch.Tensor, num_rows: int, *, src_div: int = 1,
    experts: torch.Tensor | None = None, expert_div: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, H] float32, scales [R] float32) of `quantize_expert_rows`: row r is x[r //
    src_div] (0 where its expert is outside [0, E)) and its scale is scale_E[e], e = experts[r
    // expert_div] (None: r // expert_div) clamped into [0, E)."""
    r = torch.arange(num_rows, device=x.device)
    e = r // expert_div if experts is None else experts[r // expert_div].long()
    s = scale_E[e.clamp(0, scale_E.numel() - 1)]
    valid = (e >= 0) & (e < scale_E.numel())
    return x[r // src_div].float() * valid[:, None], s


def quantize_expert_rows_ref(
    x: torch.Tensor, scale_E: torch.Tensor, num_rows: int, *, src_div: int = 1,
    experts: torch.Tensor | None = None, expert_div: int = 1, dtype: torch.dtype = FP8_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `quantize_expert_rows`."""
    qmax = _check_expert_rows(x, scale_E, num_rows, src_div, experts, expert_div, dtype)
    rows, s = expert_rows_ref(x, scale_E, num_rows, src_div=src_div, experts=experts,
                              expert_div=expert_div)  # fmt: skip
    return _round_cast(rows / s[:, None], dtype, qmax), s


def quantize_expert_rows(
    x: torch.Tensor, scale_E: torch.Tensor, num_rows: int, *, src_div: int = 1,
    experts: torch.Tensor | None = None, expert_div: int = 1, dtype: torch.dtype = FP8_DTYPE,
    pdl: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor, torch.Tensor]:
    """'static_tensor' activations of a GEMM whose input rows belong to different experts,
    each quantized with its expert's calibrated scale: x [T, H], scale_E float32 [E] ->
    (q [num_rows, H] in `dtype`, s [num_rows] float32) with q[r] = clamp(x[r // src_div] / s[r],
    -qmax, qmax) rounded to nearest, s[r] = scale_E[e], e = experts[r // expert_div] (None:
    r // expert_div), clamped into [0, E). Rows whose expert is outside [0, E) (masked pairs,
    other EP ranks' experts: no GEMM reads them) are left unwritten (the reference: zeros). One
    Triton kernel (bit-identical to `quantize_expert_rows_ref` on the other rows; the reference
    runs on CPU for fp8: the interpreter casts to fp8 wrongly). pdl: as `quantize_act`."""
    qmax = _check_expert_rows(x, scale_E, num_rows, src_div, experts, expert_div, dtype)
    if x.device.type == "cpu" and dtype == FP8_DTYPE:
        return quantize_expert_rows_ref(x, scale_E, num_rows, src_div=src_div, experts=experts,
                                        expert_div=expert_div, dtype=dtype)  # fmt: skip
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(num_rows, x.shape[1], dtype=dtype, device=x.device)
    s = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, s
    from moekit.quant._act_kernels import launch_quant_expert_rows

    launch_quant_expert_rows(x, q, s, scale_E.contiguous(), experts, src_div, expert_div, qmax,
                             dtype == torch.int8, pdl)  # fmt: skip
    return q, s
