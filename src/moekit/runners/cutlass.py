"""The `cutlass` runner: PyTorch's CUTLASS grouped GEMMs (`torch._grouped_mm`) with our own
permute, activation and weighted top-k reduce around them.

Standard format (x [T, H], top-k ids [T, K]):
  1. `group_rows`: pairs sorted by expert, on the device (no host sync; M = T*K rows, static);
  2. gather x rows -> [M, H];  h = grouped_mm(x_rows, w13^T, offs) [M, 2I];
  3. a = act(h + b13) [M, I] (Triton kernel on CUDA);  y = grouped_mm(a, w2^T, offs) [M, H];
  4. out[t] = sum_k weight[t, k] * (y[row(t, k)] + b2) in float32 (Triton kernel on CUDA).
Masked format (x [E, C, H], counts [E]): batched grouped_mm per expert, same activation; returns
unweighted expert outputs [E, C, H] (rows past counts undefined).

CUDA-graph safe: every shape depends on (T, K, E, H, I) only, and nothing reads device values on
the host. On CUDA the grouped GEMM takes its CUTLASS path for bfloat16 on SM90+ only (other dtypes
fall back to a loop that copies the offsets to the host), so the runner declares bfloat16 only
there; on CPU (tests) float32 / float16 / bfloat16 all run.

fp8_w8a8 weights (rowwise: weight_scale 'channel' or 'tensor'; activations 'token',
'dynamic_tensor' or 'static_tensor'): both GEMMs run `torch._scaled_grouped_mm` with one scale per
row of the activations and one per output channel of each expert (CUDA; on CPU an emulation with
dequantized operands, `scaled_grouped_mm_torch`, for tests); each expert's rows are padded to 16
and H, I must be multiples of 16. The activation scales follow the reference runner: 'token' per
row, 'dynamic_tensor' one over all of x (GEMM 1) / all valid intermediate rows (GEMM 2),
'static_tensor' the expert's a13_scale / a2_scale. Block-scaled fp8 is the `deep_gemm` runner's.

Alignment: the grouped GEMM wants 16-byte row strides (H and I multiples of 8 in bf16). Other sizes
run through zero-padded copies of the weights (made once per weight tensor version and cached) and
of the activations; the zero padding changes no result (every activation maps gate = up = 0 to 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform
from moekit.quant.act_quant import EPS, quantize_act, quantize_act_ref, tensor_scale
from moekit.quant.spec import FP8_DTYPE, FP8_MAX
from moekit.router import TopKOutput
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners._grouped import group_rows
from moekit.runners._shared import DerivedCopies
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import (
    MASKED,
    STANDARD,
)

# Row stride alignment the CUTLASS grouped GEMM needs, in bytes.
STRIDE_ALIGN_BYTES = 16
# Padded weight copies kept per runner instance (one layer owns one instance, so one is enough;
# more would keep a second copy of many layers' weights alive, and freed weights with them).
_MAX_CACHED_PADDINGS = 1
# fp8 (rowwise) path: supported spec parameters; rows per expert group and H / I alignment.
FP8_WEIGHT_SCALES = ("channel", "tensor")
FP8_ACT_SCHEMES = ("token", "dynamic_tensor", "static_tensor")
FP8_ALIGN = 16


def fp8_spec_problem(spec) -> str | None:
    """None if `spec` is an fp8 spec this runner runs (rowwise scales), else why not."""
    if spec is None or spec.name != "fp8_w8a8":
        name = "unquantized" if spec is None else spec.describe()
        return f"runner 'cutlass' runs unquantized or fp8_w8a8 weights, got {name}"
    if spec.weight_scale not in FP8_WEIGHT_SCALES:
        return (
            f"runner 'cutlass' runs fp8 weights with weight_scale in {FP8_WEIGHT_SCALES} "
            f"(rowwise torch._scaled_grouped_mm), got {spec.describe()}; block scales: deep_gemm"
        )
    if spec.act_scheme not in FP8_ACT_SCHEMES:
        return (
            f"runner 'cutlass' runs fp8 activations scaled per {FP8_ACT_SCHEMES}, got "
            f"{spec.describe()}"
        )
    return None


def scaled_grouped_mm_torch(
    a_MK: torch.Tensor, s_M: torch.Tensor, w_ENK: torch.Tensor, s_EN: torch.Tensor,
    ends_E: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """Twin of torch._scaled_grouped_mm (2d x 3d, rowwise scales): rows of group e times w[e]^T,
    (a * s_M) @ (w * s_EN)^T in float32 -> [M, N] out_dtype (rows past ends_E[-1] undefined)."""
    a = a_MK.float() * s_M.float().unsqueeze(1)
    w = w_ENK.float() * s_EN.float().unsqueeze(-1)
    return torch._grouped_mm(a, w.transpose(-1, -2), ends_E).to(out_dtype)


def scaled_grouped_mm(a_MK, s_M, w_ENK, s_EN, ends_E, out_dtype) -> torch.Tensor:
    """fp8 a [M, K] (row scales s_M) x fp8 w [E, N, K] (channel scales s_EN), grouped by ends_E."""
    if a_MK.is_cuda:
        return torch._scaled_grouped_mm(
            a_MK, w_ENK.transpose(-1, -2), s_M.float().contiguous(), s_EN.float().contiguous(),
            offs=ends_E, out_dtype=out_dtype,
        )
    return scaled_grouped_mm_torch(a_MK, s_M, w_ENK, s_EN, ends_E, out_dtype)


def _channel_scales(scale: torch.Tensor, E: int, N: int) -> torch.Tensor:
    """Weight scale [E] ('tensor') or [E, N] ('channel') -> [E, N] float32."""
    if scale.dim() == 1:
        return scale.float().unsqueeze(1).expand(E, N).contiguous()
    return scale.float()


def quantize_rows(
    a_MK: torch.Tensor,
    spec,
    *,
    valid_M: torch.Tensor,
    static_M: torch.Tensor | None = None,
    tensor_of: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize GEMM input rows to fp8 with one scale per row -> (q [M, K], s [M] float32).
    'token': each row's own; 'dynamic_tensor': one over `tensor_of` (default: the valid rows);
    'static_tensor': `static_M` (the row's expert's calibrated scale)."""
    scheme = spec.act_scheme
    M = a_MK.shape[0]
    if scheme == "token":
        if a_MK.is_cuda:
            q, s = quantize_act(a_MK, "token", FP8_DTYPE)
        else:
            q, s = quantize_act_ref(a_MK, "token", FP8_DTYPE)
        return q, s.reshape(M)
    if scheme == "dynamic_tensor":
        if tensor_of is not None:
            s1 = tensor_scale(tensor_of, FP8_DTYPE)
        else:
            amax = torch.where(valid_M.unsqueeze(1), a_MK.float().abs(), 0.0).amax()
            s1 = (amax.clamp_min(EPS) / FP8_MAX).reshape(1)
        s = s1.expand(M)
    else:
        s = static_M.float()
    q, _ = quantize_act_ref(a_MK, "static_tensor", FP8_DTYPE, scale=s.unsqueeze(1))
    return q, s.contiguous()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_gate_up(t: torch.Tensor, I: int, Ip: int, interleaved: bool, dim: int) -> torch.Tensor:
    """Grow the gate/up dimension `dim` of `t` from 2I to 2Ip with zeros: each half padded
    (gate rows first, then up), or zero pairs appended when `interleaved`."""
    extra = Ip - I
    if extra == 0:
        return t
    shape = list(t.shape)
    if interleaved:
        shape[dim] = 2 * extra
        return torch.cat([t, t.new_zeros(shape)], dim=dim)
    shape[dim] = extra
    zeros = t.new_zeros(shape)
    return torch.cat([t.narrow(dim, 0, I), zeros, t.narrow(dim, I, I), zeros], dim=dim)


class _PaddedWeights:
    """w13 [E, 2Ip, Hp], w2 [E, Hp, Ip], b13 [E, 2Ip] | None: `weights` zero-padded so that H and
    I are multiples of `align` elements (the same tensors when already aligned)."""

    def __init__(self, w: ExpertWeights, act: ActivationSpec, align: int) -> None:
        H, I = w.hidden_size, w.intermediate_size
        self.H, self.I = H, I
        self.Hp, self.Ip = _round_up(H, align), _round_up(I, align)
        w13, w2, b13 = w.w13, w.w2, w.b13
        if self.Hp != H:
            w13 = F.pad(w13, (0, self.Hp - H))
            w2 = F.pad(w2, (0, 0, 0, self.Hp - H))
        if self.Ip != I:
            w13 = _pad_gate_up(w13, I, self.Ip, act.interleaved, dim=1)
            w2 = F.pad(w2, (0, self.Ip - I))
            if b13 is not None:
                b13 = _pad_gate_up(b13, I, self.Ip, act.interleaved, dim=1)
        self.w13, self.w2, self.b13 = w13, w2, b13
        self.padded = (self.Hp, self.Ip) != (H, I)


@register
class CutlassRunner(Runner):
    """`torch._grouped_mm` (CUTLASS, SM90+) for both GEMMs; device-side grouping, Triton
    activation and weighted top-k reduce around them; standard and masked formats; biases;
    bf16 and fp8 (rowwise); CUDA-graph safe."""

    name = "cutlass"
    caps = RunnerCaps(
        formats=frozenset({STANDARD, MASKED}),
        weight_formats=frozenset({"unquantized", "fp8_w8a8"}),
        activations=frozenset(ACTIVATIONS),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"bfloat16", "float16", "float32"}),
        bias=True,
        cuda_graph=True,
    )

    def __init__(self, *, use_triton: bool | None = None) -> None:
        """use_triton: force the Triton kernels (True; on CPU that needs TRITON_INTERPRET=1) or the
        torch twins (False); None picks Triton on CUDA tensors."""
        self.use_triton = use_triton
        self._padded: DerivedCopies[_PaddedWeights] = DerivedCopies(_MAX_CACHED_PADDINGS)

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        if not hasattr(torch, "_grouped_mm"):
            return Availability(False, f"torch {torch.__version__} has no torch._grouped_mm")
        if platform.is_cuda and platform.sm() < 90:
            return Availability(
                False,
                f"needs SM90+ (Hopper or newer) for torch._grouped_mm's CUTLASS kernels; this GPU "
                f"is SM{platform.sm()}",
            )
        return Availability(True)

    @classmethod
    def unsupported(cls, fmt, weight_format, activation, dtype, device, bias):
        problem = super().unsupported(fmt, weight_format, activation, dtype, device, bias)
        if problem is None and device == "cuda" and dtype != "bfloat16":
            return (
                f"runner 'cutlass' does not support dtype {dtype!r} on cuda: torch._grouped_mm "
                "runs CUTLASS for bfloat16 only (other dtypes take a host-synchronising loop); "
                "it supports: bfloat16"
            )
        return problem

    @classmethod
    def workload_problem(cls, work, platform=None) -> str | None:
        """fp8: the spec must be rowwise and H, I multiples of 16 (used by moekit.select)."""
        if work.weight_format != "fp8_w8a8":
            return None
        if work.weight_spec is not None:
            problem = fp8_spec_problem(work.weight_spec)
            if problem:
                return problem
        bad = [
            f"{n}={v}"
            for n, v in (("H", work.hidden_size), ("I", work.intermediate_size))
            if v is not None and v % FP8_ALIGN
        ]
        if bad:
            return f"runner 'cutlass' with fp8 needs H and I multiples of {FP8_ALIGN}, got " + (
                ", ".join(bad)
            )
        return None

    # ------------------------------------------------------------------ helpers

    def _kernels_on(self, x: torch.Tensor) -> bool:
        return kernels.use_triton_for(x) if self.use_triton is None else self.use_triton

    def _weights(self, w: ExpertWeights, act: ActivationSpec, dtype: torch.dtype) -> _PaddedWeights:
        align = STRIDE_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size()
        if w.hidden_size % align == 0 and w.intermediate_size % align == 0:
            return _PaddedWeights(w, act, align)  # no copies: the tensors themselves
        return self._padded.get((w.w13, w.w2, w.b13), (act.interleaved, align),
                                lambda: _PaddedWeights(w, act, align))  # fmt: skip

    def refresh(self, weights: ExpertWeights, act: ActivationSpec) -> None:
        self._padded.refresh((weights.w13, weights.w2, weights.b13),
                             lambda tag: _PaddedWeights(weights, act, tag[1]))  # fmt: skip

    @staticmethod
    def _check_shapes(x: torch.Tensor, w: ExpertWeights) -> None:
        if x.shape[-1] != w.hidden_size:
            raise RunnerError(
                f"runner 'cutlass': x has hidden size {x.shape[-1]}, weights {w.hidden_size}"
            )
        if w.w13.dtype != x.dtype or w.w2.dtype != x.dtype:
            raise RunnerError(
                f"runner 'cutlass': unquantized weights must have the activations' dtype "
                f"{x.dtype}, got w13 {w.w13.dtype}, w2 {w.w2.dtype}"
            )

    # ------------------------------------------------------------------ formats

    def run_standard(
        self, x_TH: torch.Tensor, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec,
        local_share: float = 1.0,
    ) -> torch.Tensor:
        """x [T, H], topk ids/weights [T, K] -> out [T, H] in x's dtype (local_share unused)."""
        if w.is_quantized:
            return self._run_standard_fp8(x_TH, topk, w, act)
        self._check_shapes(x_TH, w)
        T, H = x_TH.shape
        if T == 0:
            return torch.zeros(0, H, dtype=x_TH.dtype, device=x_TH.device)
        pw = self._weights(w, act, x_TH.dtype)
        tri = self._kernels_on(x_TH)
        rows = group_rows(topk.ids, w.num_experts, use_triton=tri)
        x_rows = x_TH[rows.token_M]
        if pw.Hp != H:
            x_rows = F.pad(x_rows, (0, pw.Hp - H))
        h = torch._grouped_mm(x_rows, pw.w13.transpose(-1, -2), rows.ends_E)
        a = kernels.gemm_rows(h, rows.expert_M, act=act, b13_EN=pw.b13, use_triton=tri)[0]
        y = torch._grouped_mm(a, pw.w2.transpose(-1, -2), rows.ends_E)
        return kernels.weighted_reduce(
            y, rows.row_TK, topk.weights, topk.ids, w.b2, H, x_TH.dtype, use_triton=tri
        )

    def run_masked(
        self, x_ECH: torch.Tensor, counts_E: torch.Tensor, w: ExpertWeights, act: ActivationSpec,
        expected_rows: int | None = None,
    ) -> torch.Tensor:
        """x [E, C, H], counts [E] -> unweighted expert outputs [E, C, H] (rows past counts
        undefined). expected_rows is not used: the grouped GEMMs take no size hint."""
        if w.is_quantized:
            return self._run_masked_fp8(x_ECH, counts_E, w, act)
        self._check_shapes(x_ECH, w)
        E, C, H = x_ECH.shape
        if (empty := self.empty_masked(x_ECH, w)) is not None:
            return empty
        pw = self._weights(w, act, x_ECH.dtype)
        tri = self._kernels_on(x_ECH)
        x = x_ECH if pw.Hp == H else F.pad(x_ECH, (0, pw.Hp - H))
        h = torch._grouped_mm(x.contiguous(), pw.w13.transpose(-1, -2))  # [E, C, 2Ip]
        slot = torch.arange(C, device=x.device).unsqueeze(0)
        expert = torch.arange(E, device=x.device, dtype=torch.int32).unsqueeze(1)
        expert_M = torch.where(slot < counts_E.unsqueeze(1), expert, -1).reshape(-1)
        a = kernels.gemm_rows(h.reshape(E * C, -1), expert_M, act=act, b13_EN=pw.b13,
                              use_triton=tri)[0]  # fmt: skip
        y = torch._grouped_mm(a.view(E, C, pw.Ip), pw.w2.transpose(-1, -2))  # [E, C, Hp]
        y = y[..., :H]
        if w.b2 is not None:
            y = (y.float() + w.b2.float().unsqueeze(1)).to(x_ECH.dtype)
        return y.contiguous()

    # ------------------------------------------------------------------ fp8 (rowwise)

    def _check_fp8(self, x: torch.Tensor, w: ExpertWeights) -> None:
        problem = fp8_spec_problem(w.spec)
        if problem is None and (w.hidden_size % FP8_ALIGN or w.intermediate_size % FP8_ALIGN):
            problem = (
                f"runner 'cutlass' with fp8 needs H and I multiples of {FP8_ALIGN}, got "
                f"H={w.hidden_size}, I={w.intermediate_size}"
            )
        if problem is None and x.shape[-1] != w.hidden_size:
            problem = f"runner 'cutlass': x has hidden size {x.shape[-1]}, weights {w.hidden_size}"
        if problem:
            raise RunnerError(problem)

    def _fp8_expert_pass(self, x_rows, ends, expert_M, valid_M, w, act, tri, x_all=None):
        """Both GEMMs on grouped rows: x_rows [M, H] -> y [M, H] in x's dtype (rows of no group
        undefined). x_all: the tensor a 'dynamic_tensor' GEMM-1 scale is taken over."""
        spec, E = w.spec, w.num_experts
        I, H = w.intermediate_size, w.hidden_size
        e = expert_M.long().clamp(min=0)
        static1 = w.a13_scale[e] if w.a13_scale is not None else None
        q, s = quantize_rows(x_rows, spec, valid_M=valid_M, static_M=static1, tensor_of=x_all)
        h = scaled_grouped_mm(q, s, w.w13, _channel_scales(w.w13_scale, E, 2 * I), ends,
                              x_rows.dtype)
        a = kernels.gemm_rows(h, expert_M, act=act, b13_EN=w.b13, use_triton=tri)[0]
        static2 = w.a2_scale[e] if w.a2_scale is not None else None
        q, s = quantize_rows(a, spec, valid_M=valid_M, static_M=static2)
        return scaled_grouped_mm(q, s, w.w2, _channel_scales(w.w2_scale, E, H), ends, x_rows.dtype)

    def _run_standard_fp8(self, x_TH, topk, w, act) -> torch.Tensor:
        self._check_fp8(x_TH, w)
        T, H = x_TH.shape
        if T == 0:
            return torch.zeros(0, H, dtype=x_TH.dtype, device=x_TH.device)
        tri = self._kernels_on(x_TH)
        rows = group_rows(topk.ids, w.num_experts, align=FP8_ALIGN, use_triton=tri)
        valid = rows.expert_M >= 0
        x_rows = x_TH[rows.token_M]
        y = self._fp8_expert_pass(
            x_rows, rows.ends_E, rows.expert_M, valid, w, act, tri, x_all=x_TH
        )
        return kernels.weighted_reduce(
            y, rows.row_TK, topk.weights, topk.ids, w.b2, H, x_TH.dtype, use_triton=tri
        )

    def _run_masked_fp8(self, x_ECH, counts_E, w, act) -> torch.Tensor:
        self._check_fp8(x_ECH, w)
        E, C, H = x_ECH.shape
        if (empty := self.empty_masked(x_ECH, w)) is not None:
            return empty
        tri = self._kernels_on(x_ECH)
        dev = x_ECH.device
        # one group of Cp rows per expert (2d x 3d with offsets (e + 1) * Cp), Cp = C rounded up
        # to the row alignment of the standard path (zero rows appended when C is not aligned)
        Cp = -(-C // FP8_ALIGN) * FP8_ALIGN
        if Cp != C:
            x_ECH = F.pad(x_ECH, (0, 0, 0, Cp - C))
        C_out, C = C, Cp
        ends = (torch.arange(1, E + 1, device=dev, dtype=torch.int32) * C).contiguous()
        slot = torch.arange(C, device=dev).unsqueeze(0)
        expert = torch.arange(E, device=dev, dtype=torch.int32).unsqueeze(1)
        expert_M = torch.where(slot < counts_E.unsqueeze(1), expert, -1).reshape(-1)
        valid = expert_M >= 0
        expert_rows = expert.expand(E, C).reshape(-1)  # the expert of every row (static scales)
        spec = w.spec
        I = w.intermediate_size
        x = x_ECH.reshape(E * C, H)
        static1 = w.a13_scale[expert_rows.long()] if w.a13_scale is not None else None
        q, s = quantize_rows(x, spec, valid_M=valid, static_M=static1)
        h = scaled_grouped_mm(q, s, w.w13, _channel_scales(w.w13_scale, E, 2 * I), ends,
                              x_ECH.dtype)
        a = kernels.gemm_rows(h, expert_M, act=act, b13_EN=w.b13, use_triton=tri)[0]
        static2 = w.a2_scale[expert_rows.long()] if w.a2_scale is not None else None
        q, s = quantize_rows(a, spec, valid_M=valid, static_M=static2)
        y = scaled_grouped_mm(q, s, w.w2, _channel_scales(w.w2_scale, E, H), ends, x_ECH.dtype)
        if w.b2 is not None:
            y = (y.float() + w.b2.float()[expert_rows.long()]).to(x_ECH.dtype)
        return y.view(E, C, H)[:, :C_out].contiguous()
