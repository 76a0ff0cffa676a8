"""Triton kernels for moving token rows (see `moekit.dispatch.rows` for the wrappers and the
PyTorch twins). One program handles one destination row and BLOCK_H columns."""

import triton
import triton.language as tl


@triton.jit
def _gather_reduce_kernel(
    src_ptr, rows_ptr, w_ptr, out_ptr, M, H, stride_src, stride_out,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[n] = sum_k w[n, k] * src[rows[n, k]] over the k with 0 <= rows[n, k] < M (fp32 sum)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        row = tl.load(rows_ptr + n * K + k).to(tl.int64)
        ok = (row >= 0) & (row < M)
        safe = tl.where(ok, row, 0)
        v = tl.load(src_ptr + safe * stride_src + offs, mask=hmask & ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + n * K + k)
        acc += tl.where(ok, v, 0.0)
    tl.store(out_ptr + n * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, dest_ptr, out_ptr, M, H, stride_src, stride_out,
    K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[dest[n, k]] = src[n] for the k with 0 <= dest[n, k] < M (a bit copy)."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    v = tl.load(src_ptr + n * stride_src + offs, mask=hmask)
    for k in range(K):
        d = tl.load(dest_ptr + n * K + k).to(tl.int64)
        ok = (d >= 0) & (d < M)
        safe = tl.where(ok, d, 0)
        tl.store(out_ptr + safe * stride_out + offs, v, mask=hmask & ok)


def _block(H: int) -> int:
    return max(16, min(1024, triton.next_power_of_2(max(H, 1))))


def launch_gather_reduce(src, rows, weights, out):
    N, K = rows.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, triton.cdiv(H, block))
    _gather_reduce_kernel[grid](
        src, rows, weights if weights is not None else rows, out, src.shape[0], H,
        src.stride(0), out.stride(0), K=K, HAS_W=weights is not None, BLOCK_H=block,
        num_warps=4,
    )


def launch_scatter_rows(src, dest, out):
    N, K = dest.shape
    H = src.shape[1]
    block = _block(H)
    grid = (N, triton.cdiv(H, block))
    _scatter_rows_kernel[grid](
        src, dest, out, out.shape[0], H, src.stride(0), out.stride(0), K=K, BLOCK_H=block,
        num_warps=4,
    )
