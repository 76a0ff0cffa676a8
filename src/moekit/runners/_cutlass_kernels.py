"""Triton kernels around the grouped GEMMs of the `cutlass` and `deep_gemm` runners, each with a
plain-PyTorch twin of the same signature (used on CPU, and by the tests as the reference).

- `weighted_reduce`: grouped expert outputs y [M, >=H] (+ bias b2 of expert ids[t, k]) ->
  out [T, H] = sum_k weight[t, k] * y[row[t, k]], in float32, masked pairs (row -1) contribute 0.
- `rows_layout_triton`: `_grouped.GroupedRows` from the triton runner's alignment (GPU path of
  `_grouped.group_rows`).
- `gemm_rows`: a grouped GEMM's input rows: x[token[m]] (the gather before the first GEMM) or
  the activation of the gate/up pre-activations h [M, 2I] (+ the row's expert's bias b13;
  before the second), optionally quantized to fp8 e4m3 per
  row and 128 columns with the scales written MN-major (DeepGEMM's layout; a gather quantizes
  the tokens once and copies fp8 rows, or quantizes each row it gathers). Rows of expert -1
  are skipped (left undefined) and the programs stop at the rows in use, so padding and the
  slack of the static row bound cost no memory traffic.

Numerics follow the reference runner: bias add and activation in float32, the result rounded to
the activation dtype; the top-k sum in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts import ActivationSpec
from moekit.quant.act_quant import ACT_DTYPES, EPS, quantize_act, quantize_act_ref
from moekit.runners.torch import activate

FP8_GROUP = 128  # columns per activation scale of `gemm_rows` (DeepGEMM's 1x128)

try:  # Triton is optional: the twins below run everywhere.
    import triton
    import triton.language as tl

    from moekit.quant._act_kernels import div_by_scale
    from moekit.runners._triton_common import ACT_CODES
    from moekit.runners._triton_common import activate as activate_tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001
    HAS_TRITON = False


# ---------------------------------------------------------------------------- torch twins


def _activation_torch(
    h_MN: torch.Tensor,
    expert_M: torch.Tensor,
    b13_EN: torch.Tensor | None,
    act: ActivationSpec,
) -> torch.Tensor:
    """h [M, 2I] -> a [M, I] in h's dtype (rows of expert -1 are computed too: undefined)."""
    h = h_MN.float()
    if b13_EN is not None:
        h = h + b13_EN.float()[expert_M.long().clamp(min=0)]
    return activate(h, act).to(h_MN.dtype)


def weighted_reduce_torch(
    y_MH: torch.Tensor,
    row_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    b2_EH: torch.Tensor | None,
    hidden: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out [T, hidden] = sum_k weights[t, k] * (y[row[t, k], :hidden] + b2[ids[t, k]]) over the
    pairs with row >= 0 (a masked pair has row -1; its id is not read)."""
    T, K = row_TK.shape
    if T == 0:
        return torch.zeros(0, hidden, dtype=out_dtype, device=y_MH.device)
    rows = row_TK.reshape(-1).clamp(min=0)
    y = y_MH[rows, :hidden].float()
    if b2_EH is not None:
        experts = torch.where(row_TK >= 0, ids_TK.long(), 0).reshape(-1)
        y = y + b2_EH.float()[experts]
    valid = (row_TK.reshape(-1) >= 0).unsqueeze(-1)
    y = torch.where(valid, y * weights_TK.reshape(-1, 1).float(), torch.zeros((), device=y.device))
    return y.view(T, K, hidden).sum(dim=1).to(out_dtype)


def gemm_rows_torch(
    src: torch.Tensor,
    expert_M: torch.Tensor,
    *,
    token_M: torch.Tensor | None = None,
    act: ActivationSpec | None = None,
    b13_EN: torch.Tensor | None = None,
    quant: bool = False,
    rows_per_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [M, C]: src[token_M] (src itself when token_M is None), or with `act` the
    activation of h = src [M, 2C] (+ b13 of the row's expert) rounded to src's dtype; rows of
    expert -1 are zeros. quant: (fp8 e4m3 [M, C], float32 scales MN-major [M / R, C / 128, R]:
    the scale of row m, group g at [m // R, g, m % R]), as `quantize_act(rows, 'token_group',
    group_size=128)`; else (rows in src's dtype, None)."""
    if act is not None:
        rows = _activation_torch(src, expert_M, b13_EN, act)
    else:
        rows = src if token_M is None else src[token_M]
    rows = torch.where((expert_M >= 0).unsqueeze(1), rows, torch.zeros_like(rows))
    if not quant:
        return rows.contiguous(), None
    q, s = quantize_act_ref(rows, "token_group", torch.float8_e4m3fn, group_size=FP8_GROUP)
    M = rows.shape[0]
    s = s.view(M // rows_per_group, rows_per_group, -1).transpose(1, 2).contiguous()
    return q, s


# ---------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _weighted_reduce_kernel(
        y_ptr,
        out_ptr,
        row_ptr,
        w_ptr,
        ids_ptr,
        b_ptr,
        H,
        stride_y,
        stride_o,
        stride_b,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Program (t, column block): the K rows of token t, weighted and summed in float32;
        the loop over K unrolled, so that every row's load is in flight at once. (Loading the
        K rows as one [K, BLOCK] tile was 1.6-5x slower on the H100.)"""
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in tl.static_range(K):
            row = tl.load(row_ptr + t * K + k)
            ok = row >= 0
            safe = tl.maximum(row, 0)
            w = tl.load(w_ptr + t * K + k)
            y = tl.load(y_ptr + safe * stride_y + cols, mask=cmask & ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                e = tl.maximum(tl.load(ids_ptr + t * K + k), 0).to(tl.int64)
                y += tl.load(b_ptr + e * stride_b + cols, mask=cmask & ok, other=0.0).to(tl.float32)
            acc += tl.where(ok, w, 0.0) * y
        out_row = out_ptr + t.to(tl.int64) * stride_o
        tl.store(out_row + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _rows_layout_kernel(
        sorted_ids_ptr,
        block_expert_ptr,
        num_rows_ptr,
        token_ptr,
        expert_ptr,
        row_ptr,
        M,
        P,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """`GroupedRows` from the triton runner's alignment: per row its token and expert (0 / -1
        on padding and unused rows), and the row of each pair (row_ptr, pre-filled with -1)."""
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        in_m = r < M
        pair = tl.load(sorted_ids_ptr + r, mask=in_m & (r < tl.load(num_rows_ptr)), other=P)
        ok = pair < P
        e = tl.load(block_expert_ptr + r // BLOCK_M, mask=ok, other=-1)
        tl.store(token_ptr + r, tl.where(ok, pair // K, 0).to(tl.int64), mask=in_m)
        tl.store(expert_ptr + r, e, mask=in_m)
        tl.store(row_ptr + pair, r.to(tl.int64), mask=ok)

    @triton.jit
    def _gate_up_tile(row, g, ok, C, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_G: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
        """gate, up float32 [BLOCK_R, BLOCK_G, GROUP] of the rows at `row` ([R, 1, 1] pointers)
        for the column groups g: gate column c at c and up at C + c, or (INTERLEAVED) at 2c and
        2c + 1, read as one contiguous [R, G, 2 * GROUP] tile and split in registers: two loads
        at a stride of 2 elements do not vectorize, and gpt-oss-120b's rows ran 3.2x (fp8) and
        1.75x (bf16) slower that way on the H100 (benchmarks/deep_gemm_notes.md, session 30)."""
        ok = ok[:, None, None]
        if INTERLEAVED:
            col2 = (g[:, None] * (2 * GROUP) + tl.arange(0, 2 * GROUP)[None, :])[None, :, :]
            both = tl.load(row + col2, mask=ok & (col2 < 2 * C), other=0.0).to(tl.float32)
            gate, up = tl.split(tl.reshape(both, [BLOCK_R, BLOCK_G, GROUP, 2]))
        else:
            col = (g[:, None] * GROUP + tl.arange(0, GROUP)[None, :])[None, :, :]
            mask = ok & (col < C)
            gate = tl.load(row + col, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(row + col + C, mask=mask, other=0.0).to(tl.float32)
        return gate, up

    @triton.jit
    def _gemm_rows_kernel(
        src_ptr,
        q_ptr,
        s_ptr,
        token_ptr,
        expert_ptr,
        b_ptr,
        used_ptr,
        src_s_ptr,
        M,
        C,
        n_groups,
        rows_per_group,
        stride_src,
        stride_q,
        stride_b,
        alpha,
        limit,
        qmax,
        eps,
        GATHER: tl.constexpr,
        ACT: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        QUANT: tl.constexpr,
        PREQUANT: tl.constexpr,
        HAS_USED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_G: tl.constexpr,
        GROUP: tl.constexpr,
    ):
        """Programs (P, column blocks): tiles [BLOCK_R rows, BLOCK_G groups, GROUP columns], row
        tiles pid0, pid0 + P, ... below *used_ptr (HAS_USED) or M; the column groups
        [BLOCK_G * pid1, +BLOCK_G). ACT < 0: copy / gather; else activate. PREQUANT: src is
        already quantized (fp8, its scales [rows, n_groups] at src_s_ptr): copy both."""
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        col = (g[:, None] * GROUP + tl.arange(0, GROUP)[None, :])[None, :, :]  # [1, G, GROUP]
        used = M
        if HAS_USED:
            used = tl.load(used_ptr)
        step = tl.num_programs(0) * BLOCK_R
        for r0 in range(tl.program_id(0) * BLOCK_R, used, step):
            m = r0 + tl.arange(0, BLOCK_R)
            e = tl.load(expert_ptr + m, mask=m < used, other=-1)
            ok = e >= 0
            mask = ok[:, None, None] & (col < C)
            src = m.to(tl.int64)
            if GATHER:
                src = tl.load(token_ptr + m, mask=ok, other=0).to(tl.int64)
            row = src_ptr + src[:, None, None] * stride_src
            if ACT >= 0:
                gate, up = _gate_up_tile(row, g, ok, C, INTERLEAVED, BLOCK_R, BLOCK_G, GROUP)
                if HAS_BIAS:
                    brow = b_ptr + tl.maximum(e, 0).to(tl.int64)[:, None, None] * stride_b
                    b_gate, b_up = _gate_up_tile(brow, g, ok, C, INTERLEAVED, BLOCK_R, BLOCK_G,
                                                 GROUP)  # fmt: skip
                    gate += b_gate
                    up += b_up
                x = activate_tl(gate, up, alpha, limit, ACT).to(src_ptr.dtype.element_ty)
            else:
                x = tl.load(row + col, mask=mask, other=0.0)
            out = q_ptr + m.to(tl.int64)[:, None, None] * stride_q + col
            s_mask = ok[:, None] & (g < n_groups)[None, :]
            s_off = ((m // rows_per_group).to(tl.int64)[:, None] * n_groups + g[None, :]) * (
                rows_per_group
            ) + (m % rows_per_group)[:, None]
            if PREQUANT:
                tl.store(out, x, mask=mask)
                s = tl.load(src_s_ptr + src[:, None] * n_groups + g[None, :], mask=s_mask)
                tl.store(s_ptr + s_off, s, mask=s_mask)
            elif QUANT:
                xf = x.to(tl.float32)
                s = tl.div_rn(tl.maximum(tl.max(tl.abs(xf), axis=2), eps), qmax)  # [R, G]
                y = tl.minimum(tl.maximum(div_by_scale(xf, s[:, :, None]), -qmax), qmax)
                tl.store(out, y.to(q_ptr.dtype.element_ty), mask=mask)
                tl.store(s_ptr + s_off, s, mask=s_mask)
            else:
                tl.store(out, x, mask=mask)


def _block(n: int, cap: int = 1024) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def weighted_reduce_triton(
    y_MH: torch.Tensor,
    row_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    b2_EH: torch.Tensor | None,
    hidden: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Triton twin of `weighted_reduce_torch`."""
    T, K = row_TK.shape
    out = torch.empty(T, hidden, dtype=out_dtype, device=y_MH.device)
    if T == 0 or hidden == 0:
        return out
    if y_MH.stride(1) != 1:
        y_MH = y_MH.contiguous()
    bias = b2_EH if b2_EH is not None else y_MH
    if b2_EH is not None and b2_EH.stride(1) != 1:
        bias = b2_EH.contiguous()
    block = _block(hidden)
    _weighted_reduce_kernel[(T, triton.cdiv(hidden, block))](
        y_MH,
        out,
        row_TK.contiguous(),
        weights_TK.float().contiguous(),
        ids_TK.contiguous(),
        bias,
        hidden,
        y_MH.stride(0),
        out.stride(0),
        bias.stride(0),
        K=K,
        HAS_BIAS=b2_EH is not None,
        BLOCK=block,
    )
    return out


def rows_layout_triton(lay, ids_shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From `moekit.runners._align.AlignOutput` `lay` of ids [T, K]: token_M [M] int64,
    expert_M [M] int32 and row_TK [T, K] int64 of `moekit.runners._grouped.GroupedRows`."""
    T, K = ids_shape
    M, dev = lay.max_rows, lay.sorted_ids.device
    token = torch.empty(M, dtype=torch.int64, device=dev)
    expert = torch.empty(M, dtype=torch.int32, device=dev)
    row = torch.full((T * K,), -1, dtype=torch.int64, device=dev)
    if M:
        block = 1024
        _rows_layout_kernel[(triton.cdiv(M, block),)](
            lay.sorted_ids, lay.block_expert, lay.num_rows, token, expert, row, M,
            lay.num_pairs, K, BLOCK_M=lay.block_m, BLOCK=block,
        )  # fmt: skip
    return token, expert, row.view(T, K)


@dataclass(frozen=True)
class RowsTiling:
    """Tiles of `gemm_rows_triton`: block_r rows x block_g groups of FP8_GROUP columns per step
    (at most: block_g shrinks to the groups there are), num_warps per program, at most
    programs along the rows (each loops over its row tiles)."""

    block_r: int = 16
    block_g: int = 2
    num_warps: int = 4
    programs: int = 4096


# Fastest on the H100 among block_r 8/16/32 x block_g 2/4/8 x 4/8 warps
# (scripts/gpu_probe_rows.py, qwen3 and deepseek-v3 EP8 shapes, fp8 and bf16).
ROWS_TILING = RowsTiling()  # the gather before gate_up
ROWS_TILING_ACT = RowsTiling(block_r=8)  # the activation before down


def gemm_rows_triton(
    src: torch.Tensor,
    expert_M: torch.Tensor,
    *,
    token_M: torch.Tensor | None = None,
    act: ActivationSpec | None = None,
    b13_EN: torch.Tensor | None = None,
    quant: bool = False,
    rows_per_group: int = 1,
    used: torch.Tensor | None = None,
    tiling: RowsTiling | None = None,
    tokens_first: bool = True,
    rows_hint: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton twin of `gemm_rows_torch`; rows of expert -1 and rows at or past `used` (int32
    [1] on the device: the rows in use, default all) are left unwritten. tokens_first (an fp8
    gather): quantize the tokens of src once, then copy fp8 rows and scales (where a token is
    gathered into several rows), or quantize each gathered row (where most tokens are gathered
    once or not at all: an EP rank's); the same values either way, the quantization being per
    row. rows_hint: the rows expected in use (default M), which sizes the grid: the programs
    loop over row tiles up to `used` whatever it is, and on an EP rank the static bound M is
    about ep times the rows in use, whose empty programs cost more than the copy."""
    M = expert_M.shape[0]
    C = src.shape[1] // 2 if act is not None else src.shape[1]
    dev = src.device
    n_groups = triton.cdiv(C, FP8_GROUP)
    q = torch.empty(M, C, dtype=torch.float8_e4m3fn if quant else src.dtype, device=dev)
    s = torch.empty(M // rows_per_group, n_groups, rows_per_group, device=dev) if quant else None
    if M == 0 or C == 0:
        return q, s
    if src.stride(1) != 1:
        src = src.contiguous()
    bias = b13_EN if b13_EN is not None else src
    if b13_EN is not None and b13_EN.stride(1) != 1:
        bias = b13_EN.contiguous()
    if tiling is None:
        tiling = ROWS_TILING if act is None else ROWS_TILING_ACT
    src_s = None
    if quant and token_M is not None and tokens_first:
        src, src_s = quantize_act(src, "token_group", torch.float8_e4m3fn, group_size=FP8_GROUP)
    block_g = min(tiling.block_g, triton.next_power_of_2(n_groups))
    row_tiles = triton.cdiv(min(M, rows_hint or M), tiling.block_r)
    grid = (min(row_tiles, tiling.programs), triton.cdiv(n_groups, block_g))
    _gemm_rows_kernel[grid](
        src,
        q,
        s if quant else q,
        token_M if token_M is not None else expert_M,
        expert_M,
        bias,
        used if used is not None else expert_M,
        src_s if src_s is not None else q,
        M,
        C,
        n_groups,
        rows_per_group,
        src.stride(0),
        q.stride(0),
        bias.stride(0),
        float(act.alpha) if act is not None else 0.0,
        float(act.limit) if act is not None else 0.0,
        ACT_DTYPES[torch.float8_e4m3fn],
        EPS,
        GATHER=token_M is not None,
        ACT=ACT_CODES[act.name] if act is not None else -1,
        INTERLEAVED=act is not None and act.interleaved,
        HAS_BIAS=b13_EN is not None,
        QUANT=quant,
        PREQUANT=src_s is not None,
        HAS_USED=used is not None,
        BLOCK_R=tiling.block_r,
        BLOCK_G=block_g,
        GROUP=FP8_GROUP,
        num_warps=tiling.num_warps,
    )
    return q, s


# ---------------------------------------------------------------------------- dispatch


def use_triton_for(x: torch.Tensor) -> bool:
    """Triton kernels on CUDA tensors when Triton imports; the torch twins elsewhere."""
    return HAS_TRITON and x.is_cuda


def weighted_reduce(
    y_MH, row_TK, weights_TK, ids_TK, b2_EH, hidden, out_dtype, *, use_triton: bool
):
    fn = weighted_reduce_triton if use_triton else weighted_reduce_torch
    return fn(y_MH, row_TK, weights_TK, ids_TK, b2_EH, hidden, out_dtype)


def gemm_rows(src, expert_M, *, use_triton: bool, used=None, tokens_first: bool = True,
              rows_hint: int | None = None, **kw):  # fmt: skip
    """`gemm_rows_triton` or its twin (which takes no launch hints)."""
    if use_triton:
        return gemm_rows_triton(src, expert_M, used=used, tokens_first=tokens_first,
                                rows_hint=rows_hint, **kw)  # fmt: skip
    return gemm_rows_torch(src, expert_M, **kw)
