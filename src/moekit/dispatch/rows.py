"""Row movement for the all-to-all dispatcher: fixed-shape gathers and scatters of token rows,
with no host synchronisation (so they can be captured in a CUDA graph).

`gather_reduce` and `scatter_rows` have a Triton kernel (used on CUDA) and a PyTorch twin
(`*_torch`, used on CPU and as the reference in tests); `impl` forces one ('auto', 'torch',
'triton'). Invalid indices (< 0 or >= the row count) are skipped, never read or written.
"""

from __future__ import annotations

import functools

import torch

IMPLS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def use_triton(t: torch.Tensor, impl: str) -> bool:
    """Whether the dispatch ops on `t` run their Triton kernels: impl 'triton', or 'auto' on a
    CUDA tensor with Triton importable ('torch': the reference twins). Shared by the dispatch
    modules."""
    if impl not in IMPLS:
        raise ValueError(f"row impl: unknown {impl!r}; allowed: {', '.join(IMPLS)}")
    if impl == "auto":
        return t.is_cuda and _triton_ok()
    return impl == "triton"


def gather_reduce_torch(
    src_MH: torch.Tensor,
    rows_NK: torch.Tensor,
    weights_NK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out [N, H] = sum over k of weights[n, k] * src[rows[n, k]] (float32 sum), skipping
    rows outside [0, M). Rows never read can hold anything (NaN included)."""
    M, H = src_MH.shape
    N, K = rows_NK.shape
    out_dtype = out_dtype or src_MH.dtype
    if N == 0 or M == 0:
        return torch.zeros(N, H, dtype=out_dtype, device=src_MH.device)
    valid = (rows_NK >= 0) & (rows_NK < M)
    picked = src_MH.index_select(0, torch.where(valid, rows_NK, 0).reshape(-1))
    picked = picked.view(N, K, H).float()
    if weights_NK is not None:
        picked = picked * weights_NK.float().unsqueeze(-1)
    picked = torch.where(valid.unsqueeze(-1), picked, 0.0)
    return picked.sum(dim=1).to(out_dtype)


def gather_reduce(
    src_MH: torch.Tensor,
    rows_NK: torch.Tensor,
    weights_NK: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `gather_reduce_torch`. src rows may be strided (last dim contiguous); `out` [N, H]
    (rows may be strided) receives the result when given."""
    if not use_triton(src_MH, impl):
        res = gather_reduce_torch(src_MH, rows_NK, weights_NK, out_dtype)
        return res if out is None else out.copy_(res)
    from moekit.dispatch._kernels import launch_gather_reduce

    M, H = src_MH.shape
    N = rows_NK.shape[0]
    if out is None:
        out = torch.empty(N, H, dtype=out_dtype or src_MH.dtype, device=src_MH.device)
    elif out.shape != (N, H) or out.stride(1) != 1:
        raise ValueError(f"gather_reduce: out must be [{N}, {H}] with contiguous rows, got "
                         f"{list(out.shape)}")
    if N == 0 or H == 0:
        return out
    if M == 0:
        return out.zero_()
    if src_MH.stride(1) != 1:
        src_MH = src_MH.contiguous()
    w = None if weights_NK is None else weights_NK.float().contiguous()
    launch_gather_reduce(src_MH, rows_NK.contiguous(), w, out)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer tensor of the same element size (a copy moves bits)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def scatter_rows_torch(
    src_NH: torch.Tensor, dest_NK: torch.Tensor, num_rows: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """out [num_rows, H] with out[dest[n, k]] = src[n] for dest in [0, num_rows); rows nobody
    writes are undefined. A destination must be named once at most. `out` (may be strided)
    receives the rows when given."""
    N, H = src_NH.shape
    ext = src_NH.new_empty(num_rows + 1, H)  # the last row takes the skipped copies
    dest = torch.where((dest_NK >= 0) & (dest_NK < num_rows), dest_NK, num_rows)
    ext.index_put_((dest,), src_NH.unsqueeze(1).expand(N, dest.shape[1], H))
    if out is None:
        return ext[:num_rows]
    return out.copy_(ext[:num_rows])


def scatter_rows(
    src_NH: torch.Tensor,
    dest_NK: torch.Tensor,
    num_rows: int,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See `scatter_rows_torch`. src and out rows may be strided (last dim contiguous)."""
    if not use_triton(src_NH, impl):
        return scatter_rows_torch(src_NH, dest_NK, num_rows, out)
    from moekit.dispatch._kernels import launch_scatter_rows

    N, H = src_NH.shape
    if out is None:
        out = src_NH.new_empty(num_rows, H)
    if out.shape != (num_rows, H) or out.dtype != src_NH.dtype or out.stride(1) != 1:
        raise ValueError(f"scatter_rows: out must be [{num_rows}, {H}] {src_NH.dtype} with "
                         f"contiguous rows, got {list(out.shape)} {out.dtype}")
    if N == 0 or H == 0 or num_rows == 0:
        return out
    if src_NH.stride(1) != 1:
        src_NH = src_NH.contiguous()
    launch_scatter_rows(_bits(src_NH), dest_NK.contiguous(), _bits(out))
    return out
