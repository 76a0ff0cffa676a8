"""Activation quantizers: the reference on hand-made examples, and the Triton kernel against
the reference (bit-identical) on fresh random inputs, under TRITON_INTERPRET=1 on the CPU."""

import pytest
import torch

from moekit.quant.act_quant import (
    EPS,
    dequantize_act,
    fake_quantize_act,
    quantize_act,
    quantize_act_ref,
    quantize_expert_rows,
    quantize_expert_rows_ref,
    tensor_scale,
)

FP8 = torch.float8_e4m3fn
SCHEMES = ("token_group", "token", "static_tensor", "dynamic_tensor")
HAS_TRITON = True
try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover
    HAS_TRITON = False
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
if HAS_TRITON:
    import triton.language as tl

    from moekit.quant._act_kernels import div_by_scale

    @triton.jit
    def _both_divisions(x_ptr, s_ptr, a_ptr, b_ptr, BLOCK: tl.constexpr):
        """Program p: a = div_rn(x, s[p]), b = div_by_scale(x, s[p]) over x[p * BLOCK, +BLOCK)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x, s = tl.load(x_ptr + offs), tl.load(s_ptr + tl.program_id(0))
        tl.store(a_ptr + offs, tl.div_rn(x, s))
        tl.store(b_ptr + offs, div_by_scale(x, s))

# Kernel tests run on the GPU where there is one, else in the Triton CPU interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_token_group_reference_by_hand():
    x = torch.zeros(2, 300)  # groups of 128: 128, 128, 44 (partial)
    x[0, 0], x[0, 130], x[0, 299] = 448.0, -44.8, 4.48
    x[1, 5] = 1.0
    q, s = quantize_act_ref(x, "token_group", FP8)
    assert s.shape == (2, 3)
    torch.testing.assert_close(
        s, torch.tensor([[1.0, 0.1, 0.01], [1 / 448, EPS / 448, EPS / 448]])
    )
    assert q[0, 0].item() == 448.0 and q[0, 130].float().item() == -448.0
    assert q[0, 299].float().item() == 448.0 and q[1, 5].float().item() == 448.0
    assert (q.float()[1, 128:] == 0).all()
    torch.testing.assert_close(dequantize_act(q, s, "token_group"), x, rtol=2**-4, atol=0)


def test_int8_rounds_half_to_even():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, 0.5, 1.5, -126.5]])  # amax 127 -> scale 1
    q, s = quantize_act_ref(x, "token", torch.int8)
    assert s.tolist() == [[1.0]]
    assert q.tolist() == [[127, 2, 4, -2, 0, 2, -126]]
    if HAS_TRITON:
        qk, sk = quantize_act(x.to(DEV), "token", torch.int8)
        assert torch.equal(qk.cpu(), q) and torch.equal(sk.cpu(), s)


def test_tensor_schemes_reference():
    x = torch.randn(5, 64)
    q, s = quantize_act_ref(x, "dynamic_tensor", FP8)
    torch.testing.assert_close(s, x.abs().amax().reshape(1) / 448)
    q2, s2 = quantize_act_ref(x, "static_tensor", FP8, scale=s * 4)
    assert torch.equal(s2, s * 4)
    assert (q2.float().abs() <= 112.0).all()  # a 4x larger scale uses a quarter of the range
    x3 = torch.randn(3, 4, 16)  # per-expert static scales broadcast [E, 1, 1]
    scales = torch.tensor([0.01, 0.02, 0.03]).view(3, 1, 1)
    q3, _ = quantize_act_ref(x3, "static_tensor", torch.int8, scale=scales)
    torch.testing.assert_close(q3[1].float(), (x3[1] / 0.02).round().clamp(-127, 127))
    assert tensor_scale(torch.empty(0, 8)).item() == pytest.approx(EPS / 448)


def test_fake_quantize_keeps_dtype_and_error_bound():
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    y = fake_quantize_act(x, "token_group", FP8)
    assert y.dtype == torch.bfloat16
    rel = ((y.float() - x.float()).norm() / x.float().norm()).item()
    assert 0 < rel < 0.05
    y8 = fake_quantize_act(x, "token", torch.int8)
    assert 0 < ((y8.float() - x.float()).norm() / x.float().norm()).item() < 0.02


def _inputs(T, H, dtype):
    x = torch.randn(T, H) * torch.rand(T, 1) * 4
    if T > 2:
        x[1] = 0  # an all-zero row
        x[2, : min(H, 128)] *= 100  # an outlier group
    return x.to(dtype)


def _scale_for(scheme, x, qdtype):
    if scheme == "static_tensor":
        return tensor_scale(x, qdtype) * 1.5
    return None


@needs_triton
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("qdtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("T, H", [(0, 256), (1, 256), (9, 200), (5, 7), (3, 1200)])
def test_kernel_matches_reference(scheme, qdtype, xdtype, T, H):
    """H = 1200: ten groups of 128 (the last partial) over two programs a row."""
    x = _inputs(T, H, xdtype).to(DEV)
    scale = _scale_for(scheme, x, qdtype)
    q_ref, s_ref = quantize_act_ref(x, scheme, qdtype, scale=scale)
    if qdtype == torch.int8:
        q, s = quantize_act(x, scheme, qdtype, scale=scale)
        assert q.dtype == torch.int8 and torch.equal(q, q_ref)
    else:
        # The CPU interpreter's fp8 cast is wrong (see quantize_act): check the values just
        # before the cast, cast by torch.
        pre, s = quantize_act(x, scheme, qdtype, scale=scale, out_dtype=torch.float32)
        q = pre.to(FP8)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
        assert (pre.abs() <= 448).all()
        if DEV == "cuda":  # the GPU's own fp8 cast
            q, s = quantize_act(x, scheme, qdtype, scale=scale)
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)


@needs_triton
@pytest.mark.parametrize("scheme", ["token_group", "token"])
def test_kernel_fp8_output_on_grid_values(scheme):
    """Direct fp8 output: values already on the e4m3 grid cast exactly even in the interpreter.
    Each row (group) holds +-448 * 2^k, so its scale is 2^k and every x / scale is on the grid."""
    T, H = 6, 256
    codes = torch.randint(0, 126, (T, H), dtype=torch.uint8)  # finite e4m3 magnitudes
    codes |= torch.randint(0, 2, (T, H), dtype=torch.uint8) << 7
    grid = codes.view(FP8).float()
    grid[:, ::128] = 448.0
    x = (grid * 2.0 ** torch.randint(-4, 5, (T, 1)).float()).to(DEV)
    q, s = quantize_act(x, scheme, FP8)
    q_ref, s_ref = quantize_act_ref(x, scheme, FP8)
    assert q.dtype == FP8
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


@needs_triton
@pytest.mark.parametrize("T", [513, 1100])
def test_kernel_dynamic_tensor_many_rows(T):
    """'dynamic_tensor' with more rows than partial-amax programs (several rows each): the scale
    is the amax over every row, the maximum sitting in the last row."""
    x = torch.randn(T, 24).to(DEV)
    x[-1, 3] = -9.5
    q_ref, s_ref = quantize_act_ref(x, "dynamic_tensor", torch.int8)
    q, s = quantize_act(x, "dynamic_tensor", torch.int8)
    assert torch.equal(s, s_ref) and torch.equal(q, q_ref)


@needs_triton
def test_kernel_strided_input():
    base = torch.randn(8, 512, device=DEV)
    x = base[:, 100:356]  # row stride 512, last dim contiguous
    q, s = quantize_act(x, "token_group", torch.int8)
    q_ref, s_ref = quantize_act_ref(x, "token_group", torch.int8)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@needs_triton
def test_div_by_scale_is_div_rn():
    """The kernels' x / s by one reciprocal a scale and an fma correction equals tl.div_rn for
    dynamic scales (|x| <= 448 s): every finite bf16 value x against 48 scales of random
    magnitude, bit for bit where |x| >= 2^-100 and x / s is a normal float32 number, and after
    the fp8 cast (by torch: the interpreter's is wrong) everywhere."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = bits.float()[torch.isfinite(bits.float())]
    amax = torch.exp2(torch.randint(-40, 120, (48,)).float()) * (1 + torch.rand(48))
    block = 4096
    xs = [every[every.abs() <= a] for a in amax]
    xs = [torch.nn.functional.pad(x, (0, -len(x) % block)).view(-1, block) for x in xs]
    s = torch.cat([(a / 448).expand(len(x)) for a, x in zip(amax, xs)]).to(DEV)
    x = torch.cat(xs).to(DEV)
    a, b = torch.empty_like(x), torch.empty_like(x)
    _both_divisions[(x.shape[0],)](x, s, a, b, BLOCK=block)
    normal = (x.abs() >= 2.0**-100) & (a.abs() >= torch.finfo(torch.float32).tiny)
    assert normal.float().mean() > 0.5
    assert torch.equal(a[normal], b[normal])
    assert torch.equal(a.clamp(-448, 448).cpu().to(FP8).view(torch.uint8),
                       b.clamp(-448, 448).cpu().to(FP8).view(torch.uint8))  # fmt: skip


def test_errors():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError, match="activation scheme must be one of static_tensor, dynamic_tensor, token, token_group"):
        quantize_act_ref(x, "group", FP8)
    with pytest.raises(ValueError, match="dtype must be one of"):
        quantize_act_ref(x, "token", torch.float16)
    with pytest.raises(ValueError, match="'static_tensor' needs the calibrated `scale`"):
        quantize_act_ref(x, "static_tensor", FP8)
    with pytest.raises(ValueError, match="computes its scales"):
        quantize_act_ref(x, "token", FP8, scale=torch.ones(1))
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        quantize_act_ref(x, "token_group", FP8, group_size=0)
    if HAS_TRITON:
        with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
            quantize_act(x[None], "token", FP8)
        with pytest.raises(ValueError, match="must hold one value"):
            quantize_act(x, "static_tensor", FP8, scale=torch.ones(4))


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("qdtype", [FP8, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_matches_reference_cuda(scheme, qdtype, xdtype):
    x = _inputs(300, 7168, xdtype).cuda()
    scale = _scale_for(scheme, x, qdtype)
    q, s = quantize_act(x, scheme, qdtype, scale=scale)
    q_ref, s_ref = quantize_act_ref(x, scheme, qdtype, scale=scale)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


# ---------------------------------------------------------------------------------------------
# quantize_expert_rows: 'static_tensor' rows, each with its expert's calibrated scale
# ---------------------------------------------------------------------------------------------

# (num_rows, src_div, experts?, expert_div): pairs of a top-2 call from 7 tokens with masked ids
# (-1, 9: clamped, never read); rows grouped by capacity 3 (masked format); slots whose expert
# is one per block of 4 rows (sorted h)
ROW_LAYOUTS = {"pairs": (14, 2, 14, 1), "capacity": (7, 1, None, 3), "blocks": (7, 1, 2, 4)}


def test_expert_rows_reference_by_hand():
    x = torch.tensor([[1.0, -2.0], [448.0, 3.0]])
    scale_E = torch.tensor([0.5, 2.0])
    ids = torch.tensor([1, 0, 0, -1], dtype=torch.int32)  # pairs of 2 tokens, top-2
    q, s = quantize_expert_rows_ref(x, scale_E, 4, src_div=2, experts=ids)
    assert s.tolist() == [2.0, 0.5, 0.5, 0.5]  # -1 clamped to expert 0 for the scale
    assert q.float().tolist() == [[0.5, -1.0], [2.0, -4.0], [448.0, 6.0], [0.0, 0.0]]


@needs_triton
@pytest.mark.parametrize("whole_rows", [False, True], ids=["block_programs", "row_programs"])
@pytest.mark.parametrize("layout", list(ROW_LAYOUTS))
@pytest.mark.parametrize("qdtype", [FP8, torch.int8], ids=["fp8", "int8"])
def test_expert_rows_kernel_matches_reference(layout, qdtype, whole_rows, monkeypatch):
    """Bit-identical on fresh random rows (on CPU fp8 goes to the reference: the interpreter
    casts to fp8 wrongly, so int8 is the kernel's CPU check), with a program per column block
    and per row (`SPLIT_ROWS_MAX_PROGRAMS`)."""
    from moekit.quant import _act_kernels

    if whole_rows:
        monkeypatch.setattr(_act_kernels, "SPLIT_ROWS_MAX_PROGRAMS", 0)
    R, src_div, n_map, expert_div = ROW_LAYOUTS[layout]
    E, H = 5, 2500  # 3 column blocks of 1024, the last partial
    x = (torch.randn(-(-R // src_div), H) * 4).to(DEV)
    scale_E = (torch.rand(E) * 0.02 + 0.005).to(DEV)
    experts = None
    if n_map is not None:
        experts = torch.randint(-1, E + 2, (n_map,), dtype=torch.int32, device=DEV)
        experts[0], experts[1] = 2, -1  # one row group each of an expert and of none
    kw = dict(src_div=src_div, experts=experts, expert_div=expert_div, dtype=qdtype)
    q, s = quantize_expert_rows(x, scale_E, R, **kw)
    q_ref, s_ref = quantize_expert_rows_ref(x, scale_E, R, **kw)
    assert q.shape == (R, H) and s.shape == (R,)
    r = torch.arange(R, device=DEV)
    e = r // expert_div if experts is None else experts[r // expert_div]
    written = (e >= 0) & (e < E)  # rows of other experts are left unwritten
    assert 0 < written.sum() and (n_map is None or written.sum() < R)
    assert torch.equal(q[written].view(torch.uint8), q_ref[written].view(torch.uint8))
    assert torch.equal(s, s_ref)
    q0, s0 = quantize_expert_rows(x, scale_E, 0, **kw)
    assert q0.shape == (0, H) and s0.shape == (0,)
    qh, sh = quantize_expert_rows(x[:, :0], scale_E, R, **kw)  # H = 0: the scales still
    assert qh.shape == (R, 0) and torch.equal(sh, s_ref)


def test_expert_rows_errors():
    x, scale_E = torch.randn(4, 16), torch.ones(3)
    with pytest.raises(ValueError, match="scale_E must be float32"):
        quantize_expert_rows_ref(x, scale_E.double(), 4)
    with pytest.raises(ValueError, match="src_div must be a positive integer"):
        quantize_expert_rows_ref(x, scale_E, 4, src_div=0)
    with pytest.raises(ValueError, match="x has 4"):
        quantize_expert_rows_ref(x, scale_E, 9, src_div=2)
    with pytest.raises(ValueError, match="experts must be an integer"):
        quantize_expert_rows_ref(x, scale_E, 4, experts=torch.zeros(4))
    with pytest.raises(ValueError, match="experts must be an integer"):
        quantize_expert_rows_ref(x, scale_E, 4, experts=torch.zeros(3, dtype=torch.int32))
