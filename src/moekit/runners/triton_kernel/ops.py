"""Allocating wrappers of the `triton_kernel` runner: shapes, grids and launches.

  fused_moe(x [T, H], topk, weights, act) -> [T, H], weighted and summed over K
and its pieces `gate_up` and `down` (persistent grouped GEMMs over the work tiles of a
`Routing`). Buffers are sized for the worst case (P = T*K rows) and the number of work tiles is
read on device, so a call never syncs with the host and can be captured in a CUDA graph.

The sum over K (config `reduce`): 'atomic' adds each weighted row into the output [T, H] in
down's epilogue (gate_up zeroes the output first, so there is no memset node and no [P, H]
intermediate: P * H * 4 bytes less traffic); 'sum' stores the weighted per-pair rows y [P, H]
and a deterministic kernel (`sum_topk`, shared with the `triton` runner) sums them in a fixed
order, which makes results bit-reproducible (graph replay equals eager).
"""

from __future__ import annotations

import functools

import torch

from moekit._triton_host import cdiv
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import sm_count
from moekit.router import TopKOutput
from moekit.runners._tables import device_key
from moekit.runners._triton_common import ACT_CODES
from moekit.runners.triton.ops import (  # shared with the triton runner
    check_weight_tensors,
    kernel_inputs,
    sum_topk,
    tma_ok,
)
from moekit.runners.triton_kernel import _kernels as k
from moekit.runners.triton_kernel import gluon_ops
from moekit.runners.triton_kernel.configs import ROUTING, KernelConfig, config_for
from moekit.runners.triton_kernel.routing import Routing, route

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# fp8_w8a8: block-wise, in the Gluon engine only (`gluon_ops.engine_for` says where it cannot run)
WEIGHT_FORMATS = ("unquantized", "fp8_w8a8")


def check_inputs(x: torch.Tensor, w: ExpertWeights, act: ActivationSpec) -> None:
    """ValueError naming the option and the allowed values for anything this runner cannot run."""
    if x.dtype not in DTYPES:
        raise ValueError(f"dtype: {x.dtype} is not supported; allowed: float16, bfloat16, float32")
    if w.format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {w.format!r}: the triton_kernel runner supports: "
                         f"{', '.join(WEIGHT_FORMATS)}")  # fmt: skip
    if act.name not in ACT_CODES:
        raise ValueError(f"activation: unknown {act.name!r}; allowed: {', '.join(ACT_CODES)}")
    check_weight_tensors(x, w)  # unquantized here: every tensor in x's dtype


def _precision(t: torch.Tensor):
    # float32 inputs: exact products (the default tf32 would lose ~3 decimal digits)
    return "ieee" if t.dtype == torch.float32 else None


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors of contiguous tensors (`triton.ops.tma_ok`: 16-byte aligned bases and
    row strides)."""
    return all(t.is_contiguous() for t in tensors) and tma_ok(*tensors)


def _desc(t2d: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


def num_programs(device: torch.device, cfg: KernelConfig, work_bound: int,
                 persistent: bool = True) -> int:  # fmt: skip
    """Grid size: persistent, SMs * programs_per_sm (ROUTING.cpu_programs in the interpreter),
    at most the worst-case number of work items, at least 1; else that worst case."""
    if not persistent:
        return max(1, work_bound)
    if device.type == "cuda":
        n = sm_count(device)
        n *= cfg.programs_per_sm
    else:
        n = ROUTING.cpu_programs
    return max(1, min(n, work_bound))


def _launch(kernel, grid, warmup: bool):
    """kernel[grid], or its compile-only twin (`JITFunction.warmup`) when warmup."""
    if warmup:
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


def gate_up(x: torch.Tensor, r: Routing, w: ExpertWeights, act: ActivationSpec,
            cfg: KernelConfig, top_k: int, out: torch.Tensor | None = None,
            zero: torch.Tensor | None = None, warmup: bool = False) -> torch.Tensor:  # fmt: skip
    """h [P, I] in sorted row order: h[row] = act(x[token(row)] @ w13[e].T + b13[e]); rows past
    the valid pairs are left unwritten. `zero` (contiguous): a tensor the launch also zeroes
    (the atomic down GEMM's output). warmup: compile only (nothing runs)."""
    E, I, H = w.num_experts, w.intermediate_size, w.hidden_size
    t = cfg.gate_up
    if out is None:
        out = torch.empty(r.num_pairs, I, dtype=x.dtype, device=x.device)
    grid = (num_programs(x.device, cfg, r.max_tiles * cdiv(I, t.block_n), t.persistent),)
    one_tile = act.interleaved and cfg.interleaved_one_tile
    rows_per_tile = 2 * t.block_n if one_tile else t.block_n
    use_tma = cfg.tma and rows_per_tile <= 256 and _tma_ok(w.w13)
    w_desc = w_desc_up = None
    if use_tma and act.interleaved and not one_tile:
        # gate rows 2n and up rows 2n + 1 as two [E * I, H] views with row stride 2H
        use_tma = (H * w.w13.element_size()) % 16 == 0
        if use_tma:
            from triton.tools.tensor_descriptor import TensorDescriptor

            block = [t.block_n, t.block_k]
            w_desc = TensorDescriptor(w.w13, [E * I, H], [2 * H, 1], block)
            w_desc_up = TensorDescriptor(w.w13.view(-1)[H:], [E * I, H], [2 * H, 1], block)
    elif use_tma:
        w_desc = w_desc_up = _desc(w.w13.view(E * 2 * I, H), [rows_per_tile, t.block_k])
    b13 = w.b13 if w.b13 is not None else w.w13
    zero_t = zero if zero is not None else out
    _launch(k._gate_up_kernel, grid, warmup)(
        x, w.w13, w_desc, w_desc_up, b13, out, zero_t, zero.numel() if zero is not None else 0,
        r.sorted_pairs, r.tile_expert, r.tile_row0, r.tile_rows,
        r.num_tiles, top_k, I, H,
        x.stride(0), w.w13.stride(0), w.w13.stride(1), b13.stride(0), out.stride(0),
        float(act.alpha), float(act.limit),
        ACT=ACT_CODES[act.name], HAS_BIAS=w.b13 is not None, INTERLEAVED=act.interleaved,
        ONE_TILE=one_tile,
        USE_TMA=use_tma, EVEN_K=H % t.block_k == 0, DOT_PRECISION=_precision(x),
        BLOCK_M=cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=cfg.group_m,
        ZERO_OUT=zero is not None, FLATTEN=t.flatten, WARP_SPEC=t.warp_specialize,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def down(h: torch.Tensor, r: Routing, w: ExpertWeights, cfg: KernelConfig,
         topk_weights: torch.Tensor, top_k: int, out: torch.Tensor | None = None,
         warmup: bool = False) -> torch.Tensor:  # fmt: skip
    """reduce 'sum': y [P, H] by pair: y[pair(row)] = weight[pair] * (h[row] @ w2[e].T + b2[e]);
    rows of masked pairs are left unwritten. reduce 'atomic': those rows are added into out
    [T = P / top_k, H], which must be zeroed before (and is required). topk_weights: [P]
    float32. warmup: compile only."""
    E, I, H = w.num_experts, w.intermediate_size, w.hidden_size
    t = cfg.down
    atomic = cfg.reduce == "atomic"
    if out is None:
        if atomic:
            raise ValueError("down with reduce='atomic' needs out: a zeroed [T, H] tensor")
        out = torch.empty(r.num_pairs, H, dtype=h.dtype, device=h.device)
    grid = (num_programs(h.device, cfg, r.max_tiles * cdiv(H, t.block_n), t.persistent),)
    use_tma = cfg.tma and _tma_ok(w.w2, h)
    h_desc = w_desc = None
    if use_tma:
        h_desc = _desc(h, [cfg.block_m, t.block_k])
        w_desc = _desc(w.w2.view(E * H, I), [t.block_n, t.block_k])
    b2 = w.b2 if w.b2 is not None else w.w2
    _launch(k._down_kernel, grid, warmup)(
        h, h_desc, w.w2, w_desc, b2, out, topk_weights, r.sorted_pairs, r.tile_expert,
        r.tile_row0, r.tile_rows, r.num_tiles, top_k, H, I,
        h.stride(0), w.w2.stride(0), w.w2.stride(1), b2.stride(0), out.stride(0),
        HAS_BIAS=w.b2 is not None, USE_TMA=use_tma, EVEN_K=I % t.block_k == 0,
        DOT_PRECISION=_precision(h), BLOCK_M=cfg.block_m, BLOCK_N=t.block_n,
        BLOCK_K=t.block_k, GROUP_M=cfg.group_m, ATOMIC=atomic, FLATTEN=t.flatten,
        WARP_SPEC=t.warp_specialize, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


def fused_moe(x_TH: torch.Tensor, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec,
              config: KernelConfig | None = None,
              local_share: float = 1.0) -> torch.Tensor:  # fmt: skip
    """out [T, H] in x's dtype = sum over k of weight_k * expert_{id_k}(x); ids of -1 (or >= E)
    contribute 0. `config` overrides the tuned table / heuristic (`configs.config_for`) and
    keeps the Triton engine (fp8 weights run in the Gluon engine only, and ignore it); without
    one, large batches on Hopper may take the Gluon engine
    (`gluon_ops.engine_for`, sized by the T * local_share tokens' worth of local pairs:
    `StandardDispatchOutput.local_share`)."""
    check_inputs(x_TH, w, act)
    T, H = x_TH.shape
    K = topk.top_k
    if T == 0 or K == 0:
        return x_TH.new_zeros(T, H)
    x_TH, ids, weights = kernel_inputs(x_TH, topk)
    E, I = w.num_experts, w.intermediate_size
    if (config is None or w.is_quantized) and gluon_ops.engine_for(
        x_TH, w, act, K, local_share
    ) == "gluon":
        return gluon_ops.fused_moe(x_TH, ids, weights, w, act, local_share=local_share)
    if config is None:
        dev = None if x_TH.device.type != "cuda" else device_key(x_TH.device)[0]
        dtype = str(x_TH.dtype).removeprefix("torch.")
        config = config_for(T, K, E, H, I, act.interleaved, act.name, dtype, dev)
    cfg = config
    r = route(ids, E, cfg.block_m)
    if cfg.reduce == "atomic":
        out = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device)  # zeroed by gate_up
        h = gate_up(x_TH, r, w, act, cfg, K, zero=out)
        return down(h, r, w, cfg, weights.view(-1), K, out=out)
    h = gate_up(x_TH, r, w, act, cfg, K)
    y = down(h, r, w, cfg, weights.view(-1), K)
    return sum_topk(y, ids, E, torch.empty_like(x_TH))
