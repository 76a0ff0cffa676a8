"""The `deep_gemm` runner: DeepGEMM's grouped GEMMs (optional extra `sgl-deep-gemm`, import name
`deep_gemm`; version 0.2.2 with apache-tvm-ffi 0.1.11 imports under torch 2.11) on SM90. Whether
the installed binary reads this torch's tensors is probed once (`probe_installed`); when it does
not, the backend is unavailable with that reason.

Weights: unquantized bfloat16 (DeepGEMM's bf16 kernels) or fp8_w8a8 with 128x128 block scales and
per-token-group (1x128) activation scales (DeepSeek-V3's recipe; `moekit.quant.Fp8W8A8` with
weight_scale='block'). Layouts:
  standard -> DeepGEMM's contiguous layout (prefill): the (token, expert) pairs sorted by expert,
              each expert's rows padded to DeepGEMM's M alignment, `m_indices` = the expert of each
              row (-1 for padding; blocks starting with -1 are skipped). Built on the device by
              `group_rows` (static row bound, no host sync);
  masked   -> DeepGEMM's masked layout (decode, what a low-latency all-to-all delivers):
              x [E, C, H] with `masked_m` = counts [E]; `expected_m` (a hint for the kernel's
              block size) defaults to C and can be set on the runner.
Activation (+ b13) and the weighted top-k reduce (+ b2) are our Triton kernels
(`_cutlass_kernels`); activations are quantized with `moekit.quant.act_quant.quantize_act`.

Limits (say so, do not guess): SM90 only (DeepGEMM's SM100 recipes want UE8M0 scale layouts that
this runner does not build); H and I multiples of 128; bfloat16 activations. The first call of
each GEMM shape JIT-compiles a kernel (seconds).
"""

from __future__ import annotations

import functools

import torch

from moekit.config import ACTIVATIONS
from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Availability, Platform
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners._grouped import group_rows
from moekit.runners.base import Runner, RunnerCaps, RunnerError
from moekit.runners.registry import register
from moekit.stages import (
    MASKED,
    STANDARD,
)

LIBRARY = "sgl-deep-gemm"
INSTALL_HINT = "pip install sgl-deep-gemm==0.2.2 apache-tvm-ffi==0.1.11 (moekit[deep_gemm])"
SHAPE_ALIGN = 128  # H and I must be multiples of this (fp8 128-wide scale groups, TMA tiles)
FP8_BLOCK = (128, 128)
ACT_GROUP = 128


@functools.lru_cache(maxsize=None)
def _dg():
    import deep_gemm

    return deep_gemm


@functools.lru_cache(maxsize=None)
def m_alignment() -> int:
    """DeepGEMM's row alignment of each group in the contiguous layout (its BLOCK_M)."""
    return int(_dg().get_mk_alignment_for_contiguous_layout())


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
            f"runner 'deep_gemm' needs H and I (per rank) to be multiples of {SHAPE_ALIGN}, got "
            + ", ".join(bad)
        )
    return None


# ---------------------------------------------------------------------------- binary probe
#
# sgl-deep-gemm 0.2.2 is a tvm-ffi module whose functions rebuild torch tensors inside the binary
# (torch::from_blob, then t.dim() / t.stride() inlined from the torch headers it was built with).
# On the H100 machines (torch 2.11) every GEMM call failed in DeepGEMM's first check of its
# arguments ("Assertion error (utils/layout.hpp:16): dim == 2 or dim == 3") for plain 2-D/3-D
# contiguous tensors: the binary misreads this torch's tensors. The probe below asks the binary to
# read one known tensor (`preprocess_sf` reports the rank and shape it sees, no kernel, no JIT),
# handing it over two ways: as the torch tensor itself (tvm-ffi converts it with torch's DLPack
# exchange API) and as a standard `__dlpack__` capsule. The runner uses the first way that reads
# correctly; when neither does, the backend is unavailable and says so.

PROBE_SHAPE = (256, 4)
PROBE_TIMEOUT_S = 300
PASSING = ("torch", "dlpack")  # how tensors are handed to DeepGEMM, tried in this order


def _to_dlpack(t: torch.Tensor):
    """A tvm-ffi tensor sharing `t`'s memory, made from the standard DLPack capsule."""
    import tvm_ffi

    return tvm_ffi.from_dlpack(t.__dlpack__())


def _converter(passing: str):
    return (lambda t: t) if passing == "torch" else _to_dlpack


def _read_back(passing: str) -> str | None:
    """None when DeepGEMM reads a float32 CUDA tensor of PROBE_SHAPE correctly handed over
    `passing`, else what went wrong."""
    sf = torch.ones(PROBE_SHAPE, dtype=torch.float32, device="cuda")
    try:
        seen = [int(v) for v in _dg()._C.preprocess_sf(_converter(passing)(sf))]
    except Exception as err:  # noqa: BLE001 - the binary's assertion is a plain RuntimeError
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
    # preprocess_sf returns (rank, groups, rows, columns, TMA-aligned rows)
    if seen[:4] != [2, 1, *PROBE_SHAPE]:
        return f"read a [{PROBE_SHAPE[0]}, {PROBE_SHAPE[1]}] float32 tensor as {seen}"
    return None


def probe_in_process() -> tuple[str | None, str | None]:
    """(passing, problem) for the DeepGEMM importable here: the first way of handing tensors
    over (PASSING) that its binary reads correctly, or (None, why not)."""
    try:
        dg = _dg()
    except Exception as err:  # noqa: BLE001
        return None, f"import deep_gemm failed: {type(err).__name__}: {err}"
    if not hasattr(getattr(dg, "_C", None), "preprocess_sf"):
        return PASSING[0], None  # another build: nothing to probe with, call it the usual way
    problems = []
    for passing in PASSING:
        problem = _read_back(passing)
        if problem is None:
            return passing, None
        problems.append(f"handed over as {passing}: {problem}")
    return None, (
        f"the installed sgl-deep-gemm {getattr(dg, '__version__', '?')} binary misreads this "
        f"torch {torch.__version__}'s tensors (built against other torch headers?): "
        + "; ".join(problems)
        + "; it needs a sgl-deep-gemm built for this torch"
    )


_PROBE_CHILD = (
    "import json; from moekit.runners.deep_gemm import probe_in_process as p; "
    "print('MOEKIT_DEEP_GEMM_PROBE ' + json.dumps(p()))"
)


@functools.lru_cache(maxsize=None)
def probe_installed() -> tuple[str | None, str | None]:
    """probe_in_process() run once in a child process (a binary that misreads tensors may crash
    instead of raising). (None, None) when there is nothing to probe here (no CUDA GPU in this
    process or deep_gemm not importable): availability then follows the platform's rules."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if not torch.cuda.is_available() or importlib.util.find_spec("deep_gemm") is None:
        return None, None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE_CHILD], env=env, capture_output=True,
                           text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"the probe of the installed deep_gemm took over {PROBE_TIMEOUT_S} s"
    for line in r.stdout.splitlines():
        if line.startswith("MOEKIT_DEEP_GEMM_PROBE "):
            passing, problem = json.loads(line.split(" ", 1)[1])
            return passing, problem
    tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[-300:]
    return None, f"the probe of the installed deep_gemm failed (exit {r.returncode}): {tail}"


def _pass():
    """The tensor converter for DeepGEMM calls (see probe_installed)."""
    passing, problem = probe_installed()
    if problem is not None:
        raise RunnerError(f"runner 'deep_gemm': {problem}")
    return _converter(passing or PASSING[0])


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

    # (passing, problem) of the installed binary; a class attribute so tests can inject it
    probe = staticmethod(probe_installed)

    def __init__(self, *, expected_m: int | None = None) -> None:
        """expected_m: DeepGEMM's hint of the typical rows per expert in the masked layout
        (default: the capacity C)."""
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
        _, problem = cls.probe()
        if problem is not None:
            return Availability(False, problem)
        return Availability(True)

    @classmethod
    def workload_problem(cls, work) -> str | None:
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
    def _quant(a_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 [M, K] -> (fp8 [M, K], float32 scales [M, K/128]), per token and 128 columns."""
        from moekit.quant.act_quant import quantize_act

        return quantize_act(a_MK, "token_group", torch.float8_e4m3fn, group_size=ACT_GROUP)

    def _gemm_contiguous(self, a, w, scale, m_indices, fp8: bool) -> torch.Tensor:
        """a [M, K] bf16 x w [E, N, K]^T, row m with expert m_indices[m] (int32, -1 = padding)
        -> [M, N] bf16. fp8: w float8_e4m3fn with float32 scales [E, N/128, K/128]; a is
        quantized per token and 128 columns (float32 scales [M, K/128], which DeepGEMM turns into
        its TMA-aligned MN-major layout itself on SM90)."""
        dg, t = _dg(), _pass()
        d = torch.empty(a.shape[0], w.shape[1], dtype=torch.bfloat16, device=a.device)
        if fp8:
            q, s = self._quant(a)
            dg.m_grouped_fp8_gemm_nt_contiguous(
                (t(q), t(s)), (t(w), t(scale)), t(d), t(m_indices), disable_ue8m0_cast=True
            )
        else:
            dg.m_grouped_bf16_gemm_nt_contiguous(t(a), t(w), t(d), t(m_indices))
        return d

    def _gemm_masked(self, a, w, scale, counts, expected_m: int, fp8: bool) -> torch.Tensor:
        """a [E, C, K] bf16 x w [E, N, K]^T, rows < counts[e] (int32) -> [E, C, N] bf16 (rows
        past the counts undefined)."""
        dg, t = _dg(), _pass()
        E, C, K = a.shape
        d = torch.empty(E, C, w.shape[1], dtype=torch.bfloat16, device=a.device)
        if fp8:
            q, s = self._quant(a.reshape(E * C, K))
            dg.m_grouped_fp8_gemm_nt_masked(
                (t(q.view(E, C, K)), t(s.view(E, C, -1))), (t(w), t(scale)), t(d), t(counts),
                expected_m, disable_ue8m0_cast=True,
            )
        else:
            dg.m_grouped_bf16_gemm_nt_masked(t(a), t(w), t(d), t(counts), expected_m)
        return d

    # ------------------------------------------------------------------ formats

    def run_standard(self, x_TH, topk, w: ExpertWeights, act: ActivationSpec) -> torch.Tensor:
        """x [T, H] bf16, topk [T, K] -> out [T, H] bf16 (contiguous layout)."""
        fp8 = self._check(x_TH, w)
        T, H = x_TH.shape
        if T == 0:
            return torch.zeros(0, H, dtype=x_TH.dtype, device=x_TH.device)
        rows = group_rows(topk.ids, w.num_experts, align=m_alignment())
        x_rows = x_TH[rows.token_M].contiguous()
        h = self._gemm_contiguous(x_rows, w.w13, w.w13_scale, rows.expert_M, fp8)
        a = kernels.activation(h, rows.expert_M, w.b13, act, use_triton=kernels.HAS_TRITON)
        y = self._gemm_contiguous(a, w.w2, w.w2_scale, rows.expert_M, fp8)
        return kernels.weighted_reduce(
            y, rows.row_TK, topk.weights, rows.expert_M, w.b2, H, x_TH.dtype,
            use_triton=kernels.HAS_TRITON,
        )

    def run_masked(self, x_ECH, counts_E, w: ExpertWeights, act: ActivationSpec) -> torch.Tensor:
        """x [E, C, H] bf16, counts [E] int32 -> unweighted [E, C, H] (rows past counts
        undefined)."""
        fp8 = self._check(x_ECH, w)
        E, C, _ = x_ECH.shape
        if (empty := self.empty_masked(x_ECH, w)) is not None:
            return empty
        counts = counts_E.to(torch.int32).contiguous()
        expected_m = max(1, min(C, self.expected_m or C))
        h = self._gemm_masked(x_ECH.contiguous(), w.w13, w.w13_scale, counts, expected_m, fp8)
        slot = torch.arange(C, device=x_ECH.device).unsqueeze(0)
        expert = torch.arange(E, device=x_ECH.device, dtype=torch.int32).unsqueeze(1)
        expert_M = torch.where(slot < counts.unsqueeze(1), expert, -1).reshape(-1)
        a = kernels.activation(
            h.view(E * C, -1), expert_M, w.b13, act, use_triton=kernels.HAS_TRITON
        )
        y = self._gemm_masked(a.view(E, C, -1), w.w2, w.w2_scale, counts, expected_m, fp8)
        if w.b2 is not None:
            y = (y.float() + w.b2.float().unsqueeze(1)).to(x_ECH.dtype)
        return y
