"""Allocating wrappers around the Triton kernels: shapes, grids and launches.

Public ops (T tokens, K top-k, E local experts, H hidden, I intermediate):
  fused_moe(x [T, H], topk, weights, act)        -> [T, H], weighted and summed over K
  fused_moe_masked(x [E, C, H], counts [E], ...) -> [E, C, H], unweighted
and the pieces `gate_up`, `down`, `sum_topk` that `moekit tune` times one by one. Nothing here
reads a device value on the host, so every op can be captured in a CUDA graph.

Quantized weights (`ExpertWeights.format`, see `moekit.quant.spec`): `WeightQuant` describes how
the kernels read them. Weight-only formats (int8_w8a16, int4_w4a16, mxfp4, nvfp4) are
dequantized in the weight-tile load. The w8a8 formats (fp8_w8a8, int8_w8a8) quantize each GEMM's
input with the format's activation scheme first (`moekit.quant.quantize_act`: x before gate_up,
the intermediate h before down; 'static_tensor', one calibrated scale per expert: each pair's
row with its expert's scale, `quantize_expert_rows`) and multiply fp8 / int8 operands on the
tensor cores.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from moekit._triton_host import cdiv, interpret_mode, next_pow2, pdl_capable
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.quant.act_quant import quantize_expert_rows
from moekit.router import TopKOutput
from moekit.runners._align import AlignOutput, align_block_size
from moekit.runners._shared import expected_experts_used
from moekit.runners._tables import device_key, quant_tag
from moekit.runners._triton_common import ACT_CODES
from moekit.runners.triton import _kernels as k
from moekit.runners.triton.configs import (
    PIPELINE,
    GemmConfig,
    get_config,
    masked_config,
)

_TL_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _dtype_name(t: torch.Tensor) -> str:
    if t.dtype not in _TL_DTYPES:
        raise ValueError(f"dtype: {t.dtype} is not supported; allowed: float16, bfloat16, float32")
    return _TL_DTYPES[t.dtype]


def _precision(dtype: torch.dtype):
    # float32 inputs: exact products (the default tf32 would lose ~3 decimal digits)
    return "ieee" if dtype == torch.float32 else None


# Weight formats the kernels read (ExpertWeights.format).
SUPPORTED_FORMATS = (
    "unquantized", "fp8_w8a8", "int8_w8a8", "int8_w8a16", "int4_w4a16", "mxfp4", "nvfp4",
)  # fmt: skip
# ('static_tensor': the rows of a GEMM's input belong to different experts, so each row carries
# its expert's scale: per row for the kernels)
_SCALE_KIND = {"tensor": k.S_TENSOR, "channel": k.S_ROW, "block": k.S_GROUP,
               "dynamic_tensor": k.S_TENSOR, "token": k.S_ROW, "token_group": k.S_GROUP,
               "static_tensor": k.S_ROW}  # fmt: skip


def spec_problem(spec) -> str | None:
    """None if the triton runner reads weights of QuantSpec `spec` (None: unquantized), else
    why not."""
    if spec is None:
        return None
    if spec.name not in SUPPORTED_FORMATS:
        return (
            f"weight format {spec.name!r}: the triton runner supports: "
            + ", ".join(SUPPORTED_FORMATS)
        )
    return None


class WeightQuant:
    """How the kernels read one quantized weight (w13 or w2) of ExpertWeights `w`: the scale
    tensors and the constexprs of `_kernels._w_tile` / `_w8a8_step`."""

    def __init__(self, w: ExpertWeights, which: str):
        spec = w.spec
        self.spec, self.which = spec, which
        data = getattr(w, which)
        self.quant = {
            "fp8_w8a8": k.Q_W8A8, "int8_w8a8": k.Q_W8A8, "int8_w8a16": k.Q_W8A16,
            "int4_w4a16": k.Q_INT4, "mxfp4": k.Q_MXFP4, "nvfp4": k.Q_NVFP4,
        }[spec.name]  # fmt: skip
        scale = getattr(w, which + "_scale")
        zero = getattr(w, which + "_zero")
        gs = getattr(w, which + "_global_scale")
        for name, t in ((which + "_scale", scale), (which + "_zero", zero),
                        (which + "_global_scale", gs)):  # fmt: skip
            if t is not None and (t.device != data.device or not t.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous tensor on {data.device}")
        self.scale, self.zero, self.gscale = scale, zero, gs
        E = data.shape[0]
        self.stride_se = scale.numel() // E if E else 0
        self.wscale = self.ascale = k.S_TENSOR
        self.wrows, self.group, self.pack, self.int_dot = 1, 128, spec.pack_factor, False
        if self.quant == k.Q_W8A8:
            ws = getattr(spec, "weight_scale", "channel")
            self.wscale, self.ascale = _SCALE_KIND[ws], _SCALE_KIND[spec.act_scheme]
            self.int_dot = spec.name == "int8_w8a8"
            if ws == "block":
                self.wrows, self.group = spec.block_shape
                self.stride_sn = scale.shape[-1]
            else:
                self.stride_sn = 0 if ws == "tensor" else 1
            if self.ascale == k.S_GROUP:
                self.group = spec.act_group_size
        elif self.quant == k.Q_W8A16:
            self.stride_sn = 1
        else:
            self.group = spec.group_size
            self.stride_sn = scale.shape[-1]

    def clamp(self, cfg: GemmConfig) -> GemmConfig:
        """The config with block_k fitting the format: w8a8 with per-group scales take one
        scale group per K step (block_k <= group); every w8a8 dot needs block_k >= 32."""
        bk = cfg.block_k
        if self.quant == k.Q_W8A8:
            if k.S_GROUP in (self.wscale, self.ascale):
                bk = min(bk, self.group)
            bk = max(bk, 32)
        if self.quant in (k.Q_INT4, k.Q_MXFP4, k.Q_NVFP4):
            bk = max(bk, 32)  # packed bytes: at least 16 per row and step
        return cfg if bk == cfg.block_k else replace(cfg, block_k=bk)

    def args(self, data: torch.Tensor) -> tuple:
        """(ws, wz, wg, stride_wse, stride_wsn) kernel arguments (unused ones point at data)."""
        ws = self.scale
        if ws.dtype == torch.float8_e4m3fn:  # nvfp4: read as bytes (masked loads fill 0)
            ws = ws.view(torch.uint8)
        wz = self.zero if self.zero is not None else ws
        wg = self.gscale if self.gscale is not None else ws
        return ws, wz, wg, self.stride_se, self.stride_sn

    def half_dequant(self, act_dtype: torch.dtype) -> bool:
        """Whether `_kernels._dequant_nibbles` may dequantize in 16-bit arithmetic for
        activations of `act_dtype`: int4 with scales stored in the activation dtype (bf16 /
        fp16) and mxfp4 with bf16 activations (power-of-two scales), both exact; nvfp4 with
        bf16 activations, its float32 group scale rounded to bf16 first (one extra rounding,
        relative 2^-9 per weight: `PIPELINE.nvfp4_bf16_scale`, on by default for speed)."""
        if self.quant == k.Q_INT4:
            return act_dtype in (torch.bfloat16, torch.float16) and self.scale.dtype == act_dtype
        if self.quant == k.Q_NVFP4:
            return PIPELINE.nvfp4_bf16_scale and act_dtype == torch.bfloat16
        return self.quant == k.Q_MXFP4 and act_dtype == torch.bfloat16

    def asm_dequant(self, cfg: GemmConfig, tile_rows: int, act_dtype: torch.dtype) -> bool:
        """Whether the packed formats dequantize in PTX (`_kernels._dequant_bytes_asm`): on a
        CUDA GPU of compute capability 8.0+ (bf16x2 fma), bf16 / fp16 activations, not under
        the interpreter, `PIPELINE.asm_dequant` on, and at least 4 bytes of the [block_k / 2,
        tile_rows] weight tile per thread (the PTX converts 4 bytes at a time)."""
        if self.pack != 2 or not PIPELINE.asm_dequant:
            return False
        if act_dtype not in (torch.bfloat16, torch.float16):
            return False
        dev = self.scale.device
        if dev.type != "cuda" or interpret_mode():
            return False
        if device_key(dev)[1] < (8, 0):
            return False
        return cfg.block_k // 2 * tile_rows >= 4 * 32 * cfg.num_warps

    def meta(self, cfg: GemmConfig, tile_rows: int, act_dtype: torch.dtype,
             fused_act_quant: bool = False) -> dict:  # fmt: skip
        """The format's constexpr kernel arguments for a GEMM launched with `cfg`, whose
        programs read weight tiles of `tile_rows` rows, with activations of `act_dtype`."""
        sg = max(1, cfg.block_k // self.group) if self.quant >= k.Q_INT4 else 1
        ascale = k.S_GROUP_FUSED if fused_act_quant else self.ascale
        return dict(
            QUANT=self.quant, ASCALE=ascale, WSCALE=self.wscale, WROWS=self.wrows,
            GROUP=self.group, SG=sg, HAS_ZERO=self.zero is not None, PACK=self.pack,
            HALF=self.half_dequant(act_dtype), ASM=self.asm_dequant(cfg, tile_rows, act_dtype),
            INT_DOT=self.int_dot,
        )  # fmt: skip


_NO_QUANT_META = dict(QUANT=k.Q_NONE, ASCALE=0, WSCALE=0, WROWS=1, GROUP=128, SG=1,
                      HAS_ZERO=False, PACK=1, HALF=False, ASM=False, INT_DOT=False)  # fmt: skip


def quantize_input(
    x: torch.Tensor, spec, valid_rows: torch.Tensor | None = None,
    pdl: tuple[bool, bool] = (False, False),
) -> tuple[torch.Tensor, torch.Tensor]:
    """A w8a8 GEMM's input x [rows, K] -> (q [rows, K] fp8 / int8, scales float32 [rows, groups]
    | [rows, 1] | [1]) with the spec's activation scheme. 'dynamic_tensor' takes its one scale
    over the rows where `valid_rows` (bool [rows]) is set (all rows when None). On CPU (the
    Triton interpreter casts to fp8 wrongly) fp8 uses the reference quantizer, bit-identical
    to the kernel on a GPU. pdl: (wait, launch) of a programmatic dependent launch, see
    `decode_pdl`."""
    from moekit.quant.act_quant import quantize_act, quantize_act_ref, tensor_scale

    scheme, dtype = spec.act_scheme, spec.act_dtype
    scale = None
    if scheme == "dynamic_tensor" and (valid_rows is not None or x.device.type == "cpu"):
        # (on a GPU without row masks, `quantize_act` takes the amax in its own kernels)
        src = x if valid_rows is None else torch.where(valid_rows[:, None], x, 0)
        scale = tensor_scale(src, dtype)
    group = spec.act_group_size or 128
    if x.device.type == "cpu" and dtype == torch.float8_e4m3fn:
        q, s = quantize_act_ref(x, scheme, dtype, scale=scale, group_size=group)
    else:
        q, s = quantize_act(x, scheme, dtype, scale=scale, group_size=group, pdl=pdl)
    return q, s.reshape(1) if scheme == "dynamic_tensor" else s


def _check_weights(x: torch.Tensor, w: ExpertWeights) -> None:
    problem = spec_problem(w.spec)
    if problem:
        raise ValueError(problem)
    check_weight_tensors(x, w)


def check_weight_tensors(x: torch.Tensor, w: ExpertWeights) -> None:
    """ValueError unless every weight / bias tensor is on x's device, in x's dtype (the stored
    data of a quantized format excepted), has a contiguous last dimension, and w13 matches
    x's hidden size. Shared with the triton_kernel runner."""
    for name in ("w13", "w2", "b13", "b2"):
        t = getattr(w, name)
        if t is None:
            continue
        quantized = w.is_quantized and name in ("w13", "w2")
        if t.device != x.device or (t.dtype != x.dtype and not quantized):
            raise ValueError(
                f"{name} must match x in dtype and device ({x.dtype}, {x.device}), "
                f"got {t.dtype}, {t.device}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if w.hidden_size != x.shape[-1]:
        raise ValueError(f"x has hidden size {x.shape[-1]} but w13 is {list(w.w13.shape)}")


def _gemm_meta(cfg: GemmConfig, k_dim: int, use_tma: bool) -> dict:
    return dict(
        USE_TMA=use_tma,
        EVEN_K=k_dim % cfg.block_k == 0,
        SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _pdl_meta(wait: bool, launch: bool) -> dict:
    """GDC_WAIT / GDC_LAUNCH constexprs and the launch option of a GEMM (see `decode_pdl`)."""
    meta = dict(GDC_WAIT=wait)
    if launch:
        meta["GDC_LAUNCH"] = True
    if wait:
        meta["launch_pdl"] = True
    return meta


def _tail_meta(gemm: str, cfg: GemmConfig, rows: Rows, wq: WeightQuant | None) -> dict:
    """TAIL_LEVELS of a GEMM (`PipelineConfig.tail_levels` and what follows it): a block whose
    valid rows fit in block_m / 2^j rows (j <= levels, at least 16 rows) multiplies only
    those. Sorted rows of the GEMMs in tail_gemms, not the w8a8 formats."""
    p = PIPELINE
    if rows.mode != k.ROWS_SORTED or gemm not in p.tail_gemms:
        return {}
    if wq is not None and wq.quant == k.Q_W8A8:
        return {}
    want = p.tail_levels
    per_expert = rows.rows_per_expert
    if per_expert is not None and per_expert <= p.few_blocks * cfg.block_m:
        want = p.few_blocks_tail_levels
    levels = 0
    while levels < want and cfg.block_m >> (levels + 1) >= 16:
        levels += 1
    return {"TAIL_LEVELS": levels} if levels else {}


def _fold_meta(gemm: str, cfg: GemmConfig, rows: Rows, wq: WeightQuant | None) -> dict:
    """FOLD, FOLD_LEVELS of a GEMM (`PipelineConfig.fold_rows`, `.fold_levels`): at most how
    many rows of a short last block the block before it computes (16 or more, under block_m;
    the config's `fold_rows` where it sets one, PipelineConfig.fold_rows 0 turning folding
    off), on the fewest of FOLD / 2^j rows, j < FOLD_LEVELS, down to 16; for sorted rows,
    unquantized weights, one K share, no swapped operands, and experts that get a full block on
    average."""
    p = PIPELINE
    side = p.fold_rows if cfg.fold_rows is None or not p.fold_rows else cfg.fold_rows
    if not 16 <= side < cfg.block_m or rows.mode != k.ROWS_SORTED or gemm not in p.fold_gemms:
        return {}
    if wq is not None or cfg.split_k > 1 or cfg.swap_ab:
        return {}
    if rows.rows_per_expert is not None and rows.rows_per_expert < cfg.block_m:
        return {}
    levels = 1
    while levels < p.fold_levels and side >> levels >= 16:
        levels += 1
    return {"FOLD": side, "FOLD_LEVELS": levels}


def _launch(kernel, grid, args, meta, warmup: bool):
    if meta.get("PACK") == 2 and PIPELINE.packed_maxnreg and meta.get("ASM"):
        meta = dict(meta, maxnreg=PIPELINE.packed_maxnreg)
    if warmup:
        return kernel.warmup(*args, grid=grid, **meta)
    return kernel[grid](*args, **meta)


def decode_pdl(x: torch.Tensor, num_pairs: int) -> bool:
    """Whether a standard call with `num_pairs` (token, expert) pairs chains its kernels as
    programmatic dependent launches (`PipelineConfig.pdl` up to `.decode_max_pairs`): each
    kernel lets the next be placed at once and waits on the GPU, before it reads anything,
    for the writes of the kernel before it. On CUDA GPUs of compute capability 9.0+."""
    if not PIPELINE.pdl or num_pairs > PIPELINE.decode_max_pairs:
        return False
    return pdl_capable(x.device)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides and a unit last stride."""
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or t.stride(-1) != 1:
            return False
        if any((st * es) % 16 for st in t.stride()[:-1]):
            return False
    return True


def _desc(t2d: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


class Rows:
    """How the GEMMs' row blocks map to rows (see `_kernels._tile_rows`):
    Rows.sorted(align) for the standard format, Rows.direct(ids) for tiny batches (no
    alignment: one block per pair, the pairs of one expert gathered into the block of the
    first), Rows.masked(counts, capacity, E) for the masked format.
    rows_per_expert (sorted): the expected pairs of a used expert, known on the host (no
    device read), which sets the GEMMs' tail levels (`_tail_meta`); None: not known.
    ids (sorted): the flat local expert id of each pair, needed by 'static_tensor' formats."""

    def __init__(self, mode, align=None, ids=None, counts=None, capacity=0, num_experts=0,
                 rows_per_expert: float | None = None):  # fmt: skip
        self.mode, self.align, self.ids, self.counts = mode, align, ids, counts
        self.capacity, self.num_experts = capacity, num_experts
        self.rows_per_expert = rows_per_expert

    @classmethod
    def sorted(cls, align: AlignOutput, num_experts: int, rows_per_expert: float | None = None,
               ids: torch.Tensor | None = None) -> "Rows":  # fmt: skip
        return cls(k.ROWS_SORTED, align=align, ids=ids, num_experts=num_experts,
                   rows_per_expert=rows_per_expert)  # fmt: skip

    @classmethod
    def direct(cls, ids_P: torch.Tensor, num_experts: int) -> "Rows":
        return cls(k.ROWS_DIRECT, ids=ids_P, num_experts=num_experts)

    @classmethod
    def masked(cls, counts_E: torch.Tensor, capacity: int, num_experts: int) -> "Rows":
        return cls(k.ROWS_MASKED, counts=counts_E, capacity=capacity, num_experts=num_experts)

    def valid_rows(self) -> torch.Tensor | None:
        """Masked rows: bool [E * capacity], True for rows below their expert's count (the
        rows of x that hold tokens); None for the other modes (every row of x is a token)."""
        if self.mode != k.ROWS_MASKED:
            return None
        local = torch.arange(self.capacity, device=self.counts.device)
        return (local[None, :] < self.counts[:, None]).reshape(-1)

    def expert_rows(self, gemm: str, top_k: int) -> dict:
        """`quantize_expert_rows` arguments (num_rows, src_div, experts, expert_div) that give
        each row of a GEMM's input its expert: gemm 'gate_up' (x, whose rows become the pairs'
        rows in sorted / direct mode, read with top_k 1) or 'down' (h, one row per slot)."""
        if self.mode == k.ROWS_MASKED:  # row r of x and of h: expert r // capacity
            return dict(num_rows=self.slots(), expert_div=self.capacity)
        if self.ids is None:
            raise ValueError("per-expert activation scales need the pairs' ids: Rows.sorted(..., "
                             "ids=...)")  # fmt: skip
        if gemm == "gate_up":
            return dict(num_rows=self.ids.numel(), src_div=top_k, experts=self.ids)
        if self.mode == k.ROWS_DIRECT:  # h's rows are the pairs
            return dict(num_rows=self.slots(), experts=self.ids)
        a = self.align
        return dict(num_rows=self.slots(), experts=a.block_expert, expert_div=a.block_m)

    def slots(self) -> int:
        """Rows of the intermediate h."""
        if self.mode == k.ROWS_SORTED:
            return self.align.max_rows
        if self.mode == k.ROWS_DIRECT:
            return self.ids.numel()
        return self.capacity * self.num_experts

    def meta(self) -> dict:
        """The GEMM kernels' constexprs of this mode: DIRECT_P (direct rows), the number of
        pairs rounded up to a power of two (`_kernels._tile_rows`)."""
        if self.mode == k.ROWS_DIRECT:
            return {"DIRECT_P": next_pow2(max(self.ids.numel(), 1))}
        return {}

    def args(self, block_m: int, top_k: int) -> tuple:
        """(row_map, block_expert, num_rows, counts, num_pairs, top_k, num_experts, capacity,
        blocks_per_expert, align_m, num_pid_m)"""
        E = self.num_experts
        if self.mode == k.ROWS_SORTED:
            a = self.align
            if a.block_m % block_m:
                raise ValueError(
                    f"GEMM block_m {block_m} must divide the alignment block {a.block_m}"
                )
            return (a.sorted_ids, a.block_expert, a.num_rows, a.num_rows, a.num_pairs, top_k,
                    E, 0, 1, a.block_m, a.max_rows // block_m)  # fmt: skip
        if self.mode == k.ROWS_DIRECT:
            ids, P = self.ids, self.ids.numel()
            return (ids, ids, ids, ids, P, top_k, E, 0, 1, 1, P)
        bpe = cdiv(self.capacity, block_m)
        c = self.counts
        return (c, c, c, c, 0, 1, E, self.capacity, bpe, block_m, bpe * E)


_SPLIT_COUNTS: dict[tuple, torch.Tensor] = {}


def split_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros [>= tiles]: the arrival counts of a split-K gate_up's output tiles, one buffer
    per (device, stream), kept between calls (each launch leaves it zeroed again: no memset
    per call). Grown outside CUDA-graph capture; during a capture that needs more, a zeroed
    buffer of the graph's own (its memset is part of the graph)."""
    stream = 0
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None
                              else torch.cuda.current_device())  # fmt: skip
        stream = torch.cuda.current_stream(device).cuda_stream
    key = (str(device), stream)
    buf = _SPLIT_COUNTS.get(key)
    if buf is not None and buf.numel() >= tiles:
        return buf
    size = max(tiles, 1 << 14)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=device)
    _SPLIT_COUNTS[key] = buf = torch.zeros(size, dtype=torch.int32, device=device)
    return buf


def _fuse_act_quant(wq: "WeightQuant | None", rows: Rows, cfg: GemmConfig, a: torch.Tensor):
    """Whether the GEMM quantizes its input itself (`_kernels._quant_a_tile`) instead of a
    `quantize_input` kernel before it: fp8 per-token-group activations with one group per K
    step, direct rows (tiny batches, where the extra launch costs more than the GEMM's
    repeated quantization of its few rows; `PIPELINE.fuse_act_quant`), on a GPU (the Triton
    interpreter casts to fp8 wrongly)."""
    return (
        PIPELINE.fuse_act_quant
        and wq is not None
        and wq.quant == k.Q_W8A8
        and wq.ascale == k.S_GROUP
        and wq.spec.act_dtype == torch.float8_e4m3fn
        and cfg.block_k == wq.group
        and rows.mode == k.ROWS_DIRECT
        and a.device.type == "cuda"
    )


def h_quant_dtype(w: ExpertWeights, cfg: GemmConfig, x: torch.Tensor) -> torch.dtype | None:
    """The dtype in which gate_up (config `cfg`) stores h already quantized for down
    (`_kernels._store_h_quantized`), or None where a `quantize_input` kernel does it between
    the GEMMs: fp8 per-token-group activations, gate_up's tiles whole groups wide (block_n a
    multiple of the group), on a GPU (the Triton interpreter casts to fp8 wrongly), with
    `PIPELINE.quant_h_in_gate_up`."""
    spec = w.spec
    if not (PIPELINE.quant_h_in_gate_up and w.is_quantized and x.device.type == "cuda"):
        return None
    if spec.name != "fp8_w8a8" or spec.act_scheme != "token_group":
        return None
    return spec.act_dtype if cfg.block_n % spec.act_group_size == 0 else None


def _use_tma(cfg: GemmConfig, wq: "WeightQuant | None") -> bool:
    """TMA weight loads for unquantized and w8a8 weights (stored values are the dot operands);
    packed / weight-only formats load through pointers (dequantized in registers)."""
    return cfg.tma and (wq is None or wq.quant == k.Q_W8A8)


def _quant_args(wq: "WeightQuant | None", data: torch.Tensor, xs: torch.Tensor) -> tuple:
    """(ws, wz, wg, xs, stride_wse, stride_wsn, stride_xs) kernel arguments."""
    if wq is None:
        return data, data, data, xs, 0, 0, 0
    ws, wz, wg, se, sn = wq.args(data)
    stride_xs = xs.stride(0) if wq.quant == k.Q_W8A8 and xs.dim() == 2 else 0
    return ws, wz, wg, xs, se, sn, stride_xs


def gate_up(
    x: torch.Tensor,
    rows: Rows,
    w: ExpertWeights,
    act: ActivationSpec,
    cfg: GemmConfig,
    top_k: int,
    out: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    warmup: bool = False,
    pdl: bool = False,
    quant_h: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """h [slots, I] = act(x @ w13[e].T + b13[e]) per row block; x is [T, H] (sorted / direct
    rows) or [E * capacity, H] (masked rows). `zero`: a tensor this launch also zeroes (the
    atomic down GEMM's output). w8a8 formats: x is quantized here first (h stays in x's
    dtype; zero-initialised for the 'dynamic_tensor' scheme, whose scale of h must not see
    rows the GEMM leaves unwritten). cfg.split_k > 1: the K shares meet in a float32
    workspace [split_k, slots, 2I] (`_kernels._split_fixup`). pdl: the quantization of x and
    this GEMM as programmatic dependent launches (`decode_pdl`).
    quant_h (fp8 per-token-group formats, block_n a multiple of the group: `h_quant_dtype`):
    returns h quantized for down instead, (q [slots, I] of this dtype, scales float32 [slots,
    I / group]), as `quantize_input(h, w.spec)` would give it; float32 gives the values just
    before the fp8 cast (the interpreter tests)."""
    I, H = w.intermediate_size, w.hidden_size
    E = w.num_experts
    act_dtype = x.dtype
    wq = WeightQuant(w, "w13") if w.is_quantized else None
    if wq is not None:
        cfg = wq.clamp(cfg)
    split = cfg.split_k
    h_group = 128
    if quant_h is not None:
        spec = w.spec
        h_group = spec.act_group_size if w.is_quantized else 0
        if out is not None or not h_group or cfg.block_n % h_group:
            raise ValueError(
                f"quant_h: needs per-token-group activations with a group that divides block_n "
                f"{cfg.block_n}, and no `out`; got "
                f"{spec.describe() if spec else 'unquantized weights'}"
            )
        hq = torch.empty(rows.slots(), I, dtype=quant_h, device=x.device)
        hs = torch.empty(rows.slots(), cdiv(I, h_group), dtype=torch.float32,
                         device=x.device)  # fmt: skip
        out = x  # h_ptr: unwritten, its dtype (x's) the one h is rounded to before quantizing
    if out is None:
        dyn = w.is_quantized and w.spec.act_scheme == "dynamic_tensor"
        alloc = torch.zeros if dyn else torch.empty
        out = alloc(rows.slots(), I, dtype=x.dtype, device=x.device)
    if quant_h is None:
        hq = hs = out
    if act.name not in ACT_CODES:
        raise ValueError(f"activation: unknown {act.name!r}; allowed: {', '.join(ACT_CODES)}")
    static = wq is not None and wq.spec.act_scheme == "static_tensor"
    if static:
        x_rows = rows.expert_rows("gate_up", top_k)
        if rows.mode != k.ROWS_MASKED:
            top_k = 1  # x is quantized into the pairs' rows: row p is pair p
    row_args = rows.args(cfg.block_m, top_k)
    tiles = row_args[-1] * cdiv(I, cfg.block_n)
    grid = (tiles * split,)
    if grid[0] == 0:
        if zero is not None:
            zero.zero_()
        return out if quant_h is None else (hq, hs)
    part = count = out
    if split > 1:
        part = torch.empty(split, rows.slots(), 2 * I, dtype=torch.float32, device=x.device)
        count = split_counts(x.device, tiles)
    xs = x
    tile_rows = 2 * cfg.block_n if act.interleaved else cfg.block_n  # weight rows per program
    fused = _fuse_act_quant(wq, rows, cfg, x)
    if static:
        x, xs = quantize_expert_rows(x, w.a13_scale, **x_rows, dtype=w.spec.act_dtype,
                                     pdl=(pdl, pdl))  # fmt: skip
        xs = xs.view(-1, 1)
    elif wq is not None and wq.quant == k.Q_W8A8 and not fused:
        x, xs = quantize_input(x, w.spec, rows.valid_rows(), pdl=(pdl, pdl))
    use_tma = _use_tma(cfg, wq) and tma_ok(w.w13) and w.w13.is_contiguous()
    w_desc = None
    if use_tma:
        rows_per_tile = 2 * cfg.block_n if act.interleaved else cfg.block_n
        w_desc = _desc(w.w13.view(E * 2 * I, H), [rows_per_tile, cfg.block_k])
    b13 = w.b13 if w.b13 is not None else w.w13
    zero_t = zero if zero is not None else out
    args = (
        x, w.w13, w_desc, b13, out, hq, hs, zero_t, *row_args,
        zero.numel() if zero is not None else 0, I, H,
        x.stride(0), w.w13.stride(0), w.w13.stride(1), b13.stride(0), hq.stride(0),
        part, part.stride(0) if split > 1 else 0, count,
        float(act.alpha), float(act.limit), *_quant_args(wq, w.w13, xs),
    )  # fmt: skip
    meta = dict(
        ACT=ACT_CODES[act.name],
        HAS_BIAS=w.b13 is not None,
        INTERLEAVED=act.interleaved,
        ROWS=rows.mode,
        ZERO_OUT=zero is not None,
        SPLIT_K=split,
        DOT_PRECISION=_precision(act_dtype),
        **(wq.meta(cfg, tile_rows, act_dtype, fused) if wq is not None else _NO_QUANT_META),
        **_gemm_meta(cfg, H, use_tma),
        **_pdl_meta(pdl, pdl),
        **rows.meta(),
        QUANT_H=quant_h is not None,
        H_GROUP=h_group,
    )
    meta |= _tail_meta("gate_up", cfg, rows, wq) | _fold_meta("gate_up", cfg, rows, wq)
    _launch(k._gate_up_kernel, grid, args, meta, warmup)
    return out if quant_h is None else (hq, hs)


def quantize_h(
    h: torch.Tensor, rows: Rows, w: ExpertWeights, top_k: int, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """down's input h [slots, I] quantized as `down` reads it (w8a8 formats) -> (q, scales):
    with 'static_tensor' each slot by its expert's scale (scales [slots, 1]), else
    `quantize_input` with the spec's scheme (unwritten rows of h are zeros for
    dynamic_tensor)."""
    if w.spec.act_scheme == "static_tensor":
        q, s = quantize_expert_rows(h, w.a2_scale, **rows.expert_rows("down", top_k),
                                    dtype=w.spec.act_dtype, pdl=(pdl, pdl))  # fmt: skip
        return q, s.view(-1, 1)
    return quantize_input(h, w.spec, pdl=(pdl, pdl))


def down(
    h: torch.Tensor,
    rows: Rows,
    w: ExpertWeights,
    cfg: GemmConfig,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    top_k: int = 1,
    warmup: bool = False,
    pdl: bool = False,
    h_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = h @ w2[e].T + b2[e] per row block. Sorted / direct rows: times the pair's weight,
    into out [P, H] by pair (cfg.reduce 'kernel') or added into a zeroed out [T, H] by token
    ('atomic'). Masked rows: unweighted into out [E * capacity, H]. pdl: the quantization of h
    and this GEMM as programmatic dependent launches (`decode_pdl`). h_scales: h is already
    quantized for a w8a8 format (`gate_up(..., quant_h=...)`), these its scales."""
    I, H = w.intermediate_size, w.hidden_size
    E = w.num_experts
    masked = rows.mode == k.ROWS_MASKED
    wq = WeightQuant(w, "w2") if w.is_quantized else None
    if wq is not None:
        cfg = wq.clamp(cfg)
    atomic = (not masked) and cfg.reduce == "atomic"
    if cfg.split_k > 1 and not masked and not atomic:
        raise ValueError(
            f"down config: split_k={cfg.split_k} needs reduce='atomic' (the K shares are added "
            f"into the output), got reduce={cfg.reduce!r}"
        )
    split_k = cfg.split_k if atomic else 1
    row_args = rows.args(cfg.block_m, top_k)
    grid = (row_args[-1] * cdiv(H, cfg.block_n) * split_k,)
    if grid[0] == 0:
        return out
    hs = h if h_scales is None else h_scales
    dot_dtype = h.dtype
    fused = h_scales is None and _fuse_act_quant(wq, rows, cfg, h)
    if wq is not None and wq.quant == k.Q_W8A8 and h_scales is None and not fused:
        h, hs = quantize_h(h, rows, w, top_k, pdl)
    use_tma = _use_tma(cfg, wq) and tma_ok(w.w2, h) and w.w2.is_contiguous()
    h_desc = w_desc = None
    if use_tma:
        h_desc = _desc(h, [cfg.block_m, cfg.block_k])
        w_desc = _desc(w.w2.view(E * H, I), [cfg.block_n, cfg.block_k])
    b2 = w.b2 if w.b2 is not None else w.w2
    tw = topk_weights if topk_weights is not None else out
    args = (
        h, h_desc, w.w2, w_desc, b2, out, tw, *row_args, H, I,
        h.stride(0), w.w2.stride(0), w.w2.stride(1), b2.stride(0), out.stride(0),
        *_quant_args(wq, w.w2, hs),
    )  # fmt: skip
    meta = dict(
        HAS_BIAS=w.b2 is not None,
        ROWS=rows.mode,
        ATOMIC=atomic,
        SPLIT_K=split_k,
        DOT_PRECISION=_precision(dot_dtype),
        **(wq.meta(cfg, cfg.block_n, dot_dtype, fused) if wq is not None else _NO_QUANT_META),
        **_gemm_meta(cfg, I, use_tma),
        **_pdl_meta(pdl, False),
        **rows.meta(),
    )
    meta |= _tail_meta("down", cfg, rows, wq) | _fold_meta("down", cfg, rows, wq)
    _launch(k._down_kernel, grid, args, meta, warmup)
    return out


def sum_topk(y_PH: torch.Tensor, ids_TK: torch.Tensor, num_experts: int, out: torch.Tensor):
    """out [T, H] = sum over k of y [T*K, H] rows whose id is in [0, E)."""
    T, K = ids_TK.shape
    H = y_PH.shape[1]
    if T == 0:
        return out
    block_h = min(1024, next_pow2(H))
    block_t = max(1, 2048 // block_h)
    grid = (cdiv(T, block_t), cdiv(H, block_h))
    k._sum_topk_kernel[grid](
        y_PH, ids_TK, out, T, H, K, num_experts, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4
    )
    return out


@functools.lru_cache(maxsize=256)
def _direct_rows(cfg: GemmConfig) -> GemmConfig:
    """`cfg` for direct rows (no alignment): blocks of at most 16 rows."""
    return replace(cfg, block_m=min(cfg.block_m, 16))


def configs_for(
    num_tokens: float, top_k: int, w: ExpertWeights, dtype: torch.dtype, device: torch.device
) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up config, down config) for a standard call with `num_tokens` tokens' worth of
    local pairs (T * local_share: may be below 1 on an EP rank)."""
    dev, cap = device_key(device)
    name = _TL_DTYPES[dtype]
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
    quant = quant_tag(w.spec)
    return (
        get_config("gate_up", num_tokens, top_k, E, H, I, name, dev, quant, cap),
        get_config("down", num_tokens, top_k, E, H, I, name, dev, quant, cap),
    )


def kernel_inputs(x_TH: torch.Tensor, topk: TopKOutput):
    """(x [T, H] with unit last stride, ids [T, K] int32, weights [T, K] float32), both
    contiguous: the forms the fused-MoE kernels read."""
    if x_TH.stride(-1) != 1:
        x_TH = x_TH.contiguous()
    ids = topk.ids if topk.ids.dtype == torch.int32 else topk.ids.to(torch.int32)
    return x_TH, ids.contiguous(), topk.weights.float().contiguous()


def rows_per_expert(num_tokens: float, top_k: int, num_experts: int) -> float:
    """Expected pairs of a used expert under uniform routing: num_tokens * top_k pairs over
    the 1 - (1 - 1/E)^(T K) share of the num_experts experts that they use."""
    pairs = num_tokens * top_k
    if num_experts <= 1:
        return pairs
    return pairs / max(expected_experts_used(pairs, num_experts), 1e-9)


def fused_moe(
    x_TH: torch.Tensor,
    topk: TopKOutput,
    w: ExpertWeights,
    act: ActivationSpec,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    local_share: float = 1.0,
) -> torch.Tensor:
    """out [T, H] in x's dtype = sum over k of weight_k * expert_{id_k}(x); ids of -1 (or >= E)
    contribute 0. `configs` (gate_up, down) overrides the tuned/heuristic lookup, which is for
    T * local_share tokens (`StandardDispatchOutput.local_share`)."""
    _dtype_name(x_TH)
    _check_weights(x_TH, w)
    T, H = x_TH.shape
    K = topk.top_k
    if T == 0 or K == 0:
        return x_TH.new_zeros(T, H)
    x_TH, ids, weights = kernel_inputs(x_TH, topk)
    cfg1, cfg2 = configs or configs_for(T * local_share, K, w, x_TH.dtype, x_TH.device)
    pdl = decode_pdl(x_TH, T * K)
    if T <= PIPELINE.direct_max_tokens:  # no alignment; an expert's pairs share a block
        cfg1, cfg2 = _direct_rows(cfg1), _direct_rows(cfg2)
        rows = Rows.direct(ids.view(-1), w.num_experts)
    else:
        align = align_block_size(ids, w.num_experts, max(cfg1.block_m, cfg2.block_m), pdl=pdl)
        per_expert = rows_per_expert(T * local_share, K, w.num_experts)
        rows = Rows.sorted(align, w.num_experts, per_expert, ids.view(-1))
    quant_h = h_quant_dtype(w, cfg1, x_TH)
    atomic = cfg2.reduce == "atomic"
    out = torch.empty(T, H, dtype=x_TH.dtype, device=x_TH.device) if atomic else None
    h = gate_up(x_TH, rows, w, act, cfg1, K, zero=out, pdl=pdl, quant_h=quant_h)
    h, hs = h if quant_h is not None else (h, None)
    if atomic:
        return down(h, rows, w, cfg2, out, weights, K, pdl=pdl, h_scales=hs)
    y = torch.empty(T * K, H, dtype=x_TH.dtype, device=x_TH.device)
    down(h, rows, w, cfg2, y, weights, K, pdl=pdl, h_scales=hs)
    return sum_topk(y, ids, w.num_experts, torch.empty_like(x_TH))


def masked_configs(
    capacity: int, w: ExpertWeights, dtype: torch.dtype, device: torch.device
) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up config, down config) for the masked format with `capacity` rows per expert
    (`configs.masked_config`: the shape's tuned table at C rows per expert, else a heuristic)."""
    dev, _ = device_key(device)
    E, H, I = w.num_experts, w.hidden_size, w.intermediate_size
    return tuple(masked_config(g, capacity, E, H, I, _TL_DTYPES[dtype], dev, quant_tag(w.spec))
                 for g in ("gate_up", "down"))  # fmt: skip


def fused_moe_masked(
    x_ECH: torch.Tensor,
    counts_E: torch.Tensor,
    w: ExpertWeights,
    act: ActivationSpec,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
) -> torch.Tensor:
    """out [E, C, H] in x's dtype: expert e on its first counts[e] rows (counts clamp to C);
    rows at or past the count are left unwritten."""
    _dtype_name(x_ECH)
    _check_weights(x_ECH, w)
    E, C, H = x_ECH.shape
    if E != w.num_experts:
        raise ValueError(f"x has {E} experts but the weights have {w.num_experts}")
    out = torch.empty_like(x_ECH)
    if E * C == 0:
        return out
    x = x_ECH.reshape(E * C, H)
    if x.stride(-1) != 1 or x.stride(0) != H:
        x = x.contiguous()
    counts = counts_E.to(device=x.device, dtype=torch.int32).contiguous()
    cfg1, cfg2 = configs or masked_configs(C, w, x_ECH.dtype, x_ECH.device)
    rows = Rows.masked(counts, C, E)
    h = gate_up(x, rows, w, act, cfg1, 1)
    down(h, rows, w, cfg2, out.view(E * C, H))
    return out
