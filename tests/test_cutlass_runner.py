"""The `cutlass` runner (torch._grouped_mm) and its pieces against their reference twins.

CPU: bf16 / fp32 through torch._grouped_mm's CPU path with the torch twins of the kernels; the
Triton kernels under the interpreter (fp32 / fp16). GPU (marked): bf16 on preset shapes, eager
and CUDA-graph replay; fp8 rowwise through torch._scaled_grouped_mm.
"""

from dataclasses import dataclass

import pytest
import torch

from moekit.experts import ActivationSpec, ExpertWeights
from moekit.hardware import Platform
from moekit.quant import quantize_experts
from moekit.router import TopKOutput
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners._grouped import group_rows, group_rows_reference, max_rows
from moekit.runners.base import RunnerError
from moekit.runners.cutlass import CutlassRunner, scaled_grouped_mm_torch
from moekit.runners.torch import TorchRunner, moe_reference_fp64, run_masked
from moekit.stages import MaskedDispatchOutput, StandardDispatchOutput
from tests.helpers import TOLERANCE, capture_graph, rel_err

# The Triton kernels run on CUDA tensors where there is a GPU, else in the interpreter on CPU.
KDEV = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Case:
    name: str
    T: int = 9
    E: int = 6
    K: int = 2
    H: int = 32
    I: int = 16
    activation: str = "silu"
    interleaved: bool = False
    bias: bool = False
    routing: str = "random"  # random | masked | one_expert | out_of_range


CASES = [
    Case("silu"),
    Case("T0", T=0),
    Case("T1", T=1),
    Case("masked-ids", routing="masked", K=3),
    Case("one-expert-all-tokens", T=12, routing="one_expert"),
    Case("out-of-range-ids", routing="out_of_range"),
    Case("gelu-bias", activation="gelu", bias=True),
    Case("swiglu_oai-interleaved-bias", activation="swiglu_oai", interleaved=True, bias=True),
    Case("odd-sizes", T=11, E=7, K=3, H=20, I=13, bias=True),
    Case("odd-sizes-interleaved", T=5, E=5, K=2, H=12, I=6, activation="swiglu_oai",
         interleaved=True, bias=True),
]


def make_topk(case: Case, device="cpu") -> TopKOutput:
    T, E, K = case.T, case.E, case.K
    ids = torch.rand(T, E).argsort(dim=1)[:, :K].to(torch.int32)
    if case.routing == "masked":
        ids[torch.rand(T, K) < 0.4] = -1
        if T:
            ids[0] = -1  # a token with no expert at all
    elif case.routing == "one_expert":
        ids[:, 0] = E - 1
        ids[:, 1:] = -1
    elif case.routing == "out_of_range":
        ids[torch.rand(T, K) < 0.3] = E + 2  # not on this rank: must count as masked
    weights = torch.rand(T, K) + 0.1
    return TopKOutput(weights.float().to(device), ids.to(device))


def make_weights(case: Case, dtype, device="cpu") -> ExpertWeights:
    E, H, I = case.E, case.H, case.I
    w13 = torch.randn(E, 2 * I, H) / H**0.5
    w2 = torch.randn(E, H, I) / I**0.5
    b13 = torch.randn(E, 2 * I) * 0.1 if case.bias else None
    b2 = torch.randn(E, H) * 0.1 if case.bias else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return ExpertWeights(cast(w13), cast(w2), cast(b13), cast(b2))


def reference(x, topk: TopKOutput, w: ExpertWeights, act: ActivationSpec) -> torch.Tensor:
    """The fp64 reference; ids outside [0, E) (not on this rank) are masked for it."""
    ids = torch.where(topk.ids < w.num_experts, topk.ids, -1)
    return moe_reference_fp64(x, TopKOutput(topk.weights, ids), w, act)


def act_of(case: Case) -> ActivationSpec:
    return ActivationSpec(case.activation, case.interleaved)


# ---------------------------------------------------------------------------- row layout


@pytest.mark.parametrize("align", [1, 4, 128])
@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c.name)
def test_group_rows_matches_reference(case, align):
    topk = make_topk(case)
    got = group_rows(topk.ids, case.E, align)
    ref = group_rows_reference(topk.ids, case.E, align)
    assert got.num_rows == max_rows(case.T * case.K, case.E, align)
    for field in ("token_M", "expert_M", "row_TK", "ends_E", "counts_E"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field


@pytest.mark.parametrize("align", [1, 4, 128])
@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c.name)
def test_group_rows_triton_matches_reference(case, align):
    """The GPU path (the triton runner's alignment + `rows_layout_triton`) gives the same layout
    as the twin, rows past the used ones included (expert -1, token 0)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton not importable")
    topk = make_topk(case)
    got = group_rows(topk.ids.to(KDEV), case.E, align, use_triton=True)
    ref = group_rows_reference(topk.ids, case.E, align)
    assert got.num_rows == ref.num_rows == max_rows(case.T * case.K, case.E, align)
    for field in ("token_M", "expert_M", "row_TK", "ends_E", "counts_E"):
        assert torch.equal(getattr(got, field).cpu(), getattr(ref, field)), field


@pytest.mark.parametrize("align", [1, 8])
def test_group_rows_invariants(align):
    T, E, K = 37, 10, 4
    ids = torch.randint(-1, E, (T, K), dtype=torch.int32)
    rows = group_rows(ids, E, align)
    valid = ids >= 0
    # every valid pair has its own row, of its expert and token; masked pairs have none
    r = rows.row_TK[valid]
    assert r.unique().numel() == r.numel() == int(valid.sum())
    assert torch.equal(rows.expert_M[r], ids[valid])
    assert torch.equal(rows.token_M[r], torch.arange(T).unsqueeze(1).expand(T, K)[valid])
    assert (rows.row_TK[~valid] == -1).all()
    # groups: padded to align, ends cumulative, each row inside its group
    counts = torch.bincount(ids[valid].long(), minlength=E)
    assert torch.equal(rows.counts_E.long(), counts)
    padded = (counts + align - 1) // align * align
    assert torch.equal(rows.ends_E.long(), padded.cumsum(0))
    starts = rows.ends_E.long() - padded
    e = ids[valid].long()
    assert ((r >= starts[e]) & (r < starts[e] + counts[e])).all()
    assert (rows.expert_M[rows.ends_E[-1]:] == -1).all()


# ---------------------------------------------------------------------------- kernels vs twins


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "act", [ActivationSpec("silu"), ActivationSpec("gelu"), ActivationSpec("swiglu_oai", True)],
    ids=lambda a: a.name,
)
@pytest.mark.parametrize("bias", [False, True])
def test_activation_rows_match_twin(dtype, act, bias):
    """`gemm_rows` with an activation (the rows before the down GEMM), unquantized: every
    activation, with and without biases, I = 24 (a partial group of 128 columns)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton not importable")
    M, I, E = 13, 24, 4
    h = (torch.randn(M, 2 * I) * 3).to(KDEV, dtype)
    expert = torch.randint(-1, E, (M,), dtype=torch.int32).to(KDEV)
    b13 = torch.randn(E, 2 * I).to(KDEV, dtype) if bias else None
    got, _ = kernels.gemm_rows_triton(h, expert, act=act, b13_EN=b13)
    ref, _ = kernels.gemm_rows_torch(h, expert, act=act, b13_EN=b13)
    keep = expert >= 0  # rows of expert -1 are left unwritten by the kernel
    assert got.shape == (M, I)
    assert rel_err(got[keep], ref[keep]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_weighted_reduce_kernel_matches_twin(dtype, bias):
    if not kernels.HAS_TRITON:
        pytest.skip("triton not importable")
    T, K, E, H, Hp = 7, 3, 5, 20, 24
    ids = torch.randint(-1, E, (T, K), dtype=torch.int32).to(KDEV)
    rows = group_rows(ids, E)
    y = torch.randn(rows.num_rows, Hp).to(KDEV, dtype)
    w = torch.rand(T, K).to(KDEV)
    b2 = torch.randn(E, H).to(KDEV, dtype) if bias else None
    got = kernels.weighted_reduce_triton(y, rows.row_TK, w, ids, b2, H, dtype)
    ref = kernels.weighted_reduce_torch(y, rows.row_TK, w, ids, b2, H, dtype)
    assert got.shape == (T, H)
    assert rel_err(got, ref) <= TOLERANCE[dtype]


def test_weighted_reduce_ignores_garbage_rows():
    """Rows no pair points to may hold NaN/inf (unwritten GEMM rows): they must not leak."""
    T, K, E, H = 4, 2, 3, 8
    ids = torch.tensor([[0, -1], [1, 2], [-1, -1], [2, 0]], dtype=torch.int32)
    rows = group_rows(ids, E)
    y = torch.randn(rows.num_rows, H)
    y[rows.ends_E[-1]:] = float("nan")
    for reduce in (kernels.weighted_reduce_torch, kernels.weighted_reduce_triton):
        if reduce is kernels.weighted_reduce_triton and not kernels.HAS_TRITON:
            continue
        out = reduce(y.to(KDEV), rows.row_TK.to(KDEV), torch.rand(T, K).to(KDEV), ids.to(KDEV),
                     torch.randn(E, H).to(KDEV), H, torch.float32)  # fmt: skip
        assert torch.isfinite(out).all()
        assert (out[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["gather", "rows", "silu", "swiglu_oai+bias"])
@pytest.mark.parametrize("rows_hint", [None, 1])
def test_gemm_rows_kernel_matches_twin(dtype, mode, rows_hint):
    """The bf16 / fp16 / fp32 paths (copy, gather, activation) on every device; rows of expert
    -1 and rows past `used` are left unwritten by the kernel. C = 200: a partial last group of
    128 columns. rows_hint 1: one row program loops over the three row tiles in use."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton not importable")
    T, M, C, E = 5, 12, 200, 3
    expert = torch.randint(-1, E, (M,), dtype=torch.int32).to(KDEV)
    kw = {}
    if mode == "gather":
        src = torch.randn(T, C).to(KDEV, dtype)
        kw["token_M"] = torch.randint(0, T, (M,)).to(KDEV)
    elif mode == "rows":
        src = torch.randn(M, C).to(KDEV, dtype)
    else:
        src = (torch.randn(M, 2 * C) * 2).to(KDEV, dtype)
        name, bias = mode.split("+")[0], mode.endswith("bias")
        kw["act"] = ActivationSpec(name, interleaved=name == "swiglu_oai")
        kw["b13_EN"] = torch.randn(E, 2 * C).to(KDEV, dtype) if bias else None
    used = torch.tensor([M - 2], dtype=torch.int32).to(KDEV)
    til = kernels.RowsTiling(block_r=4) if rows_hint else None  # 3 row tiles, 1 program
    got, s = kernels.gemm_rows_triton(src, expert, used=used, rows_hint=rows_hint, tiling=til,
                                      **kw)  # fmt: skip
    ref, _ = kernels.gemm_rows_torch(src, expert, **kw)
    keep = (expert >= 0) & (torch.arange(M).to(KDEV) < M - 2)
    assert s is None and got.shape == (M, C)
    assert rel_err(got[keep], ref[keep]) <= TOLERANCE[dtype]


def test_gemm_rows_twin_quantizes_like_quantize_act():
    """The fp8 path's twin: quantize_act_ref of the rows, scales MN-major per group of R rows
    (DeepGEMM's layout); rows of expert -1 are zeros."""
    from moekit.quant.act_quant import quantize_act_ref

    T, H, R = 6, 256, 4
    x = torch.randn(T, H) * 5
    token = torch.tensor([0, 5, 2, 2, 1, 0, 3, 4])
    expert = torch.tensor([0, 0, -1, 1, 1, 1, -1, 2], dtype=torch.int32)
    q, s = kernels.gemm_rows_torch(x, expert, token_M=token, quant=True, rows_per_group=R)
    rows = torch.where((expert >= 0).unsqueeze(1), x[token], 0.0)
    q_ref, s_ref = quantize_act_ref(rows, "token_group", torch.float8_e4m3fn, group_size=128)
    assert s.shape == (2, 2, R)  # [M / R, H / 128, R]
    assert torch.equal(q.float(), q_ref.float())
    for m in range(8):
        assert torch.equal(s[m // R, :, m % R], s_ref[m])


@pytest.mark.gpu
@pytest.mark.parametrize("act, H", [(None, 7168), ("rows", 7168), ("silu", 7168),
                                    ("swiglu_oai", 2880)])  # fmt: skip
def test_gemm_rows_fp8_kernel_matches_twin_gpu(act, H):
    """The fp8 paths bit for bit against the twin: the gather with the tokens quantized first
    (None) and with each gathered row quantized ('rows'); swiglu_oai as gpt-oss has it
    (interleaved gate / up columns, biases, H off the 128-column grid)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    T, M, R, E = 50, 256, 128, 4
    expert = torch.randint(-1, E, (M,), dtype=torch.int32, device="cuda")
    if act in (None, "rows"):
        src = (torch.randn(T, H, device="cuda") * 3).to(torch.bfloat16)
        kw = {"token_M": torch.randint(0, T, (M,), device="cuda")}
    else:
        src = (torch.randn(M, 2 * H, device="cuda") * 3).to(torch.bfloat16)
        interleaved = act == "swiglu_oai"
        kw = {"act": ActivationSpec(act, interleaved=interleaved)}
        if interleaved:
            kw["b13_EN"] = torch.randn(E, 2 * H, device="cuda").to(torch.bfloat16)
    first = {"tokens_first": act is None} if act in (None, "rows") else {}
    q, s = kernels.gemm_rows_triton(src, expert, quant=True, rows_per_group=R, **kw, **first)
    q_ref, s_ref = kernels.gemm_rows_torch(src, expert, quant=True, rows_per_group=R, **kw)
    keep = expert >= 0
    assert torch.equal(q[keep].float(), q_ref[keep].float())
    keep_s = keep.view(M // R, 1, R).expand_as(s)
    assert torch.equal(s[keep_s], s_ref[keep_s])


# ---------------------------------------------------------------------------- the runner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_standard_vs_reference(case, dtype):
    x = torch.randn(case.T, case.H).to(dtype)
    topk = make_topk(case)
    w = make_weights(case, dtype)
    out = CutlassRunner().run(StandardDispatchOutput(x, topk), w, act_of(case)).out
    assert out.shape == (case.T, case.H) and out.dtype == dtype
    ref = reference(x, topk, w, act_of(case))
    assert rel_err(out, ref) <= TOLERANCE[dtype], case.name


@pytest.mark.parametrize("case", [c for c in CASES if c.T > 0][:6], ids=lambda c: c.name)
def test_standard_triton_kernels(case):
    """The whole runner with the Triton kernels, fp32 (interpreter on CPU; on a GPU, CUDA)."""
    if not kernels.HAS_TRITON:
        pytest.skip("triton not importable")
    dtype = torch.float32
    x = torch.randn(case.T, case.H).to(KDEV)
    topk = make_topk(case, KDEV)
    w = make_weights(case, dtype, KDEV)
    out = CutlassRunner(use_triton=True).run_standard(x, topk, w, act_of(case))
    ref = reference(x, topk, w, act_of(case))
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "case", [CASES[0], CASES[6], CASES[7], CASES[8]], ids=lambda c: c.name
)
def test_masked_vs_reference(case, dtype):
    C = 5
    x = torch.randn(case.E, C, case.H).to(dtype)
    counts = torch.randint(0, C + 1, (case.E,), dtype=torch.int32)
    counts[0] = C  # a full expert
    counts[-1] = 0  # an empty one
    w = make_weights(case, dtype)
    out = CutlassRunner().run(MaskedDispatchOutput(x, counts), w, act_of(case)).out
    assert out.shape == x.shape
    valid = torch.arange(C).unsqueeze(0) < counts.unsqueeze(1)
    ref = run_masked(x.double(), counts, ExpertWeights(
        w.w13.double(), w.w2.double(),
        None if w.b13 is None else w.b13.double(), None if w.b2 is None else w.b2.double(),
    ), act_of(case))
    assert rel_err(out[valid], ref[valid]) <= TOLERANCE[dtype]


def test_masked_empty():
    case = CASES[0]
    w = make_weights(case, torch.bfloat16)
    x = torch.randn(case.E, 0, case.H).to(torch.bfloat16)
    out = CutlassRunner().run_masked(x, torch.zeros(case.E, dtype=torch.int32), w, act_of(case))
    assert out.shape == (case.E, 0, case.H)


def test_unaligned_weights_are_padded_once():
    case = CASES[8]  # H=20, I=13: not multiples of 8 bf16 elements
    w = make_weights(case, torch.bfloat16)
    runner = CutlassRunner()
    x = torch.randn(case.T, case.H).to(torch.bfloat16)
    topk = make_topk(case)
    runner.run_standard(x, topk, w, act_of(case))
    runner.run_standard(x, topk, w, act_of(case))
    [first] = runner._padded.copies()
    ptr = first.w13.data_ptr()
    w.w13.mul_(2)  # in-place change: the padded copy is rewritten in its own storage
    out = runner.run_standard(x, topk, w, act_of(case))
    assert runner._padded.copies() == [first] and first.w13.data_ptr() == ptr
    assert rel_err(out, reference(x, topk, w, act_of(case))) <= TOLERANCE[torch.bfloat16]
    w = make_weights(case, torch.bfloat16)  # new tensors: a new copy replaces the old one
    out = runner.run_standard(x, topk, w, act_of(case))
    assert len(runner._padded.copies()) == 1 and runner._padded.copies()[0] is not first
    assert rel_err(out, reference(x, topk, w, act_of(case))) <= TOLERANCE[torch.bfloat16]


def test_shape_and_dtype_errors():
    case = CASES[0]
    w = make_weights(case, torch.bfloat16)
    x = torch.randn(3, case.H + 1).to(torch.bfloat16)
    with pytest.raises(RunnerError, match="hidden size"):
        CutlassRunner().run_standard(x, make_topk(Case("x", T=3)), w, act_of(case))
    x = torch.randn(3, case.H)  # float32 activations, bf16 weights
    with pytest.raises(RunnerError, match="dtype"):
        CutlassRunner().run_standard(x, make_topk(Case("x", T=3)), w, act_of(case))


def test_caps_and_availability():
    cls = CutlassRunner
    assert cls.unsupported("standard", "unquantized", "silu", "bfloat16", "cuda", True) is None
    msg = cls.unsupported("standard", "unquantized", "silu", "float16", "cuda", False)
    assert "bfloat16" in msg and "float16" in msg
    assert cls.unsupported("standard", "unquantized", "silu", "float32", "cpu", False) is None
    assert "int4_w4a16" in cls.unsupported("standard", "int4_w4a16", "silu", "bfloat16", "cuda",
                                           False)
    a100 = Platform("cuda", "NVIDIA A100", (8, 0), 1, {})
    h100 = Platform("cuda", "NVIDIA H100", (9, 0), 1, {})
    assert not cls.availability(a100) and "SM80" in cls.availability(a100).reason
    assert cls.availability(h100)
    assert cls.availability(Platform("cpu", "cpu"))


# ---------------------------------------------------------------------------- fp8 (rowwise)

# Against the reference runner (the same fp8 quantization of weights and activations, float32
# matmuls, bf16 intermediate) only the accumulation order and rare rounding flips of the
# intermediate's fp8 quantization differ: about 0.3% seen on CPU.
FP8_VS_REFERENCE = 2e-2
FP8_VS_FP64 = 1e-1  # the fp64 reference does not quantize the activations

FP8_SPECS = [
    dict(weight_scale="channel"),  # activation_scheme 'token'
    dict(weight_scale="tensor"),  # 'dynamic_tensor'
    dict(weight_scale="channel", activation_scheme="dynamic_tensor"),
    dict(weight_scale="tensor", activation_scheme="static_tensor"),
]


def fp8_weights(case: Case, params: dict, device="cpu") -> ExpertWeights:
    w = make_weights(case, torch.bfloat16, device)
    kw = {}
    if params.get("activation_scheme") == "static_tensor":
        kw = dict(a13_scale=torch.rand(case.E) * 0.01 + 0.005, a2_scale=torch.rand(case.E) * 0.01
                  + 0.005)
    return quantize_experts(w, "fp8_w8a8", **params, **kw)


def test_scaled_grouped_mm_twin():
    M, K, N, E = 10, 32, 16, 3
    a = torch.randn(M, K).to(torch.float8_e4m3fn)
    w = torch.randn(E, N, K).to(torch.float8_e4m3fn)
    sa, sw = torch.rand(M) + 0.5, torch.rand(E, N) + 0.5
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    got = scaled_grouped_mm_torch(a, sa, w, sw, ends, torch.float32)
    groups = [0, 0, 0, 0, 2, 2, 2, 2, 2, 2]
    for r, e in enumerate(groups):
        ref = (a[r].float() * sa[r]) @ (w[e].float() * sw[e].unsqueeze(1)).T
        assert torch.allclose(got[r], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("params", FP8_SPECS, ids=lambda p: "-".join(p.values()))
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4], CASES[7]], ids=lambda c: c.name)
def test_fp8_standard_vs_reference(case, params):
    x = torch.randn(case.T, case.H).to(torch.bfloat16)
    topk = make_topk(case)
    wq = fp8_weights(case, params)
    out = CutlassRunner().run(StandardDispatchOutput(x, topk), wq, act_of(case)).out
    ids = torch.where(topk.ids < case.E, topk.ids, -1)
    clean = StandardDispatchOutput(x, TopKOutput(topk.weights, ids))
    ref = TorchRunner().run(clean, wq, act_of(case)).out
    assert rel_err(out, ref) <= FP8_VS_REFERENCE
    if params.get("activation_scheme") != "static_tensor":  # random static scales may clip
        assert rel_err(out, reference(x, topk, wq, act_of(case))) <= FP8_VS_FP64


@pytest.mark.parametrize("params", FP8_SPECS, ids=lambda p: "-".join(p.values()))
def test_fp8_masked_vs_reference(params):
    case, C = CASES[7], 6
    x = torch.randn(case.E, C, case.H).to(torch.bfloat16)
    counts = torch.randint(1, C + 1, (case.E,), dtype=torch.int32)
    counts[1] = 0
    wq = fp8_weights(case, params)
    out = CutlassRunner().run(MaskedDispatchOutput(x, counts), wq, act_of(case)).out
    ref = TorchRunner().run(MaskedDispatchOutput(x, counts), wq, act_of(case)).out
    valid = torch.arange(C).unsqueeze(0) < counts.unsqueeze(1)
    assert rel_err(out[valid], ref[valid]) <= FP8_VS_REFERENCE


def test_fp8_refuses_block_scales_and_unaligned_sizes():
    from moekit.quant import make_spec
    from moekit.select import Workload

    case = CASES[0]
    block = quantize_experts(make_weights(case, torch.bfloat16), "fp8_w8a8")  # default: block
    x = torch.randn(3, case.H).to(torch.bfloat16)
    with pytest.raises(RunnerError, match="deep_gemm"):
        CutlassRunner().run_standard(x, make_topk(Case("x", T=3)), block, act_of(case))
    odd = Case("odd", H=24, I=8)
    wq = fp8_weights(odd, dict(weight_scale="channel"))
    with pytest.raises(RunnerError, match="multiples of 16"):
        CutlassRunner().run_standard(torch.randn(2, 24).to(torch.bfloat16),
                                     make_topk(Case("x", T=2)), wq, act_of(odd))
    work = Workload(4, weight_format="fp8_w8a8", weight_spec=make_spec("fp8_w8a8"))
    assert "block" in CutlassRunner.workload_problem(work)
    work = Workload(4, weight_format="fp8_w8a8", hidden_size=2880, intermediate_size=100,
                    weight_spec=make_spec("fp8_w8a8", weight_scale="channel"))
    assert "I=100" in CutlassRunner.workload_problem(work)


# ---------------------------------------------------------------------------- GPU


PRESET_SHAPES = {  # per-rank E, K, H, I of presets (ep = tp = 1; deepseek-v3 with ep 8)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v3-ep8": (32, 8, 7168, 2048),
}


@pytest.mark.gpu
@pytest.mark.parametrize("preset", list(PRESET_SHAPES))
@pytest.mark.parametrize("T", [1, 64, 1000])
def test_gpu_bf16_presets(preset, T):
    E, K, H, I = PRESET_SHAPES[preset]
    case = Case(preset, T=T, E=E, K=K, H=H, I=I, routing="masked" if T == 64 else "random")
    dev = "cuda"
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    topk = make_topk(case, dev)
    w = make_weights(case, torch.bfloat16, dev)
    runner = CutlassRunner()
    out = runner.run_standard(x, topk, w, act_of(case))
    ref = reference(x, topk, w, act_of(case))
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_eager():
    E, K, H, I = PRESET_SHAPES["qwen3-30b-a3b"]
    case = Case("graph", T=48, E=E, K=K, H=H, I=I, bias=True, activation="swiglu_oai",
                interleaved=True, routing="masked")
    dev = "cuda"
    x = torch.randn(case.T, H, device=dev).to(torch.bfloat16)
    topk = make_topk(case, dev)
    w = make_weights(case, torch.bfloat16, dev)
    runner = CutlassRunner()
    act = act_of(case)
    eager = runner.run_standard(x, topk, w, act)
    graph, static_out = capture_graph(lambda: runner.run_standard(x, topk, w, act))
    # new routing and inputs in place: the replay must follow them
    new = make_topk(case, dev)
    topk.ids.copy_(new.ids)
    topk.weights.copy_(new.weights)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(x, topk, w, act)
    assert rel_err(static_out, ref) <= TOLERANCE[torch.bfloat16]
    assert not torch.equal(static_out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("params", FP8_SPECS[:2], ids=lambda p: "-".join(p.values()))
@pytest.mark.parametrize("T", [1, 200])
def test_gpu_fp8_rowwise(params, T):
    E, K, H, I = PRESET_SHAPES["qwen3-30b-a3b"]
    case = Case("fp8", T=T, E=E, K=K, H=H, I=I, routing="masked")
    dev = "cuda"
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    topk = make_topk(case, dev)
    wq = fp8_weights(case, params, dev)
    out = CutlassRunner().run(StandardDispatchOutput(x, topk), wq, act_of(case)).out
    ref = TorchRunner().run(StandardDispatchOutput(x, topk), wq, act_of(case)).out
    assert rel_err(out, ref) <= FP8_VS_REFERENCE


@pytest.mark.gpu
@pytest.mark.parametrize("C", [16, 20])
def test_gpu_fp8_masked(C):
    E, K, H, I = PRESET_SHAPES["deepseek-v3-ep8"]
    case = Case("fp8-masked", E=E, K=K, H=H, I=I)
    x = torch.randn(E, C, H, device="cuda").to(torch.bfloat16)
    counts = torch.randint(0, C + 1, (E,), device="cuda", dtype=torch.int32)
    wq = fp8_weights(case, dict(weight_scale="channel"), "cuda")
    out = CutlassRunner().run(MaskedDispatchOutput(x, counts), wq, act_of(case)).out
    ref = TorchRunner().run(MaskedDispatchOutput(x, counts), wq, act_of(case)).out
    valid = torch.arange(C, device="cuda").unsqueeze(0) < counts.unsqueeze(1)
    assert rel_err(out[valid], ref[valid]) <= FP8_VS_REFERENCE


def test_empty_masked_checks_experts_and_empty_batches():
    """The masked-format guard every masked runner shares (Runner.empty_masked)."""
    from moekit.runners.torch import TorchRunner

    w = ExpertWeights(torch.zeros(4, 6, 8), torch.zeros(4, 8, 3))
    runner = TorchRunner()
    with pytest.raises(RunnerError, match="runner 'torch': masked x has 3 experts, weights 4"):
        runner.empty_masked(torch.zeros(3, 2, 8), w)
    empty = runner.empty_masked(torch.zeros(4, 0, 8, dtype=torch.float16), w)
    assert empty.shape == (4, 0, 8) and empty.dtype == torch.float16
    assert runner.empty_masked(torch.zeros(4, 2, 8), w) is None
