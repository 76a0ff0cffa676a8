"""The `deep_gemm` runner: DeepGEMM's SM90 grouped GEMMs (optional extra `sgl-deep-gemm`, import
name `deep_gemm`) around our own permute, activation and reduce kernels.

The kernels are DeepGEMM's; moekit builds and launches them itself (`deep_gemm_jit`: nvcc, once
per configuration, cached), because the package's compiled binding reads only the torch it was
built against (0.2.2 misreads torch 2.11's tensors).

Weights: unquantized bfloat16 (DeepGEMM's bf16 kernel) or fp8_w8a8 with 128x128 block scales and
per-token-group (1x128) activation scales (DeepSeek-V3's recipe; `moekit.quant.Fp8W8A8` with
weight_scale='block'; DeepGEMM's 1d2d kernel). Layouts:
  standard -> DeepGEMM's contiguous "psum" layout (prefill): the (token, expert) pairs sorted
              by expert by `group_rows` (the triton runner's alignment kernels; on the device,
              static row bound, no host sync), each expert's rows starting on a 128-row tile;
              the kernel gets each expert's end row and visits only the tiles that hold pairs;
  masked   -> DeepGEMM's masked layout (decode, what a low-latency all-to-all delivers):
              x [E, C, H] with counts [E]; C is padded to the kernel's row tile (64 when
              `expected_m` <= 64, else 128). `expected_m` (rows per expert to tune for) is the
              dispatcher's expected rows per expert where it gives them, else C
              (`masked_expected_m`).
Each GEMM's input rows (the gather of x; the activation of h with b13) and their fp8
quantization come from one Triton kernel (`_cutlass_kernels.gemm_rows`), the weighted top-k sum
(+ b2) from the cutlass runner's.

H and I need not be multiples of the kernels' tiles or of the 128-wide scale groups (gpt-oss:
2880 = 22.5 x 128): the kernels count K blocks and scale groups rounded up, TMA reads zeros past
each row's end and clips the stores at N, and the last column tile of an expert reads the next
expert's weight rows only into columns it does not store. What is required is that every TMA row
starts on a 16-byte boundary: H and I multiples of 16.

Limits (say so, do not guess): SM90 only (DeepGEMM's SM100 recipes want UE8M0 scale layouts that
this runner does not build); H and I multiples of 16; bfloat16 activations; nvcc needed. The
first call of each GEMM shape compiles a kernel (about 10-60 s, then cached on disk).
"""

from __future__ import annotations

import math

import torch

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform, sm_count
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners import deep_gemm_jit as jit
from moekit.runners._grouped import group_rows
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import MASKED, STANDARD

LIBRARY = "sgl-deep-gemm"
INSTALL_HINT = "pip install sgl-deep-gemm==0.2.2 apache-tvm-ffi==0.1.11 (moekit[deep_gemm])"
SHAPE_ALIGN = 16  # H and I must be multiples of this: TMA rows start on 16 bytes (fp8: 16 values)
FP8_BLOCK = (128, 128)
ACT_GROUP = kernels.FP8_GROUP  # activation scale group: DeepGEMM's 1x128
CONTIGUOUS_ALIGN = 128  # rows per expert in the contiguous layout: the kernel's row tile
# The fp8 gather quantizes each row it gathers, instead of every token first, where a token
# has at most this many local pairs on average (K x the dispatcher's local share: about 1 on an
# EP rank that sees every token, with a third of the tokens holding none). H100, each path
# alone (scripts/gpu_probe_glue.py, session 43, T = 4096 and 16384): quantizing the rows takes
# 0.54-0.76x the time at 1 and 2 pairs (deepseek-v3 EP8, mixtral TP2), 1.03-1.11x at 4
# (gpt-oss), 1.26-1.28x at 8 (qwen3).
ROW_QUANT_MAX_PAIRS = 3.0


def spec_problem(spec) -> str | None:
    """None if a quantization spec is DeepGEMM's fp8 recipe, else why not."""
    if spec is None:
        return None
    if spec.name != "fp8_w8a8":
        return f"runner 'deep_gemm' runs fp8_w8a8 or unquantized weights, got {spec.describe()}"
    if spec.weight_scale != "block" or tuple(spec.block_shape) != FP8_BLOCK:
        return (
            f"runner 'deep_gemm' needs fp8 weights with {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales "
            f"(weight_scale='block'), got {spec.describe()}"
        )
    if spec.act_scheme != "token_group" or spec.act_group_size != ACT_GROUP:
        return (
            f"runner 'deep_gemm' needs per-token-group ({ACT_GROUP}) activation scales "
            f"(activation_scheme='token_group'), got {spec.describe()}"
        )
    return None


def shape_problem(hidden: int | None, intermediate: int | None) -> str | None:
    bad = [
        f"{name}={v}"
        for name, v in (("H", hidden), ("I", intermediate))
        if v is not None and v % SHAPE_ALIGN
    ]
    if bad:
        return (
            f"runner 'deep_gemm' needs H and I (per rank) to be multiples of {SHAPE_ALIGN} (its "
            "TMA rows start on 16-byte boundaries), got " + ", ".join(bad)
        )
    return None


def masked_expected_m(capacity: int, override: int | None, expected_rows: int | None) -> int:
    """The rows per expert the masked GEMMs are tuned for (DeepGEMM's `expected_m`, which picks
    the row tile: `jit.row_tile`): the runner's `expected_m` when set, else the dispatcher's
    expected rows per expert (0: an empty batch, no hint), else the capacity; within
    [1, capacity]. (H100, deepseek-v3 EP8's local shape at C = 1024 with 4 / 16 rows per
    expert: the mean instead of C took 3% off fp8 and 4-5% off bf16; level at C = 64-512;
    benchmarks/triton_notes.md, session 71.)"""
    m = override or expected_rows or capacity
    return max(1, min(capacity, m))


@register
class DeepGemmRunner(Runner):
    """DeepGEMM grouped GEMMs (SM90): contiguous layout for the standard format, masked layout for
    the masked format; bf16 or fp8 block-scaled weights; our activation and reduce kernels."""

    name = "deep_gemm"
    caps = RunnerCaps(
        formats=frozenset({STANDARD, MASKED}),
        weight_formats=frozenset({"unquantized", "fp8_w8a8"}),
        activations=frozenset(ACTIVATIONS),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({"bfloat16"}),
        bias=True,
        cuda_graph=True,
    )

    # why kernels cannot be built here (None: they can); a class attribute so tests can inject it
    toolchain_problem = staticmethod(jit.problem)

    def __init__(self, *, expected_m: int | None = None) -> None:
        """expected_m: DeepGEMM's hint of the typical rows per expert in the masked layout
        (default: the dispatcher's `expected_rows`, else the capacity C)."""
        self.expected_m = expected_m

    @classmethod
    def availability(cls, platform: Platform) -> Availability:
        if not platform.is_cuda:
            return Availability(False, "needs an SM90 (Hopper) GPU; no CUDA GPU")
        if platform.capability is None or platform.capability[0] != 9:
            return Availability(
                False,
                f"implemented for SM90 (Hopper) only (DeepGEMM's SM100 recipes need UE8M0 scale "
                f"layouts); this GPU is SM{platform.sm()}",
            )
        if not platform.has(LIBRARY):
            return Availability(
                False,
                f"needs {LIBRARY} (import deep_gemm), which is not importable ({INSTALL_HINT})",
            )
        problem = cls.toolchain_problem()
        if problem is not None:
            return Availability(False, problem)
        return Availability(True, "DeepGEMM's SM90 kernels, built by moekit with nvcc")

    @classmethod
    def workload_problem(cls, work, platform=None) -> str | None:
        """Shape and quantization rules beyond the caps (used by moekit.select)."""
        if work.weight_format != "unquantized":
            problem = spec_problem(work.weight_spec) if work.weight_spec is not None else None
            if problem:
                return problem
        return shape_problem(work.hidden_size, work.intermediate_size)

    # ------------------------------------------------------------------ pieces

    def _check(self, x: torch.Tensor, w: ExpertWeights) -> bool:
        """Raise RunnerError for inputs this runner cannot take; True when fp8."""
        problem = shape_problem(w.hidden_size, w.intermediate_size)
        if problem:
            raise RunnerError(problem)
        if x.shape[-1] != w.hidden_size:
            raise RunnerError(
                f"runner 'deep_gemm': x has hidden size {x.shape[-1]}, weights {w.hidden_size}"
            )
        if w.is_quantized:
            problem = spec_problem(w.spec)
            if problem:
                raise RunnerError(problem)
            return True
        if w.w13.dtype != torch.bfloat16 or w.w2.dtype != torch.bfloat16:
            raise RunnerError(
                f"runner 'deep_gemm': unquantized weights must be bfloat16, got {w.w13.dtype}"
            )
        return False

    @staticmethod
    def _rows(src, expert_M, fp8: bool, rows_per_group: int, **kw):
        """A GEMM's input rows (`_cutlass_kernels.gemm_rows`): bf16 (rows, None), or fp8
        (rows, scales MN-major [M / rows_per_group, K/128, rows_per_group])."""
        return kernels.gemm_rows(src, expert_M, quant=fp8, rows_per_group=rows_per_group,
                                 use_triton=kernels.use_triton_for(src), **kw)  # fmt: skip

    @staticmethod
    def _gemm(a, sfa, w, scale, layout, m: int, masked: bool, rows_per_group: int):
        """a [rows, K] (bf16, or fp8 with its scales sfa) x w [E, N, K]^T -> [rows, N] bf16
        (the layouts: `deep_gemm_jit.launch`). fp8 weights carry float32 block scales
        [E, N/128, K/128]."""
        E, N, K = w.shape
        dev = a.device
        cfg = jit.choose(sfa is not None, masked, N, K, E, rows_per_group, sm_count(dev))
        d = torch.empty(a.shape[0], N, dtype=torch.bfloat16, device=dev)
        if a.shape[0]:
            with torch.cuda.device(dev):
                jit.launch(cfg, a, w.view(E * N, K), d, layout, m, sfa, scale)
        return d

    # ------------------------------------------------------------------ formats

    def run_standard(self, x_TH, topk, w: ExpertWeights, act: ActivationSpec,
                     local_share: float = 1.0) -> torch.Tensor:  # fmt: skip
        """x [T, H] bf16, topk [T, K] -> out [T, H] bf16 (contiguous layout). local_share: the
        expected share of a token's pairs that are local (`StandardDispatchOutput`), which
        picks how the fp8 gather quantizes (ROW_QUANT_MAX_PAIRS) and sizes the row kernels'
        grids; results do not depend on it."""
        fp8 = self._check(x_TH, w)
        T, H = x_TH.shape
        if T == 0:
            return torch.zeros(0, H, dtype=x_TH.dtype, device=x_TH.device)
        tri = kernels.use_triton_for(x_TH)
        rows = group_rows(topk.ids, w.num_experts, align=CONTIGUOUS_ALIGN, use_triton=tri)
        M, expert_M = rows.num_rows, rows.expert_M
        # end row of each expert's pairs (its padded end less its padding); each group starts
        # on a 128-row tile
        ends = rows.ends_E - torch.remainder(-rows.counts_E, CONTIGUOUS_ALIGN)
        used = rows.ends_E[-1:]  # rows past the last group are the static bound's slack
        pairs = T * topk.top_k * local_share  # expected local pairs
        hint = math.ceil(pairs) + w.num_experts * CONTIGUOUS_ALIGN  # and their groups' padding
        first = pairs > ROW_QUANT_MAX_PAIRS * T
        xa, xs = self._rows(x_TH, expert_M, fp8, M, token_M=rows.token_M, used=used,
                            tokens_first=first, rows_hint=hint)  # fmt: skip
        h = self._gemm(xa, xs, w.w13, w.w13_scale, ends, M, False, CONTIGUOUS_ALIGN)
        aa, as_ = self._rows(h, expert_M, fp8, M, act=act, b13_EN=w.b13, used=used,
                             rows_hint=hint)  # fmt: skip
        y = self._gemm(aa, as_, w.w2, w.w2_scale, ends, M, False, CONTIGUOUS_ALIGN)
        return kernels.weighted_reduce(
            y, rows.row_TK, topk.weights, topk.ids, w.b2, H, x_TH.dtype, use_triton=tri
        )

    def run_masked(
        self, x_ECH, counts_E, w: ExpertWeights, act: ActivationSpec,
        expected_rows: int | None = None,
    ) -> torch.Tensor:
        """x [E, C, H] bf16, counts [E] int32 -> unweighted [E, C, H] (rows past counts
        undefined). expected_rows: the dispatcher's mean rows per expert (`masked_expected_m`)."""
        fp8 = self._check(x_ECH, w)
        E, C, _ = x_ECH.shape
        if (empty := self.empty_masked(x_ECH, w)) is not None:
            return empty
        counts = counts_E.to(torch.int32).clamp(max=C).contiguous()
        expected_m = masked_expected_m(C, self.expected_m, expected_rows)
        tile = jit.row_tile(True, expected_m)
        Cp = -(-C // tile) * tile  # the kernel stores whole row tiles: pad C to one
        x = x_ECH if Cp == C else torch.nn.functional.pad(x_ECH, (0, 0, 0, Cp - C))
        x = x.contiguous().view(E * Cp, -1)
        expert = torch.arange(E, device=x.device, dtype=torch.int32).unsqueeze(1)
        slot = torch.arange(Cp, device=x.device).unsqueeze(0)
        expert_M = torch.where(slot < counts.unsqueeze(1), expert, -1).reshape(-1)
        xa, xs = self._rows(x, expert_M, fp8, Cp) if fp8 else (x, None)
        h = self._gemm(xa, xs, w.w13, w.w13_scale, counts, Cp, True, expected_m)
        aa, as_ = self._rows(h, expert_M, fp8, Cp, act=act, b13_EN=w.b13)
        y = self._gemm(aa, as_, w.w2, w.w2_scale, counts, Cp, True, expected_m)
        y = y.view(E, Cp, -1)[:, :C]
        if w.b2 is not None:
            y = (y.float() + w.b2.float().unsqueeze(1)).to(x_ECH.dtype)
        return y.contiguous()
