"""The packed 4-bit dequantization of the `triton` runner: the PTX fast path
(`_kernels._dequant_bytes_asm`, GPU only) against its portable twin (`_kernels._dequant_nibbles`)
and a torch reference, value by value, on every byte and on extreme scales.

CPU (interpreter): the portable twin against the torch reference (float16 / float32; inline PTX
cannot run there). GPU (marked): both paths bit for bit against the reference in bfloat16 and
float16, then whole `fused_moe` calls with the PTX path on and off (same configs: the same
weights enter the same MMAs, so the outputs are identical).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from helpers import make_topk  # noqa: E402

from moekit.quant import Int4W4A16, make_spec, quantize_experts  # noqa: E402
from moekit.quant.packing import e2m1_decode  # noqa: E402
from moekit.runners.triton import _kernels as k  # noqa: E402
from moekit.runners.triton import ops  # noqa: E402
from moekit.runners.triton.configs import GemmConfig  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@triton.jit
def _dequant_test_kernel(
    q_ptr, s_ptr, z_ptr, lo_ptr, hi_ptr,
    QUANT: tl.constexpr, SG: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
    HAS_ZERO: tl.constexpr, PK: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """q [PK, R] uint8, s / z [SG, R] float32 -> lo / hi [PK, R] in lo_ptr's dtype."""
    offs = tl.arange(0, PK)[:, None] * R + tl.arange(0, R)[None, :]
    q = tl.load(q_ptr + offs)
    soffs = tl.arange(0, SG)[:, None] * R + tl.arange(0, R)[None, :]
    s = tl.load(s_ptr + soffs)
    z = tl.load(z_ptr + soffs)
    DT: tl.constexpr = lo_ptr.dtype.element_ty
    if ASM:
        lo, hi = k._dequant_bytes_asm(q, s, z, QUANT, SG, HALF, DT, HAS_ZERO)
    else:
        qi = q.to(tl.int32)
        lo = k._dequant_nibbles(qi & 15, s, z, QUANT, SG, HALF, DT, HAS_ZERO)
        hi = k._dequant_nibbles(qi >> 4, s, z, QUANT, SG, HALF, DT, HAS_ZERO)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


def _scales(quant: str, SG: int, R: int, dtype: torch.dtype, half: bool, has_zero: bool = True):
    """(s, z) float32 [SG, R] as `_step_scales` hands them over, with extremes included."""
    if quant == "int4":
        # random magnitudes over many binades, signs, zeros; stored in `dtype` when half
        binade = torch.randint(-20, 12, (SG, R), device=DEVICE).float()
        s = torch.randn(SG, R, device=DEVICE) * torch.exp2(binade)
        s[0, :4] = torch.tensor([0.0, -0.0, 1.0, 6.1e-5])
        if half:
            s = s.to(dtype).float()
        z = torch.randint(0, 16, (SG, R), device=DEVICE).float()
        if not has_zero:  # symmetric: the kernels use the constant 8 (z holds garbage here)
            z = torch.full((SG, R), 8.0, device=DEVICE)
    elif quant == "mxfp4":
        e = torch.randint(0, 255, (SG, R), device=DEVICE, dtype=torch.int32)
        e.view(-1)[:6] = torch.tensor([0, 1, 127, 128, 253, 254], dtype=torch.int32)
        bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
        s = bits.view(torch.float32)
        z = s
    else:  # nvfp4: every finite e4m3 code times a global scale
        codes = torch.randint(0, 256, (SG, R), device=DEVICE, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E
        s = codes.view(torch.float8_e4m3fn).float() * 0.0123
        z = s
    return s.contiguous(), z.contiguous()


def _reference(q, s, z, quant, SG, dtype, half=False):
    """lo / hi nibbles -> float32 value * scale, one rounding to dtype (`quant.dequantize`);
    nvfp4 in 16-bit arithmetic (half): its scale rounded to bfloat16 first."""
    PK, R = q.shape
    if quant == "nvfp4" and half:
        s = s.to(torch.bfloat16).float()
    out = []
    for c in (q.int() & 15, q.int() >> 4):
        if quant == "int4":
            v = c.float().view(SG, PK // SG, R) - z[:, None, :]
        else:
            v = e2m1_decode(c.to(torch.uint8)).float().view(SG, PK // SG, R)
        out.append((v * s[:, None, :]).reshape(PK, R).to(dtype))
    return out


QUANTS = {"int4": k.Q_INT4, "mxfp4": k.Q_MXFP4, "nvfp4": k.Q_NVFP4}


def _run(quant, SG, dtype, half, asm, PK=64, R=64):
    has_zero = quant != "int4s"
    quant = "int4" if quant == "int4s" else quant
    q = torch.randint(0, 256, (PK, R), device=DEVICE, dtype=torch.uint8)
    q.view(-1)[:256] = torch.arange(256, device=DEVICE, dtype=torch.uint8)  # every byte
    s, z = _scales(quant, SG, R, dtype, half, has_zero)
    z_in = z if has_zero else torch.full_like(z, 3.0)  # must be ignored
    lo = torch.empty(PK, R, device=DEVICE, dtype=dtype)
    hi = torch.empty_like(lo)
    _dequant_test_kernel[(1,)](q, s, z_in, lo, hi, QUANT=QUANTS[quant], SG=SG, HALF=half, ASM=asm,
                               HAS_ZERO=has_zero, PK=PK, R=R, num_warps=4)  # fmt: skip
    return (lo, hi), _reference(q, s, z, quant, SG, dtype, half)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN matches any NaN."""
    nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


# (quant, SG, half) cases; half: the 16-bit path `WeightQuant.half_dequant` picks; "int4s":
# symmetric int4 (no zero points)
CASES = [("int4", 1, True), ("int4", 4, True), ("int4", 2, False), ("int4s", 1, True),
         ("int4s", 2, False), ("mxfp4", 4, True), ("mxfp4", 1, False), ("nvfp4", 8, False),
         ("nvfp4", 1, False), ("nvfp4", 8, True)]  # fmt: skip
BF16_ONLY = ("mxfp4", "nvfp4")  # their 16-bit paths run in bfloat16 only


@pytest.mark.skipif(ON_GPU, reason="CPU interpreter run (the GPU test covers both paths)")
@pytest.mark.parametrize("quant,SG,half", [c for c in CASES if not (c[0] in BF16_ONLY and c[2])])
def test_portable_dequant_vs_reference_cpu(quant, SG, half):
    (lo, hi), (rlo, rhi) = _run(quant, SG, torch.float16, half, asm=False, PK=32, R=16)
    assert _same_bits(lo, rlo) and _same_bits(hi, rhi)


@pytest.mark.gpu
@pytest.mark.parametrize("asm", [True, False], ids=["ptx", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("quant,SG,half", CASES)
def test_dequant_bit_exact_gpu(quant, SG, half, dtype, asm):
    """Both dequantization paths (inline PTX and the portable twin) bit-exact on the GPU."""
    if half and quant in BF16_ONLY and dtype != torch.bfloat16:
        pytest.skip(f"{quant} takes the 16-bit path in bfloat16 only")
    (lo, hi), (rlo, rhi) = _run(quant, SG, dtype, half, asm=asm)
    assert _same_bits(lo, rlo), (lo - rlo).abs().max()
    assert _same_bits(hi, rhi), (hi - rhi).abs().max()


def test_asm_only_where_it_can_run(monkeypatch):
    """The PTX path is off on CPU / in the interpreter, for tiles of < 4 bytes per thread and
    when `PIPELINE.asm_dequant` is off; `fused_moe` passes ASM through to the kernels."""
    from moekit.experts import ExpertWeights

    w = ExpertWeights(torch.randn(2, 64, 64), torch.randn(2, 64, 32))
    w = quantize_experts(w, make_spec("mxfp4"))
    wq = ops.WeightQuant(w, "w13")
    cfg = GemmConfig(16, 64, 128)
    assert wq.asm_dequant(cfg, 64, torch.bfloat16) is False  # CPU tensors
    assert wq.meta(cfg, 64, torch.float16)["ASM"] is False
    assert ops._NO_QUANT_META["ASM"] is False
    import re

    def operands(src):  # every operand of the constraint string is used
        return sorted({int(n) for n in re.findall(r"\$(\d+)", src)})

    assert operands(k._asm_int4("bf16", True)) == list(range(9))
    assert operands(k._asm_int4("f16", False)) == list(range(7))
    assert operands(k._asm_e2m1("bf16", True)) == list(range(7))
    assert operands(k._asm_e2m1("f16", False)) == list(range(5))
    assert "fma.rn.f16x2" in k._asm_e2m1("f16", False) and "bf16" not in k._asm_int4("f16", True)


# ---------------------------------------------------------------------------------------------
# GPU: whole calls, PTX path on and off
# ---------------------------------------------------------------------------------------------

E2E = {
    "int4-g32-asym": Int4W4A16(32, False),
    "int4-g128-f32scale": Int4W4A16(128, True, torch.float32),
    "mxfp4": make_spec("mxfp4"),
    "nvfp4": make_spec("nvfp4"),
}
E2E_CONFIGS = [
    (GemmConfig(16, 64, 128, group_m=1), GemmConfig(16, 128, 128, group_m=1)),
    (GemmConfig(64, 32, 256, swap_ab=True), GemmConfig(64, 64, 64, num_warps=8, swap_ab=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg_i", range(len(E2E_CONFIGS)))
@pytest.mark.parametrize("fmt", list(E2E))
def test_fused_moe_asm_vs_portable_gpu(fmt, cfg_i, monkeypatch):
    from moekit.experts import ActivationSpec, ExpertWeights

    E, K, H, I, T = 8, 2, 512, 256, 37
    dt = torch.bfloat16
    w13 = torch.randn(E, 2 * I, H, device="cuda") / H**0.5
    w2 = torch.randn(E, H, I, device="cuda") / I**0.5
    w = quantize_experts(ExpertWeights(w13, w2), E2E[fmt])
    x = torch.randn(T, H, device="cuda", dtype=dt)
    topk = make_topk(T, K, E, device="cuda")
    cfgs = E2E_CONFIGS[cfg_i]
    assert ops.WeightQuant(w, "w13").asm_dequant(cfgs[0], cfgs[0].block_n, dt)
    outs = []
    for asm in (True, False):
        monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, asm_dequant=asm))
        outs.append(ops.fused_moe(x, topk, w, ActivationSpec(), configs=cfgs))
    torch.cuda.synchronize()
    # the same weights into the same MMAs (reduce 'kernel': no atomics): identical outputs
    assert torch.equal(outs[0], outs[1]), (fmt, cfgs, (outs[0].float() - outs[1]).abs().max())


def test_packed_maxnreg_only_on_the_ptx_path(monkeypatch):
    """`PIPELINE.packed_maxnreg` reaches the launch of packed-format GEMMs on the PTX path only."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(meta.get("maxnreg"))

    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, packed_maxnreg=96))
    for pack, asm in ((2, True), (2, False), (1, False)):
        ops._launch(Kernel(), (1,), (), dict(PACK=pack, ASM=asm), False)
    monkeypatch.setattr(ops, "PIPELINE", replace(ops.PIPELINE, packed_maxnreg=None))
    ops._launch(Kernel(), (1,), (), dict(PACK=2, ASM=True), False)
    assert seen == [96, None, None, None]
