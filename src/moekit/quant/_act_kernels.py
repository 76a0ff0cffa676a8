"""Triton kernel behind `moekit.quant.act_quant.quantize_act` (private: use the wrapper), and
`div_by_scale`, the division by a dynamic scale that every kernel quantizing activations shares."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def div_by_scale(x, s):
    """x / s rounded to nearest, as `tl.div_rn(x, s)`, with one division per scale instead of
    one per value (which took a quarter of an fp8 activation kernel's instructions), for a
    dynamic scale s = max(amax |x's group|, eps) / qmax broadcast over its group, so that s is
    normal and |x / s| <= qmax: q = x * (1 / s), corrected by its fma residual (Markstein).
    It differs from div_rn only where |x| < 2^-100 or x / s is subnormal (the residual
    underflows), far below the smallest fp8 or int8 step: the quantized values are the same."""
    r = tl.div_rn(1.0, s)
    q = x * r
    return tl.fma(-tl.fma(q, s, -x), r, q)  # the residual x - q s, so that x = -0 gives -0


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_s_ptr,
    H,
    group_size,
    n_groups,
    stride_xt,
    stride_qt,
    stride_st,
    qmax,
    eps,
    part_ptr,
    n_part,
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
    ROUND_INT: tl.constexpr,
    NPART: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,
    GDC_LAUNCH: tl.constexpr = False,
):
    """One program: row t (axis 0), groups [BLOCK_G * pid1, +BLOCK_G) of `group_size` columns.

    Dynamic: s = max(amax(|x_group|), eps) / qmax is written to s[t, g]; STATIC: s is the one
    value at static_s_ptr. q = clamp(x / s, -qmax, qmax), rounded half to even when ROUND_INT
    (int8), then cast to q's dtype (the cast rounds for fp8). NPART > 0 (STATIC): the one scale
    is max(max(part[0:n_part]), eps) / qmax from the partial amaxes of `_amax_rows_kernel`
    (written to static_s by program (0, 0)), instead of a given value. GDC_LAUNCH / GDC_WAIT:
    the programmatic dependent launch flags of `launch_quant_rows`."""
    if GDC_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK)
    col = g[:, None] * group_size + j[None, :]
    mask = (g[:, None] < n_groups) & (j[None, :] < group_size) & (col < H)
    x = tl.load(x_ptr + t * stride_xt + col, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        if NPART > 0:
            offs = tl.arange(0, NPART)
            amax = tl.max(tl.load(part_ptr + offs, mask=offs < n_part, other=0.0), 0)
            s = tl.div_rn(tl.maximum(amax, eps), qmax)
            first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
            tl.store(static_s_ptr, s, mask=first)
        else:
            s = tl.load(static_s_ptr).to(tl.float32)
        y = tl.div_rn(x, s)  # not div_by_scale: a static scale does not bound x / s
    else:
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.div_rn(tl.maximum(amax, eps), qmax)
        tl.store(s_ptr + t * stride_st + g, s, mask=g < n_groups)
        y = div_by_scale(x, s[:, None])
    y = _clamp_round(y, qmax, ROUND_INT)
    tl.store(q_ptr + t * stride_qt + col, y.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _clamp_round(y, qmax, ROUND_INT: tl.constexpr):
    """y clamped to [-qmax, qmax]; ROUND_INT: rounded to an integer, half to even (int8)."""
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if ROUND_INT:
        r = tl.floor(y + 0.5)
        half_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
        y = tl.where(half_odd, r - 1.0, r)
    return y


@triton.jit
def _quant_expert_rows_kernel(
    x_ptr, q_ptr, s_ptr, scale_ptr, experts_ptr, H, num_experts, src_div, expert_div,
    stride_xt, stride_qt, qmax, cols,
    BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, ROUND_INT: tl.constexpr,
    GDC_WAIT: tl.constexpr = False, GDC_LAUNCH: tl.constexpr = False,
):  # fmt: skip
    """Program (r, c): row r of q, columns [c * cols, +cols) in blocks of BLOCK. q[r] =
    clamp(x[r // src_div] / s, -qmax, qmax) with the static scale s = scale[e] of the row's
    expert e = experts[r // expert_div] (HAS_MAP) or r // expert_div, clamped into [0,
    num_experts) for s, written to s[r] by program (r, 0). Rows whose expert is outside [0,
    num_experts) (masked pairs, another EP rank's experts) are not read or written.
    GDC_*: as `_quant_rows_kernel`."""
    if GDC_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
    r = tl.program_id(0).to(tl.int64)
    if HAS_MAP:
        e = tl.load(experts_ptr + r // expert_div).to(tl.int64)
    else:
        e = r // expert_div
    s = tl.load(scale_ptr + tl.minimum(tl.maximum(e, 0), num_experts - 1)).to(tl.float32)
    tl.store(s_ptr + r, s, mask=tl.program_id(1) == 0)
    if (e >= 0) & (e < num_experts):  # a branch, not a mask: the row's accesses stay vectorized
        x_row = x_ptr + (r // src_div) * stride_xt
        c_lo = tl.program_id(1) * cols
        for c0 in range(c_lo, tl.minimum(c_lo + cols, H), BLOCK):
            col = c0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + col, mask=col < H, other=0.0).to(tl.float32)
            y = _clamp_round(tl.div_rn(x, s), qmax, ROUND_INT)  # s does not bound x
            tl.store(q_ptr + r * stride_qt + col, y.to(q_ptr.dtype.element_ty), mask=col < H)


# Programs of `_quant_expert_rows_kernel` up to which each takes one column block; above it one
# program takes a whole row. Small calls (decode) want the row split for latency; an EP rank's
# large call is mostly rows of other ranks' experts, which a program a row skips cheaply
# (H100, deepseek-v3 EP8 T = 4096: the x rows in 37 us, against 142 us a block a program).
SPLIT_ROWS_MAX_PROGRAMS = 16384


def launch_quant_expert_rows(x, q, s, scale, experts, src_div, expert_div, qmax, round_int,
                             pdl=(False, False)):  # fmt: skip
    """q [R, H], s [R] of `_quant_expert_rows_kernel` from x [T, H] (last dim contiguous), the
    per-expert scales `scale` [E] float32 and `experts` (int, or None); pdl as
    `launch_quant_rows`."""
    R, H = q.shape
    block = min(1024, triton.next_power_of_2(max(H, 1)))
    blocks = max(1, triton.cdiv(H, block))  # H = 0: the programs still write s
    split = R * blocks <= SPLIT_ROWS_MAX_PROGRAMS
    cols = block if split else blocks * block
    _quant_expert_rows_kernel[(R, blocks if split else 1)](
        x, q, s, scale, experts if experts is not None else scale, H, scale.numel(), src_div,
        expert_div, x.stride(0), q.stride(0), qmax, cols, BLOCK=block,
        HAS_MAP=experts is not None,
        ROUND_INT=round_int, GDC_WAIT=pdl[0], GDC_LAUNCH=pdl[1], num_warps=4,
        **({"launch_pdl": True} if pdl[0] else {}),
    )  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def _amax_rows_kernel(x_ptr, part_ptr, T, H, stride_xt, rows_per_program, BLOCK: tl.constexpr):
    """part[p] = max |x| over rows [p * rows_per_program, +rows_per_program) of x [T, H]."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    r0 = p * rows_per_program
    row_ptr = x_ptr + r0.to(tl.int64) * stride_xt
    for _ in range(r0, tl.minimum(r0 + rows_per_program, T)):
        for c0 in range(0, H, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < H, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
        row_ptr += stride_xt
    tl.store(part_ptr + p, tl.max(acc, 0))


MAX_PARTS = 512


def launch_amax_parts(x):
    """Partial amaxes float32 [n] of x [T, H] (T >= 1), one per block of rows."""
    T, H = x.shape
    n = min(MAX_PARTS, T)
    rows = triton.cdiv(T, n)
    n = triton.cdiv(T, rows)
    part = torch.empty(n, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(max(H, 1)))
    _amax_rows_kernel[(n,)](x, part, T, H, x.stride(0), rows, BLOCK=block, num_warps=4)
    return part


def launch_quant_rows(x, q, s, static_s, group_size, n_groups, qmax, eps, static, round_int, tile,
                      part=None, pdl=(False, False)):  # fmt: skip
    """x [T, H] (last dim contiguous) -> q [T, H], s [T, n_groups] (unused when static).
    `part` (static): partial amaxes to take the one scale from (written to static_s).
    pdl (wait, launch): wait: launched programmatically dependent on the kernel before (its
    programs wait on the GPU for that kernel's writes); launch: let the next kernel launched
    so be placed at once (CUDA sm_90+ only)."""
    T, H = x.shape
    block = triton.next_power_of_2(group_size)
    block_g = max(1, min(triton.next_power_of_2(n_groups), tile.max_elems // block))
    grid = (T, triton.cdiv(n_groups, block_g))
    _quant_rows_kernel[grid](
        x,
        q,
        s,
        static_s,
        H,
        group_size,
        n_groups,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        qmax,
        eps,
        part if part is not None else x,
        part.numel() if part is not None else 0,
        BLOCK_G=block_g,
        BLOCK=block,
        STATIC=static,
        ROUND_INT=round_int,
        NPART=triton.next_power_of_2(part.numel()) if part is not None else 0,
        num_warps=tile.num_warps,
        GDC_WAIT=pdl[0],
        GDC_LAUNCH=pdl[1],
        **({"launch_pdl": True} if pdl[0] else {}),
    )
