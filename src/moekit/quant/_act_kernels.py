"""Triton kernel behind `moekit.quant.act_quant.quantize_act` (private: use the wrapper)."""

from __future__ import annotations

import triton
import triton.language as tl


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
    BLOCK_G: tl.constexpr,
    BLOCK: tl.constexpr,
    STATIC: tl.constexpr,
    ROUND_INT: tl.constexpr,
):
    """One program: row t (axis 0), groups [BLOCK_G * pid1, +BLOCK_G) of `group_size` columns.

    Dynamic: s = max(amax(|x_group|), eps) / qmax is written to s[t, g]; STATIC: s is the one
    value at static_s_ptr. q = clamp(x / s, -qmax, qmax), rounded half to even when ROUND_INT
    (int8), then cast to q's dtype (the cast rounds for fp8)."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK)
    col = g[:, None] * group_size + j[None, :]
    mask = (g[:, None] < n_groups) & (j[None, :] < group_size) & (col < H)
    x = tl.load(x_ptr + t * stride_xt + col, mask=mask, other=0.0).to(tl.float32)
    if STATIC:
        s = tl.load(static_s_ptr).to(tl.float32)
        y = tl.div_rn(x, s)
    else:
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.div_rn(tl.maximum(amax, eps), qmax)
        tl.store(s_ptr + t * stride_st + g, s, mask=g < n_groups)
        y = tl.div_rn(x, s[:, None])
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if ROUND_INT:
        r = tl.floor(y + 0.5)
        half_odd = ((r - y) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0)
        y = tl.where(half_odd, r - 1.0, r)
    tl.store(q_ptr + t * stride_qt + col, y.to(q_ptr.dtype.element_ty), mask=mask)


def launch_quant_rows(x, q, s, static_s, group_size, n_groups, qmax, eps, static, round_int, tile):
    """x [T, H] (last dim contiguous) -> q [T, H], s [T, n_groups] (unused when static)."""
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
        BLOCK_G=block_g,
        BLOCK=block,
        STATIC=static,
        ROUND_INT=round_int,
        num_warps=tile.num_warps,
    )
