"""Triton kernels of the `triton` runner (private: the allocating wrappers live in `ops.py`).

Vocabulary: T tokens, K top-k, P = T*K (token, k) pairs with pair index p = t*K + k, E local
experts, H hidden, I intermediate, BM the block of rows that shares one expert.

Two groups of kernels (the alignment that sorts the pairs by expert first is shared with the
other runners: `moekit.runners._align`):
  * grouped GEMMs: gate_up (x @ w13[e].T with the activation fused) and down (h @ w2[e].T with
    the routing weight, then either a store per pair or an atomic add per token);
  * sum over the K experts of each token (`_sum_topk_kernel`), when the down GEMM stored pairs.

The GEMM main loops read quantized weights in two places (constexpr QUANT): `_w_tile` for the
unpacked formats and `_packed_mma` for the packed ones (int4_w4a16, mxfp4, nvfp4), which
dequantize the tile to the activation dtype in registers before a bf16/fp16 dot;
the w8a8 formats (fp8, int8) multiply the stored values directly (fp8 / int8 tensor-core dot on
pre-quantized activations) and apply the activation x weight scales per K step (block-wise /
token-group scales) or once in the epilogue (per-tensor / per-row scales).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.quant._act_kernels import div_by_scale
from moekit.runners._triton_common import (
    activate,
    desc_w_tile,
    load_a_tile,
    load_w_tile,
    tile_coords,
    zero_fill,
)

# Weight formats (constexpr QUANT): how weight tiles are stored and turned into dot operands.
Q_NONE, Q_W8A8, Q_W8A16, Q_INT4, Q_MXFP4, Q_NVFP4 = 0, 1, 2, 3, 4, 5
# Scale granularity of the w8a8 formats (constexpr WSCALE for weights, ASCALE for activations):
# one value (per expert / per call), one per row (weight row n / activation row), or one per
# row (block of WROWS weight rows) and group of GROUP columns of K.
# S_GROUP_FUSED (activations only): per group of GROUP = BLOCK_K columns, the group scale and the
# fp8 values computed inside the GEMM from the bf16/fp16 input tile (`_quant_a_tile`), so that
# no separate quantization kernel runs (tiny batches).
S_TENSOR, S_ROW, S_GROUP, S_GROUP_FUSED = 0, 1, 2, 3


# ----------------------------------------------------------------------------------------------
# Grouped GEMMs
# ----------------------------------------------------------------------------------------------


# Row modes (constexpr ROWS): how a program's row block maps to rows of the inputs/outputs.
ROWS_SORTED, ROWS_MASKED, ROWS_DIRECT = 0, 1, 2


@triton.jit
def _w_tile(
    ptrs, s_base, k_left, QUANT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):  # fmt: skip
    """Weight tile [BLOCK_K, rows] (K along dim 0) of an unpacked format as a dot operand, from
    pointers `ptrs` to the stored data ([BLOCK_K, rows]). Q_NONE / Q_W8A8: the stored values;
    Q_W8A16: int8 * scale[n] (s_base [rows]: pointers to each row's scale), computed in float32
    and rounded once to DOT_DTYPE, as `moekit.quant.dequantize`. Packed formats: `_packed_mma`."""
    if QUANT == 2:
        q = load_w_tile(ptrs, k_left, EVEN_K, BLOCK_K)
        w = (q.to(tl.float32) * tl.load(s_base)[None, :]).to(DOT_DTYPE)
    else:
        w = load_w_tile(ptrs, k_left, EVEN_K, BLOCK_K)
    return w


@triton.jit
def _dequant_nibbles(
    c, s, z, QUANT: tl.constexpr, SG: tl.constexpr, HALF: tl.constexpr,
    DOT_DTYPE: tl.constexpr, HAS_ZERO: tl.constexpr = True,
):  # fmt: skip
    """Nibble codes c [PK, rows] (int32 0..15: one nibble of each packed byte, so every element
    along dim 0 is 2 K columns apart) -> weights [PK, rows] in DOT_DTYPE. s [SG, rows]: the
    float32 multiplier of each scale group (the PK rows hold SG groups in order); z [SG, rows]
    (int4 only): the zero point as float32 (ignored without HAS_ZERO: the constant 8). Every
    path but nvfp4's HALF one is bit-identical to `moekit.quant.dequantize` followed by the
    cast to DOT_DTYPE (one rounding of the exact product value * scale):

    float32 (HALF False): int4: bitcast(0x4B000000 | c) is 2^23 + c exactly, so one
    subtraction of 2^23 + zero gives c - zero. e2m1 (sign bit 3, exponent bits 2..1, mantissa
    bit 0): the bits placed into a float16 at bits 11..9 and sign bit 15 read as e2m1 * 2^-14
    for every code (codes 0 and 1 land on float16 subnormals, which float16 arithmetic keeps),
    and * 2^14 in float16 is exact. Then * s in float32, and one rounding to DOT_DTYPE.
    HALF (16-bit arithmetic, fewer instructions; `WeightQuant.half_dequant` picks it):
    int4 with scales stored in DOT_DTYPE: c OR'ed into the mantissa of 128.0 (bfloat16) /
    1024.0 (float16) reads as 128 + c / 1024 + c; minus (128 + zero) is c - zero exactly, and
    one DOT_DTYPE product with the scale rounds once. mxfp4 in bfloat16: the e2m1 bits at
    bfloat16 bits 8..6 and 15 read as e2m1 * 2^-126 (subnormal for codes 0, 1), * 2^126 is
    exact, and * 2^(e8m0 - 127) is exact. nvfp4 in bfloat16 (the one HALF case that is not
    exact): the same e2m1 value times the group scale rounded to bfloat16 first, so a weight
    can differ from `dequantize` by one bfloat16 rounding of its scale (relative 2^-9)."""
    PK: tl.constexpr = c.shape[0]
    ROWS: tl.constexpr = c.shape[1]
    if QUANT == 3:
        if HALF:
            if DOT_DTYPE == tl.bfloat16:
                v = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                zb = (z + 128.0).to(tl.bfloat16)
            else:
                v = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                zb = (z + 1024.0).to(tl.float16)
            if not HAS_ZERO:
                zb = tl.full([SG, ROWS], 136.0 if DOT_DTYPE == tl.bfloat16 else 1032.0, DOT_DTYPE)
            vh = tl.reshape(v, [SG, PK // SG, ROWS]) - zb[:, None, :]
            w = tl.reshape(vh * s.to(DOT_DTYPE)[:, None, :], [PK, ROWS])
        else:
            v = (c | 0x4B000000).to(tl.float32, bitcast=True)
            zf = z + 8388608.0
            if not HAS_ZERO:
                zf = tl.full([SG, ROWS], 8388616.0, tl.float32)
            vf = tl.reshape(v, [SG, PK // SG, ROWS]) - zf[:, None, :]
            w = tl.reshape(vf * s[:, None, :], [PK, ROWS]).to(DOT_DTYPE)
    else:
        if HALF:
            bits = ((c & 7) << 6) | ((c & 8) << 12)
            v = bits.to(tl.int16).to(tl.bfloat16, bitcast=True) * 8.507059173023462e37
            vh = tl.reshape(v, [SG, PK // SG, ROWS])
            w = tl.reshape(vh * s.to(tl.bfloat16)[:, None, :], [PK, ROWS])
        else:
            bits = ((c & 7) << 9) | ((c & 8) << 12)
            h = bits.to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
            vf = tl.reshape(h.to(tl.float32), [SG, PK // SG, ROWS])
            w = tl.reshape(vf * s[:, None, :], [PK, ROWS]).to(DOT_DTYPE)
    return w


# ----------------------------------------------------------------------------------------------
# Packed 4-bit -> 16-bit dequantization in PTX (GPU fast path of `_dequant_nibbles`)
# ----------------------------------------------------------------------------------------------
# `tl.inline_asm_elementwise(pack=4)`: one invocation takes 4 packed bytes (elements 0..3, byte i
# of the input register is element i) and returns, per output, 4 16-bit values in two registers
# (elements 0, 1 in the first: element 0 in the low half). Each byte is spread to the low byte of
# a 16-bit lane (prmt), so that one 32-bit register then holds the nibbles of elements (0, 1) or
# (2, 3) in the positions of two packed values, and every arithmetic step below is one
# bf16x2 / f16x2 instruction for two weights. Everything is computed in temporaries and written
# to the outputs last (outputs may share registers with inputs). Only fma is used for the
# arithmetic (sm_80+): a - b = fma(a, 1, -b) and a * b = fma(a, b, -0), both one rounding,
# the same values as the subtraction / product of `_dequant_nibbles`' 16-bit path.


def _asm_scale_and_store(fmt: str, scaled: bool, s01: str, s23: str) -> list[str]:
    """The end of a dequantization block: (scaled) l0 h0 times the scales of elements (0, 1)
    in operand s01, l1 h1 times s23; then the four results to $0..$3."""
    lines = []
    if scaled:
        lines += [f"fma.rn.{fmt}x2 {r}, {r}, {sc}, nz;"
                  for r, sc in (("l0", s01), ("l1", s23), ("h0", s01), ("h1", s23))]
    return lines + ["mov.b32 $0, l0;", "mov.b32 $1, l1;", "mov.b32 $2, h0;", "mov.b32 $3, h1;",
                    "}"]


def _asm_int4(fmt: str, scaled: bool) -> str:
    """PTX for int4 nibbles -> (c - zero) [* scale] in `fmt` ('bf16' or 'f16'). Operands: $0 $1
    lo nibbles, $2 $3 hi nibbles (outputs), $4 the 4 bytes, $5 $6 -(magic + zero) of elements
    (0, 1) and (2, 3), then (scaled) $7 $8 the scales. The nibble OR'ed into the mantissa of
    magic = 128.0 (bf16, 7 mantissa bits) / 1024.0 (f16, 10 bits) reads as magic + c."""
    magic, one = ("0x43004300", "0x3f803f80") if fmt == "bf16" else ("0x64006400", "0x3c003c00")
    lines = [
        "{",
        ".reg .b32 t0, t1, u0, u1, l0, l1, h0, h1, one, nz;",
        f"mov.b32 one, {one};",
        "mov.b32 nz, 0x80008000;",
        "prmt.b32 t0, $4, 0, 0x4140;",
        "prmt.b32 t1, $4, 0, 0x4342;",
        "shr.u32 u0, t0, 4;",
        "shr.u32 u1, t1, 4;",
        f"lop3.b32 l0, t0, 0x000f000f, {magic}, 0xea;",
        f"lop3.b32 l1, t1, 0x000f000f, {magic}, 0xea;",
        f"lop3.b32 h0, u0, 0x000f000f, {magic}, 0xea;",
        f"lop3.b32 h1, u1, 0x000f000f, {magic}, 0xea;",
        f"fma.rn.{fmt}x2 l0, l0, one, $5;",
        f"fma.rn.{fmt}x2 l1, l1, one, $6;",
        f"fma.rn.{fmt}x2 h0, h0, one, $5;",
        f"fma.rn.{fmt}x2 h1, h1, one, $6;",
    ]
    return "\n".join(lines + _asm_scale_and_store(fmt, scaled, "$7", "$8"))


def _asm_e2m1(fmt: str, scaled: bool) -> str:
    """PTX for e2m1 nibbles (sign bit 3, exponent bits 2..1, mantissa bit 0) -> value [* scale]
    in `fmt`. Operands: $0 $1 lo, $2 $3 hi (outputs), $4 the 4 bytes, (scaled) $5 $6 the
    scales. The magnitude bits go to bf16 bits 8..6 (f16: 11..9) and the sign to bit 15, which
    reads as e2m1 * 2^-126 (f16: 2^-14; codes 0 and 1 are subnormals, kept by fma), and one
    exact product by 2^126 (2^14) gives the value."""
    if fmt == "bf16":
        mag, sh_lo, sh_hi, pow2 = "0x01c001c0", (6, 12), (2, 8), "0x7e807e80"
    else:
        mag, sh_lo, sh_hi, pow2 = "0x0e000e00", (9, 12), (5, 8), "0x74007400"
    lines = [
        "{",
        ".reg .b32 t0, t1, a, b, l0, l1, h0, h1, p, nz;",
        f"mov.b32 p, {pow2};",
        "mov.b32 nz, 0x80008000;",
        "prmt.b32 t0, $4, 0, 0x4140;",
        "prmt.b32 t1, $4, 0, 0x4342;",
    ]
    for dst, src, (sm, ss) in (("l0", "t0", sh_lo), ("l1", "t1", sh_lo),
                               ("h0", "t0", sh_hi), ("h1", "t1", sh_hi)):  # fmt: skip
        lines += [
            f"shl.b32 a, {src}, {sm};",
            f"and.b32 a, a, {mag};",
            f"shl.b32 b, {src}, {ss};",
            f"lop3.b32 {dst}, b, 0x80008000, a, 0xea;",
            f"fma.rn.{fmt}x2 {dst}, {dst}, p, nz;",
        ]
    return "\n".join(lines + _asm_scale_and_store(fmt, scaled, "$5", "$6"))


_ASM_INT4_BF16 = tl.constexpr(_asm_int4("bf16", True))
_ASM_INT4_BF16_NOSCALE = tl.constexpr(_asm_int4("bf16", False))
_ASM_INT4_F16 = tl.constexpr(_asm_int4("f16", True))
_ASM_INT4_F16_NOSCALE = tl.constexpr(_asm_int4("f16", False))
_ASM_E2M1_BF16 = tl.constexpr(_asm_e2m1("bf16", True))
_ASM_E2M1_BF16_NOSCALE = tl.constexpr(_asm_e2m1("bf16", False))
_ASM_E2M1_F16_NOSCALE = tl.constexpr(_asm_e2m1("f16", False))


@triton.jit
def _dequant_bytes_asm(
    q, s, z, QUANT: tl.constexpr, SG: tl.constexpr, HALF: tl.constexpr,
    DOT_DTYPE: tl.constexpr, HAS_ZERO: tl.constexpr = True,
):  # fmt: skip
    """Packed bytes q [PK, rows] (uint8; low nibble = even K column) -> (w_lo, w_hi), each
    [PK, rows] in DOT_DTYPE (bfloat16 / float16), bit-identical to `_dequant_nibbles` on the
    low and the high nibbles (s, z [SG, rows], HAS_ZERO as there). HALF (int4 with scales in
    DOT_DTYPE, mxfp4 / nvfp4 in bf16): the PTX applies the scale (rounded to DOT_DTYPE) too;
    otherwise it returns the exact 16-bit values c - zero / e2m1 and the scale is applied in
    float32 with one rounding to DOT_DTYPE, as the float32 path does."""
    PK: tl.constexpr = q.shape[0]
    ROWS: tl.constexpr = q.shape[1]
    q3 = tl.reshape(q, [SG, PK // SG, ROWS])
    BF16: tl.constexpr = DOT_DTYPE == tl.bfloat16
    if QUANT == 3:
        if not HAS_ZERO:  # a constant: no per-step layout conversion of zero points
            nzb = tl.full([1, 1, 1], -136.0 if BF16 else -1032.0, DOT_DTYPE)
        elif BF16:
            nzb = (-(z + 128.0)).to(DOT_DTYPE)[:, None, :]
        else:
            nzb = (-(z + 1024.0)).to(DOT_DTYPE)[:, None, :]
        if HALF:
            sh = s.to(DOT_DTYPE)[:, None, :]
            if BF16:
                lo, hi = tl.inline_asm_elementwise(
                    _ASM_INT4_BF16, "=r,=r,=r,=r,r,r,r,r,r", [q3, nzb, sh],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                lo, hi = tl.inline_asm_elementwise(
                    _ASM_INT4_F16, "=r,=r,=r,=r,r,r,r,r,r", [q3, nzb, sh],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
                )  # fmt: skip
        else:
            if BF16:
                lo, hi = tl.inline_asm_elementwise(
                    _ASM_INT4_BF16_NOSCALE, "=r,=r,=r,=r,r,r,r", [q3, nzb],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
                )  # fmt: skip
            else:
                lo, hi = tl.inline_asm_elementwise(
                    _ASM_INT4_F16_NOSCALE, "=r,=r,=r,=r,r,r,r", [q3, nzb],
                    dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
                )  # fmt: skip
    else:
        if HALF:
            sh = s.to(DOT_DTYPE)[:, None, :]
            lo, hi = tl.inline_asm_elementwise(
                _ASM_E2M1_BF16, "=r,=r,=r,=r,r,r,r", [q3, sh],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
            )  # fmt: skip
        elif BF16:
            lo, hi = tl.inline_asm_elementwise(
                _ASM_E2M1_BF16_NOSCALE, "=r,=r,=r,=r,r", [q3],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
            )  # fmt: skip
        else:
            lo, hi = tl.inline_asm_elementwise(
                _ASM_E2M1_F16_NOSCALE, "=r,=r,=r,=r,r", [q3],
                dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
            )  # fmt: skip
    if not HALF:
        lo = (lo.to(tl.float32) * s[:, None, :]).to(DOT_DTYPE)
        hi = (hi.to(tl.float32) * s[:, None, :]).to(DOT_DTYPE)
    return tl.reshape(lo, [PK, ROWS]), tl.reshape(hi, [PK, ROWS])


@triton.jit
def _scaled_groups(a):
    """Rows a [R, G] (one activation group each) -> (values [R, G] float32 just before the fp8
    cast, scale float32 [R]), with the arithmetic of `moekit.quant.quantize_act` 'token_group'
    (bit-identical on a GPU): s = max(amax |a|, 1e-10) / 448, a / s clamped to +-448."""
    af = a.to(tl.float32)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(af), axis=1), 1e-10), 448.0)
    y = div_by_scale(af, s[:, None])
    return tl.minimum(tl.maximum(y, -448.0), 448.0), s


@triton.jit
def _quant_a_tile(a):
    """An activation tile a [BM, BLOCK_K] (one group of BLOCK_K columns per row) -> (fp8 e4m3
    [BM, BLOCK_K], scale float32 [BM]) (`_scaled_groups`)."""
    y, s = _scaled_groups(a)
    return y.to(tl.float8e4nv), s


@triton.jit
def _step_scales(
    s_base, z_base, a_s_base, gscale, ki, K,
    QUANT: tl.constexpr, ASCALE: tl.constexpr, WSCALE: tl.constexpr, GROUP: tl.constexpr,
    SG: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """The scales K step ki multiplies by, as float32. The main loops load the packed formats'
    scales one step ahead (AHEAD: a global load the pipeliner leaves synchronous stalls every
    step; measured: 4-bit decode faster), and the w8a8 ones in the step itself (AHEAD gives
    (0, 0) for them: loading those ahead measured slower at T = 4096, 459 -> 563 us for the
    qwen3 fp8 block-wise gate_up).

    Packed formats (int4_w4a16, mxfp4, nvfp4): (s [SG, rows], z [SG, rows]): s the weight
    multiplier of each of the step's SG groups (int4 scale, mxfp4 2^(e8m0 - 127), nvfp4 e4m3 *
    gscale); z (int4) the zero point (8 when symmetric). s_base / z_base [rows]: pointers
    to each row's first group (groups along K contiguous, K // GROUP of them).
    w8a8 with a per-group scale (ASCALE or WSCALE == S_GROUP): (a_s [BM], w_s [rows]) of K
    group ki * BLOCK_K // GROUP (1 for the one that is not per group). Otherwise (0, 0)."""
    if QUANT >= 3:
        gi = ki * BLOCK_K // GROUP + tl.arange(0, SG)
        s_mask = gi[:, None] < K // GROUP
        s = tl.load(s_base[None, :] + gi[:, None], mask=s_mask, other=0)
        if QUANT == 3:
            s = s.to(tl.float32)
            if HAS_ZERO:
                z = tl.load(z_base[None, :] + gi[:, None], mask=s_mask, other=0).to(tl.float32)
            else:
                z = s * 0.0 + 8.0
        elif QUANT == 4:
            c = s.to(tl.int32)
            s = tl.where(c == 0, 0x00400000, c << 23).to(tl.float32, bitcast=True)
            z = s
        else:
            s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * gscale
            z = s
        r1, r2 = s, z
    elif QUANT == 1 and (ASCALE >= 2 or WSCALE == 2) and not AHEAD:
        kg = ki * BLOCK_K // GROUP
        ok = kg < tl.cdiv(K, GROUP)
        if ASCALE == 2:
            a_s = tl.load(a_s_base + kg, mask=ok, other=1.0)
        else:
            a_s = tl.full(a_s_base.shape, 1.0, tl.float32)
        if WSCALE == 2:
            w_s = tl.load(s_base + kg, mask=ok, other=1.0)
        else:
            w_s = tl.full(s_base.shape, 1.0, tl.float32)
        r1, r2 = a_s, w_s
    else:
        r1, r2 = 0.0, 0.0
    return r1, r2


@triton.jit
def _packed_mma(
    a, ptrs, s, z, k_left, acc,
    QUANT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, SG: tl.constexpr,
    HALF: tl.constexpr, ASM: tl.constexpr, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """acc += a [BM, BLOCK_K] @ w [BLOCK_K, rows] for a packed weight format (int4_w4a16, mxfp4,
    nvfp4) read from bytes `ptrs` ([BLOCK_K / 2, rows]); s, z: this step's scales
    (`_step_scales`). ASM (GPU only): dequantize with `_dequant_bytes_asm` (PTX, two weights
    per instruction), otherwise with its portable twin `_dequant_nibbles` (same values).

    Byte j of a row holds elements 2j (low nibble) and 2j + 1 (high nibble) along K. The dot
    is a sum over K, so it is split by parity instead of interleaving the nibbles in registers:
    a's even columns times the low nibbles plus a's odd columns times the high nibbles.
    Weights: int4 (q - zero) * scale, mxfp4 e2m1 * 2^(e8m0 - 127), nvfp4 e2m1 * (e4m3 scale *
    global scale)."""
    PK: tl.constexpr = BLOCK_K // 2
    BM: tl.constexpr = a.shape[0]
    if EVEN_K:
        q = tl.load(ptrs)
    else:
        q = tl.load(ptrs, mask=tl.arange(0, PK)[:, None] < k_left // 2, other=0)
    DOT_DTYPE: tl.constexpr = a.dtype
    if ASM:
        w_lo, w_hi = _dequant_bytes_asm(q, s, z, QUANT, SG, HALF, DOT_DTYPE, HAS_ZERO)
    else:
        q = q.to(tl.int32)
        w_lo = _dequant_nibbles(q & 15, s, z, QUANT, SG, HALF, DOT_DTYPE, HAS_ZERO)
        w_hi = _dequant_nibbles(q >> 4, s, z, QUANT, SG, HALF, DOT_DTYPE, HAS_ZERO)
    a_lo, a_hi = tl.split(tl.reshape(a, [BM, PK, 2]))
    acc = _mma(a_lo, w_lo, acc, SWAP_AB, DOT_PRECISION)
    acc = _mma(a_hi, w_hi, acc, SWAP_AB, DOT_PRECISION)
    return acc


@triton.jit
def _w8a8_step(
    a, b, acc, a_s, w_s,
    ASCALE: tl.constexpr, WSCALE: tl.constexpr, INT_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """One K step of a w8a8 GEMM: acc (float32, [BM, cols] or transposed when SWAP_AB) +=
    a @ b, times the activation scale a_s [BM] x weight scale w_s [cols] of the step's K group
    where either is per group (`_step_scales`; scales that do not change along K are applied
    in the epilogue, `_w8a8_scale`). fp8 operands accumulate in the MMA; int8 ones in int32
    per step (exact)."""
    STEP: tl.constexpr = ASCALE >= 2 or WSCALE == 2
    if (not STEP) and (not INT_DOT):
        acc = _mma(a, b, acc, SWAP_AB, None)
    else:
        if a.shape[0] == 1:  # one row: products summed on the CUDA cores (exact for int8)
            part = _row_products(a, b)
        elif SWAP_AB:
            if INT_DOT:
                part = tl.dot(tl.trans(b), tl.trans(a), out_dtype=tl.int32).to(tl.float32)
            else:
                part = tl.dot(tl.trans(b), tl.trans(a))
        else:
            if INT_DOT:
                part = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
            else:
                part = tl.dot(a, b)
        if STEP:
            if SWAP_AB:
                part = part * (w_s[:, None] * a_s[None, :])
            else:
                part = part * (a_s[:, None] * w_s[None, :])
        acc += part
    return acc


@triton.jit
def _fused_act_quant(a, QUANT: tl.constexpr, ASCALE: tl.constexpr):
    """(a, a_s): the activation tile quantized here (`_quant_a_tile`) when the kernel
    quantizes its own input (w8a8 with ASCALE == S_GROUP_FUSED), else a unchanged (a_s
    unused)."""
    if QUANT == 1 and ASCALE == 3:
        a, a_s = _quant_a_tile(a)
    else:
        a_s = 0.0
    return a, a_s


@triton.jit
def _stored_mma(
    a, a_s_fused, b, acc, s_base, a_s_base, ki, K,
    QUANT: tl.constexpr, ASCALE: tl.constexpr, WSCALE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr, INT_DOT: tl.constexpr, SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc += a @ b for weights stored as the dot operand (unquantized, or w8a8 with the per-
    group scales of K step ki applied here: `_step_scales`, `_w8a8_step`); a_s_fused: the
    activation scales from `_fused_act_quant`."""
    if QUANT == 1:
        a_s, w_s = _step_scales(s_base, s_base, a_s_base, 1.0, ki, K, QUANT, ASCALE, WSCALE,
                                GROUP, 1, False, BLOCK_K, False)  # fmt: skip
        if ASCALE == 3:
            a_s = a_s_fused
        acc = _w8a8_step(a, b, acc, a_s, w_s, ASCALE, WSCALE, INT_DOT, SWAP_AB)
    else:
        acc = _mma(a, b, acc, SWAP_AB, DOT_PRECISION)
    return acc


@triton.jit
def _w8a8_scale(acc, a_s_base, w_s_base, ASCALE: tl.constexpr, WSCALE: tl.constexpr):
    """Epilogue of a w8a8 GEMM: acc [BM, cols] times the scales that do not change along K
    (activation per tensor / row: a_s_base [BM]; weight per tensor / row: w_s_base [cols])."""
    if ASCALE < 2:
        acc = acc * tl.load(a_s_base)[:, None]
    if WSCALE != 2:
        acc = acc * tl.load(w_s_base)[None, :]
    return acc


@triton.jit
def _row_products(a, b):
    """a [1, BLOCK_K] @ b [BLOCK_K, cols] in float32 on the CUDA cores: a block of one row
    (`GemmConfig.block_m` 1, decode batches), where an MMA would pad the row to 16 or 64 and
    the weight tile would be reshuffled into the MMA's operand layout."""
    return tl.sum(tl.trans(a).to(tl.float32) * b.to(tl.float32), axis=0)[None, :]


@triton.jit
def _mma(a, b, acc, SWAP_AB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc += a @ b, with acc kept transposed ([N, BM]) when SWAP_AB: small row blocks then
    sit in the MMA's N slot and the weight tile in its M slot. A block of one row (never
    swapped): `_row_products`."""
    if a.shape[0] == 1:
        acc += _row_products(a, b)
    elif SWAP_AB:
        acc = tl.dot(tl.trans(b), tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _zeros_acc(BLOCK_M: tl.constexpr, COLS: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros([COLS, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)
    return acc


@triton.jit
def _unswap(acc, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _split_fixup(
    acc_g, acc_u, part_ptr, part_stride, count_ptr, tile, split, slot, n_out, mask, N,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """Split-K gate_up: this program's float32 sums of output tile `tile` (acc_g, acc_u [BM,
    BLOCK_N]: rows `slot`, columns `n_out`) stored as share `split` of part [SPLITS, slots,
    2N] (share stride part_stride); then one count in count[tile], released after the whole
    program's stores (CTA barrier, then a GPU-scope acq_rel atomic). Returns (gate, up,
    last): for the program that arrives last, the sums over every share (read from L2), and
    that program sets the count back to 0 for the next call."""
    ptrs = part_ptr + slot[:, None] * (2 * N) + n_out[None, :]
    mine = ptrs + split.to(tl.int64) * part_stride
    tl.store(mine, acc_g, mask=mask)
    tl.store(mine + N, acc_u, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    if last:
        tl.debug_barrier()
        g = tl.zeros_like(acc_g)
        u = tl.zeros_like(acc_u)
        for s in tl.static_range(SPLITS):
            g += tl.load(ptrs + s * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
            u += tl.load(ptrs + s * part_stride + N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
        acc_g, acc_u = g, u
    return acc_g, acc_u, last


@triton.jit
def _tile_rows(
    pid_m,
    row_map_ptr,
    block_expert_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    num_experts,
    capacity,
    blocks_per_expert,
    align_m,
    ROW_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    DIRECT_P: tl.constexpr = 1,
):
    """The first BLOCK_M rows of row block pid_m (blocks of ROW_BLOCK rows). Returns (expert,
    row_ok [BM], pair [BM], token [BM], slot [BM] int64, slot0, first_ok). Only rows with
    row_ok are stored; loads use in-bounds rows.
    ROWS_SORTED: row_map = sorted pair ids of the alignment; slot = row of the sorted order.
    ROWS_MASKED: slot = e * capacity + local row (local 0 where not row_ok); pair, token unused.
    ROWS_DIRECT: no alignment; row_map = expert id of each pair (num_pairs <= DIRECT_P, a power
    of two), one block per pair: the pairs of one expert, ranked by pair index, go in groups
    of BLOCK_M to the blocks of the first pair of each group (so an expert's weights are read
    once per BLOCK_M of its pairs), the other blocks have no work; slot = pair (rows of h are
    the pairs, not contiguous within a block).
    slot0: the block's first slot (its row in h for TMA loads). first_ok: the block has work."""
    offs = tl.arange(0, BLOCK_M)
    if ROWS == 1:
        expert = pid_m // blocks_per_expert
        local0 = (pid_m % blocks_per_expert) * ROW_BLOCK
        count = tl.minimum(tl.load(counts_ptr + expert), capacity)
        local = local0 + offs
        row_ok = local < count
        slot = expert.to(tl.int64) * capacity + tl.where(row_ok, local, 0)
        pair = slot.to(tl.int32)
        token = pair
        slot0 = expert * capacity + local0
        first_ok = local0 < count
    elif ROWS == 2:
        e = tl.load(row_map_ptr + pid_m)
        valid = (e >= 0) & (e < num_experts)
        expert = tl.where(valid, e, 0)
        q = tl.arange(0, DIRECT_P)
        same = (tl.load(row_map_ptr + q, mask=q < num_pairs, other=-1) == e) & valid
        rank = tl.cumsum(same.to(tl.int32), 0) - 1  # among the pairs of this expert
        r = tl.sum((same & (q < pid_m)).to(tl.int32), 0)  # this pair's rank
        first_ok = valid & (r % BLOCK_M == 0)
        hit = same[None, :] & (rank[None, :] == (r + offs)[:, None])  # [BLOCK_M, DIRECT_P]
        row_ok = (tl.sum(hit.to(tl.int32), 1) > 0) & first_ok
        pair = tl.where(row_ok, tl.sum(tl.where(hit, q[None, :], 0), 1), pid_m)
        token = pair // top_k
        slot = pair.to(tl.int64)
        slot0 = pid_m
    else:
        row0 = pid_m * ROW_BLOCK
        pair = tl.load(row_map_ptr + row0 + offs)
        row_ok = pair < num_pairs
        token = tl.where(row_ok, pair // top_k, 0)
        expert = tl.load(block_expert_ptr + row0 // align_m)
        slot = (row0 + offs).to(tl.int64)
        slot0 = row0
        first_ok = tl.load(row_map_ptr + row0) < num_pairs
    return expert, row_ok, pair, token, slot, slot0, first_ok


@triton.jit
def _tail_level_fits(n_ok, level: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_LEVELS: tl.constexpr):
    """Whether a block with n_ok valid rows runs at tail level `level` (0 the finest, TAIL_LEVELS
    the whole block): n_ok in (BM / 2, BM] for BM = BLOCK_M >> (TAIL_LEVELS - level), from one
    row at level 0. Exactly one level fits each n_ok in [1, BLOCK_M]."""
    upper: tl.constexpr = BLOCK_M >> (TAIL_LEVELS - level)
    lower: tl.constexpr = upper // 2 if level > 0 else 0
    return (n_ok > lower) & (n_ok <= upper)


@triton.jit
def _folded_tail(b, row_map_ptr, block_expert_ptr, num_rows_ptr, num_pairs, align_m,
                 BLOCK_M: tl.constexpr, FOLD: tl.constexpr):  # fmt: skip
    """Sorted rows: whether row block b is an expert's last block holding 1..FOLD valid rows
    after a block of the same expert (which is then full). Such a block is computed by the
    program of block b - 1 together with its own rows, on the weight tiles it loads anyway
    (`_gate_up_block` / `_down_block` with SIDE = FOLD); its own program does nothing."""
    row0 = b * BLOCK_M
    inside = (b > 0) & (row0 < tl.load(num_rows_ptr))
    row0 = tl.where(inside, row0, BLOCK_M)  # in bounds either way
    same = tl.load(block_expert_ptr + row0 // align_m) == tl.load(
        block_expert_ptr + (row0 - BLOCK_M) // align_m
    )
    used = tl.load(row_map_ptr + row0) < num_pairs
    short = tl.load(row_map_ptr + row0 + FOLD) >= num_pairs
    return inside & same & used & short


@triton.jit
def _block_rows(b, row_map_ptr, num_pairs, BLOCK_M: tl.constexpr, FOLD: tl.constexpr):
    """Sorted rows: the valid rows among the first FOLD rows of row block b."""
    rows = tl.load(row_map_ptr + b * BLOCK_M + tl.arange(0, FOLD))
    return tl.sum((rows < num_pairs).to(tl.int32))


@triton.jit
def _run_row_block(
    BLOCK: tl.constexpr,
    block_args,
    pid_m,
    row_ok,
    row_map_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_pairs,
    align_m,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TAIL_LEVELS: tl.constexpr,
    FOLD: tl.constexpr,
    FOLD_LEVELS: tl.constexpr,
):
    """The work of a GEMM program on its live row block pid_m (row_ok: which of its BLOCK_M
    rows are valid): BLOCK(*block_args, BM, SIDE), BLOCK `_gate_up_block` or
    `_down_block`, whose last two parameters are these. The kernels' TAIL_LEVELS and FOLD
    schedules, written once. Sorted rows with FOLD > 0: a block that is a folded tail
    (`_folded_tail`) does nothing; a block followed by one also takes that tail's first
    SIDE = FOLD / 2^j rows, the fewest that hold them (j < FOLD_LEVELS). Sorted rows with
    TAIL_LEVELS > 0: BM = BLOCK_M / 2^j, the fewest rows (j <= TAIL_LEVELS) holding the
    valid ones. Otherwise BM = BLOCK_M, SIDE = 0. (The kernels write block_args as a tuple in
    the call: a tuple assigned to a name first would hold its constants as values.)"""
    fold_next = False
    if FOLD > 0:
        if _folded_tail(pid_m, row_map_ptr, block_expert_ptr, num_rows_ptr, num_pairs, align_m,
                        BLOCK_M, FOLD):  # fmt: skip
            return
        fold_next = _folded_tail(pid_m + 1, row_map_ptr, block_expert_ptr, num_rows_ptr,
                                 num_pairs, align_m, BLOCK_M, FOLD)  # fmt: skip
    if fold_next:
        if FOLD > 0:  # (fold_next is a constant False otherwise: nothing to compile here)
            n_side = _block_rows(pid_m + 1, row_map_ptr, num_pairs, BLOCK_M, FOLD)
            for level in tl.static_range(FOLD_LEVELS):
                if _tail_level_fits(n_side, level, FOLD, FOLD_LEVELS - 1):
                    BLOCK(*block_args, BLOCK_M, FOLD >> (FOLD_LEVELS - 1 - level))
    elif TAIL_LEVELS > 0 and ROWS == 0:
        n_ok = tl.sum(row_ok.to(tl.int32))
        for level in tl.static_range(TAIL_LEVELS + 1):
            if _tail_level_fits(n_ok, level, BLOCK_M, TAIL_LEVELS):
                BLOCK(*block_args, BLOCK_M >> (TAIL_LEVELS - level), 0)
    else:
        BLOCK(*block_args, BLOCK_M, 0)


@triton.jit
def _gate_up_block(
    x_ptr,
    w_ptr,
    w_desc,
    b_ptr,
    h_ptr,
    hq_ptr,
    hs_ptr,
    row_map_ptr,
    block_expert_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    num_experts,
    capacity,
    blocks_per_expert,
    align_m,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    part_ptr,
    part_stride,
    count_ptr,
    alpha,
    limit,
    ws_ptr,
    wz_ptr,
    wg_ptr,
    xs_ptr,
    stride_wse,
    stride_wsn,
    stride_xs,
    pid_m,
    pid_n,
    split,
    pid,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROWS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    QUANT: tl.constexpr,
    ASCALE: tl.constexpr,
    WSCALE: tl.constexpr,
    WROWS: tl.constexpr,
    GROUP: tl.constexpr,
    SG: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    PACK: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
    INT_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    DIRECT_P: tl.constexpr,
    QUANT_H: tl.constexpr,
    H_GROUP: tl.constexpr,
    BM: tl.constexpr,
    SIDE: tl.constexpr,
):
    """The work of one gate_up program (see `_gate_up_kernel`) on the first BM rows of its
    row block of ROW_BLOCK rows (BM < ROW_BLOCK: a block whose valid rows all lie there).
    SIDE > 0 (sorted rows, unquantized, one K share, not swapped): also the first SIDE rows of
    block pid_m + 1 (a folded tail, `_folded_tail`), multiplied by the same weight tiles with
    the operands swapped (the weight tile in the MMA's M slot: a few rows stay on the wgmma
    path, which takes M in multiples of 64)."""
    expert, row_ok, pair, token, slot, slot0, first_ok = _tile_rows(
        pid_m, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
        capacity, blocks_per_expert, align_m, ROW_BLOCK, BM, ROWS, DIRECT_P,
    )  # fmt: skip
    if ROWS == 1:
        a_rows = slot
    else:
        a_rows = token.to(tl.int64)

    n0 = pid_n * BLOCK_N
    k_steps = tl.cdiv(K, BLOCK_K)
    share = tl.cdiv(k_steps, SPLIT_K)
    k_lo = split * share
    k_hi = tl.minimum(k_steps, k_lo + share)
    offs_k = k_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_wk = k_lo * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    a_ptrs = x_ptr + a_rows[:, None] * stride_xm + offs_k[None, :]
    tl.static_assert(SIDE == 0 or (ROWS == 0 and QUANT == 0 and SPLIT_K == 1 and not SWAP_AB),
                     "a folded tail needs sorted rows, unquantized weights, one K share, no swap")
    if SIDE > 0:
        _, row_ok2, _, token2, slot2, _, _ = _tile_rows(
            pid_m + 1, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
            capacity, blocks_per_expert, align_m, ROW_BLOCK, SIDE, ROWS, DIRECT_P,
        )  # fmt: skip
        a2_ptrs = x_ptr + token2.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    e_row = expert * (2 * N)  # first row of this expert in the [E * 2I, H] view
    # quantized formats: scale / zero-point row pointers, activation scales, global scale
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    wz_e = wz_ptr + expert.to(tl.int64) * stride_wse
    a_s_base = xs_ptr + a_rows * stride_xs
    if QUANT == 5:
        gscale = tl.load(wg_ptr + expert)
    else:
        gscale = 1.0
    DOT_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    if INTERLEAVED:
        # one tile of 2 * BLOCK_N rows alternating gate / up
        rows = (2 * n0 + tl.arange(0, 2 * BLOCK_N)) % (2 * N)
        w_ptrs = w_base + rows[None, :].to(tl.int64) * stride_wn + offs_wk[:, None]
        s_base = ws_e + (rows // WROWS) * stride_wsn
        z_base = wz_e + rows * stride_wsn
        acc = _zeros_acc(BM, 2 * BLOCK_N, SWAP_AB)
        if SIDE > 0:
            acc2 = _zeros_acc(SIDE, 2 * BLOCK_N, True)
        sc1, sc2 = _step_scales(s_base, z_base, a_s_base, gscale, k_lo, K, QUANT, ASCALE, WSCALE,
                                GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
        for ki in range(k_lo, k_hi):
            nx1, nx2 = _step_scales(s_base, z_base, a_s_base, gscale, ki + 1, K, QUANT, ASCALE,
                                    WSCALE, GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
            k_left = K - ki * BLOCK_K
            a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
            if PACK == 2:
                acc = _packed_mma(a, w_ptrs, sc1, sc2, k_left, acc, QUANT, EVEN_K, BLOCK_K, SG,
                                  HALF, ASM, SWAP_AB, DOT_PRECISION, HAS_ZERO)  # fmt: skip
            else:
                if USE_TMA:
                    b = desc_w_tile(w_desc, e_row + 2 * n0, ki * BLOCK_K)
                else:
                    b = _w_tile(w_ptrs, s_base, k_left, QUANT, EVEN_K, BLOCK_K, DOT_DTYPE)
                a, a_qs = _fused_act_quant(a, QUANT, ASCALE)
                acc = _stored_mma(a, a_qs, b, acc, s_base, a_s_base, ki, K, QUANT, ASCALE, WSCALE,
                                  GROUP, BLOCK_K, INT_DOT, SWAP_AB, DOT_PRECISION)  # fmt: skip
                if SIDE > 0:
                    a2 = load_a_tile(a2_ptrs, k_left, EVEN_K, BLOCK_K)
                    acc2 = _mma(a2, b, acc2, True, DOT_PRECISION)
            if not USE_TMA:
                w_ptrs += BLOCK_K // PACK
            a_ptrs += BLOCK_K
            if SIDE > 0:
                a2_ptrs += BLOCK_K
            sc1, sc2 = nx1, nx2
        acc = _unswap(acc, SWAP_AB)
        if SIDE > 0:
            acc2 = _unswap(acc2, True)
        if QUANT == 1:
            acc = _w8a8_scale(acc, a_s_base, s_base, ASCALE, WSCALE)
        if HAS_BIAS:
            b_rows = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
            bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + b_rows, mask=b_rows < 2 * N)
            bias = tl.where(split == 0, bias.to(tl.float32), 0.0)
            acc += bias[None, :]
            if SIDE > 0:
                acc2 += bias[None, :]
        acc_g, acc_u = tl.split(tl.reshape(acc, [BM, BLOCK_N, 2]))
        if SIDE > 0:
            acc2_g, acc2_u = tl.split(tl.reshape(acc2, [SIDE, BLOCK_N, 2]))
    else:
        n_rows = (n0 + tl.arange(0, BLOCK_N)) % N
        g_ptrs = w_base + n_rows[None, :].to(tl.int64) * stride_wn + offs_wk[:, None]
        u_ptrs = g_ptrs + N * stride_wn
        sg_base = ws_e + (n_rows // WROWS) * stride_wsn
        su_base = ws_e + ((N + n_rows) // WROWS) * stride_wsn
        zg_base = wz_e + n_rows * stride_wsn
        zu_base = wz_e + (N + n_rows) * stride_wsn
        acc_g = _zeros_acc(BM, BLOCK_N, SWAP_AB)
        acc_u = _zeros_acc(BM, BLOCK_N, SWAP_AB)
        if SIDE > 0:
            acc2_g = _zeros_acc(SIDE, BLOCK_N, True)
            acc2_u = _zeros_acc(SIDE, BLOCK_N, True)
        g1, g2 = _step_scales(sg_base, zg_base, a_s_base, gscale, k_lo, K, QUANT, ASCALE, WSCALE,
                              GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
        u1, u2 = _step_scales(su_base, zu_base, a_s_base, gscale, k_lo, K, QUANT, ASCALE, WSCALE,
                              GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
        for ki in range(k_lo, k_hi):
            ng1, ng2 = _step_scales(sg_base, zg_base, a_s_base, gscale, ki + 1, K, QUANT, ASCALE,
                                    WSCALE, GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
            nu1, nu2 = _step_scales(su_base, zu_base, a_s_base, gscale, ki + 1, K, QUANT, ASCALE,
                                    WSCALE, GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
            k_left = K - ki * BLOCK_K
            a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
            if PACK == 2:
                acc_g = _packed_mma(a, g_ptrs, g1, g2, k_left, acc_g, QUANT, EVEN_K, BLOCK_K,
                                    SG, HALF, ASM, SWAP_AB, DOT_PRECISION, HAS_ZERO)  # fmt: skip
                acc_u = _packed_mma(a, u_ptrs, u1, u2, k_left, acc_u, QUANT, EVEN_K, BLOCK_K,
                                    SG, HALF, ASM, SWAP_AB, DOT_PRECISION, HAS_ZERO)  # fmt: skip
            else:
                if USE_TMA:
                    bg = desc_w_tile(w_desc, e_row + n0, ki * BLOCK_K)
                    bu = desc_w_tile(w_desc, e_row + N + n0, ki * BLOCK_K)
                else:
                    bg = _w_tile(g_ptrs, sg_base, k_left, QUANT, EVEN_K, BLOCK_K, DOT_DTYPE)
                    bu = _w_tile(u_ptrs, su_base, k_left, QUANT, EVEN_K, BLOCK_K, DOT_DTYPE)
                a, a_qs = _fused_act_quant(a, QUANT, ASCALE)
                acc_g = _stored_mma(a, a_qs, bg, acc_g, sg_base, a_s_base, ki, K, QUANT, ASCALE,
                                    WSCALE, GROUP, BLOCK_K, INT_DOT, SWAP_AB,
                                    DOT_PRECISION)  # fmt: skip
                acc_u = _stored_mma(a, a_qs, bu, acc_u, su_base, a_s_base, ki, K, QUANT, ASCALE,
                                    WSCALE, GROUP, BLOCK_K, INT_DOT, SWAP_AB,
                                    DOT_PRECISION)  # fmt: skip
                if SIDE > 0:
                    a2 = load_a_tile(a2_ptrs, k_left, EVEN_K, BLOCK_K)
                    acc2_g = _mma(a2, bg, acc2_g, True, DOT_PRECISION)
                    acc2_u = _mma(a2, bu, acc2_u, True, DOT_PRECISION)
            if not USE_TMA:
                g_ptrs += BLOCK_K // PACK
                u_ptrs += BLOCK_K // PACK
            a_ptrs += BLOCK_K
            if SIDE > 0:
                a2_ptrs += BLOCK_K
            g1, g2, u1, u2 = ng1, ng2, nu1, nu2
        acc_g = _unswap(acc_g, SWAP_AB)
        acc_u = _unswap(acc_u, SWAP_AB)
        if SIDE > 0:
            acc2_g = _unswap(acc2_g, True)
            acc2_u = _unswap(acc2_u, True)
        if QUANT == 1:
            acc_g = _w8a8_scale(acc_g, a_s_base, sg_base, ASCALE, WSCALE)
            acc_u = _w8a8_scale(acc_u, a_s_base, su_base, ASCALE, WSCALE)
        if HAS_BIAS:
            b_base = b_ptr + expert.to(tl.int64) * stride_be
            bias_g = tl.where(split == 0, tl.load(b_base + n_rows).to(tl.float32), 0.0)
            bias_u = tl.where(split == 0, tl.load(b_base + N + n_rows).to(tl.float32), 0.0)
            acc_g += bias_g[None, :]
            acc_u += bias_u[None, :]
            if SIDE > 0:
                acc2_g += bias_g[None, :]
                acc2_u += bias_u[None, :]

    n_out = n0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (n_out[None, :] < N)
    if SPLIT_K > 1:
        acc_g, acc_u, last = _split_fixup(acc_g, acc_u, part_ptr, part_stride, count_ptr, pid,
                                          split, slot, n_out, mask, N, SPLIT_K)  # fmt: skip
    else:
        last = True
    if last:
        if QUANT_H:
            _store_h_quantized(acc_g, acc_u, h_ptr.dtype.element_ty, hq_ptr, hs_ptr, slot, row_ok,
                               n_out, mask, stride_hm, alpha, limit, pid_n, N, ACT,
                               H_GROUP)  # fmt: skip
        else:
            _store_h(acc_g, acc_u, h_ptr, slot, n_out, mask, stride_hm, alpha, limit, ACT)
    if SIDE > 0:
        mask2 = row_ok2[:, None] & (n_out[None, :] < N)
        _store_h(acc2_g, acc2_u, h_ptr, slot2, n_out, mask2, stride_hm, alpha, limit, ACT)


@triton.jit
def _store_h(acc_g, acc_u, h_ptr, slot, n_out, mask, stride_hm, alpha, limit, ACT: tl.constexpr):
    """h[slot, n_out] = act(gate, up) where mask, in h's dtype."""
    act = activate(acc_g, acc_u, alpha, limit, ACT)
    h_ptrs = h_ptr + slot[:, None] * stride_hm + n_out[None, :]
    tl.store(h_ptrs, act.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_h_quantized(
    acc_g, acc_u, h_dtype: tl.constexpr, hq_ptr, hs_ptr, slot, row_ok, n_out, mask, stride_hm,
    alpha, limit, pid_n, N, ACT: tl.constexpr, H_GROUP: tl.constexpr,
):  # fmt: skip
    """h quantized for a w8a8 down GEMM with per-token-group activations, from a tile of whole
    groups (BLOCK_N a multiple of H_GROUP): act(gate, up) rounded to h_dtype (as `_store_h`
    stores it), then per row and group of H_GROUP columns as `moekit.quant.quantize_act`
    'token_group' does it (`_scaled_groups`): the values into hq [slots, N] (fp8; float32 for
    the interpreter tests: before the cast), the scales into hs [slots, cdiv(N, H_GROUP)]
    float32."""
    BM: tl.constexpr = acc_g.shape[0]
    BLOCK_N: tl.constexpr = acc_g.shape[1]
    tl.static_assert(BLOCK_N % H_GROUP == 0, "BLOCK_N must be a multiple of H_GROUP")
    GPT: tl.constexpr = BLOCK_N // H_GROUP
    act = activate(acc_g, acc_u, alpha, limit, ACT).to(h_dtype).to(tl.float32)
    a = tl.where(mask, act, 0.0)  # columns past N do not enter the amax
    y, s = _scaled_groups(tl.reshape(a, [BM * GPT, H_GROUP]))
    q_ptrs = hq_ptr + slot[:, None] * stride_hm + n_out[None, :]
    tl.store(q_ptrs, tl.reshape(y, [BM, BLOCK_N]).to(hq_ptr.dtype.element_ty), mask=mask)
    n_groups = tl.cdiv(N, H_GROUP)
    g = pid_n * GPT + tl.arange(0, GPT)
    s_ptrs = hs_ptr + slot[:, None] * n_groups + g[None, :]
    tl.store(s_ptrs, tl.reshape(s, [BM, GPT]), mask=row_ok[:, None] & (g[None, :] < n_groups))


@triton.jit(
    do_not_specialize=[
        "num_pairs", "capacity", "blocks_per_expert", "num_pid_m", "zero_numel", "part_stride",
    ]
)  # fmt: skip
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    w_desc,
    b_ptr,
    h_ptr,
    hq_ptr,
    hs_ptr,
    zero_ptr,
    row_map_ptr,
    block_expert_ptr,
    num_rows_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    num_experts,
    capacity,
    blocks_per_expert,
    align_m,
    num_pid_m,
    zero_numel,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_be,
    stride_hm,
    part_ptr,
    part_stride,
    count_ptr,
    alpha,
    limit,
    ws_ptr,
    wz_ptr,
    wg_ptr,
    xs_ptr,
    stride_wse,
    stride_wsn,
    stride_xs,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROWS: tl.constexpr,
    ZERO_OUT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    QUANT: tl.constexpr,
    ASCALE: tl.constexpr,
    WSCALE: tl.constexpr,
    WROWS: tl.constexpr,
    GROUP: tl.constexpr,
    SG: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    PACK: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
    INT_DOT: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,
    GDC_LAUNCH: tl.constexpr = False,
    TAIL_LEVELS: tl.constexpr = 0,
    DIRECT_P: tl.constexpr = 1,
    FOLD: tl.constexpr = 0,
    FOLD_LEVELS: tl.constexpr = 1,
    QUANT_H: tl.constexpr = False,
    H_GROUP: tl.constexpr = 128,
):
    """h[slot, n] = act(x[row] @ w13[e, gate(n)] + b, x[row] @ w13[e, up(n)] + b), n < N = I.

    x [rows, K=H]; w13 [E, 2I, H]: gate rows n and up rows I + n, or (INTERLEAVED) gate 2n and
    up 2n + 1; w_desc: TMA descriptor of w13 viewed [E * 2I, H] with block [BLOCK_N, BLOCK_K]
    ([2 * BLOCK_N, BLOCK_K] interleaved) when USE_TMA. h [slots, I] in x's dtype. The input row
    is the pair's token (sorted / direct rows) or the slot (masked rows). Padding rows are not
    stored: each output row of the down GEMM depends only on its own h row, and is masked too.
    ZERO_OUT: also zero zero_ptr[0:zero_numel] (the atomic down GEMM's output).
    Quantized weights (QUANT != Q_NONE, see `_w_tile`): ws/wz/wg: weight scales, zero points,
    global scales ([E, ...], strides stride_wse / stride_wsn per expert / per scale row, K
    groups contiguous; WROWS weight rows share a scale row); w8a8: x holds the quantized
    activations and xs their scales (row stride stride_xs; 0 for one value per call).
    SPLIT_K > 1 (decode batches: more programs per weight tile): consecutive programs share
    one output tile, each over its share of the K steps (the bias with the first share); each
    stores its float32 sums in part [SPLIT_K, slots, 2I] (gate columns n, up columns I + n)
    and counts itself in count[tile]; the last to arrive adds the shares up, activates and
    stores h, and sets the count back to 0 (`_split_fixup`: count must be zeros on entry).
    GDC_LAUNCH: let the next kernel, if a programmatic dependent launch, be placed at once.
    GDC_WAIT (this kernel launched so): first wait until the previous kernel's writes are
    visible (`ops.decode_pdl`). TAIL_LEVELS > 0 (sorted rows): a block whose valid rows
    all lie in its first BLOCK_M / 2^j rows, j <= TAIL_LEVELS (an expert's last, partly filled
    block), computes only the fewest such rows (`_gate_up_block`), not a whole BLOCK_M tile.
    FOLD > 0 (sorted rows, unquantized, SPLIT_K 1, not SWAP_AB): an expert's last block with at
    most FOLD valid rows after a full one is folded into it (`_folded_tail`): the full block's
    program multiplies those rows too, by the weight tiles it loads anyway, on the fewest of
    FOLD / 2^j rows (j < FOLD_LEVELS) that hold them.
    QUANT_H (for a w8a8 down GEMM with per-token-group activations of H_GROUP columns, BLOCK_N a
    multiple of H_GROUP): h stored quantized instead, into hq and hs (`_store_h_quantized`;
    h_ptr unwritten, its dtype the one h is rounded to first), so that no quantization kernel
    runs between the GEMMs.
    """
    if GDC_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    if ZERO_OUT:
        zero_fill(zero_ptr, zero_numel, pid, tl.num_programs(0), 1024)
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    if ROWS == 0:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    _, row_ok, _, _, _, _, first_ok = _tile_rows(
        pid_m, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
        capacity, blocks_per_expert, align_m, BLOCK_M, BLOCK_M, ROWS, DIRECT_P,
    )  # fmt: skip
    if not first_ok:
        return
    _run_row_block(
        _gate_up_block,
        (x_ptr, w_ptr, w_desc, b_ptr, h_ptr, hq_ptr, hs_ptr, row_map_ptr, block_expert_ptr,
         counts_ptr, num_pairs, top_k, num_experts, capacity, blocks_per_expert, align_m, N, K,
         stride_xm, stride_we, stride_wn, stride_be, stride_hm, part_ptr, part_stride, count_ptr,
         alpha, limit, ws_ptr, wz_ptr, wg_ptr, xs_ptr, stride_wse, stride_wsn, stride_xs, pid_m,
         pid_n, split, pid, ACT, HAS_BIAS, INTERLEAVED, ROWS, SPLIT_K, QUANT, ASCALE, WSCALE,
         WROWS, GROUP, SG, HAS_ZERO, PACK, HALF, ASM, INT_DOT, USE_TMA, EVEN_K, SWAP_AB,
         DOT_PRECISION, BLOCK_N, BLOCK_K, BLOCK_M, DIRECT_P, QUANT_H, H_GROUP),
        pid_m, row_ok, row_map_ptr, block_expert_ptr, num_rows_ptr, num_pairs, align_m, ROWS,
        BLOCK_M, TAIL_LEVELS, FOLD, FOLD_LEVELS,
    )  # fmt: skip


@triton.jit
def _down_block(
    h_ptr,
    h_desc,
    w_ptr,
    w_desc,
    b_ptr,
    out_ptr,
    topk_weights_ptr,
    row_map_ptr,
    block_expert_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    num_experts,
    capacity,
    blocks_per_expert,
    align_m,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    ws_ptr,
    wz_ptr,
    wg_ptr,
    xs_ptr,
    stride_wse,
    stride_wsn,
    stride_xs,
    pid_m,
    pid_n,
    split,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    ATOMIC: tl.constexpr,
    QUANT: tl.constexpr,
    ASCALE: tl.constexpr,
    WSCALE: tl.constexpr,
    WROWS: tl.constexpr,
    GROUP: tl.constexpr,
    SG: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    PACK: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
    INT_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    DIRECT_P: tl.constexpr,
    BM: tl.constexpr,
    SIDE: tl.constexpr,
):
    """The work of one down program (see `_down_kernel`) on the first BM rows of its row
    block of ROW_BLOCK rows (BM < ROW_BLOCK: a block whose valid rows all lie there; its h
    rows are then read through pointers, as the TMA descriptor's block is ROW_BLOCK rows).
    SIDE > 0: also the first SIDE rows of block pid_m + 1, as in `_gate_up_block`."""
    expert, row_ok, pair, token, slot, slot0, _ = _tile_rows(
        pid_m, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
        capacity, blocks_per_expert, align_m, ROW_BLOCK, BM, ROWS, DIRECT_P,
    )  # fmt: skip
    n0 = pid_n * BLOCK_N
    k_steps = tl.cdiv(K, BLOCK_K)
    share = tl.cdiv(k_steps, SPLIT_K)
    k_lo = split * share
    k_hi = tl.minimum(k_steps, k_lo + share)
    offs_n = (n0 + tl.arange(0, BLOCK_N)) % N
    offs_k = k_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_wk = k_lo * (BLOCK_K // PACK) + tl.arange(0, BLOCK_K // PACK)
    a_ptrs = h_ptr + slot[:, None] * stride_hm + offs_k[None, :]
    tl.static_assert(SIDE == 0 or (ROWS == 0 and QUANT == 0 and SPLIT_K == 1 and not SWAP_AB),
                     "a folded tail needs sorted rows, unquantized weights, one K share, no swap")
    if SIDE > 0:
        _, row_ok2, pair2, token2, slot2, _, _ = _tile_rows(
            pid_m + 1, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
            capacity, blocks_per_expert, align_m, ROW_BLOCK, SIDE, ROWS, DIRECT_P,
        )  # fmt: skip
        a2_ptrs = h_ptr + slot2[:, None] * stride_hm + offs_k[None, :]
        acc2 = _zeros_acc(SIDE, BLOCK_N, True)
    b_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
              + offs_wk[:, None])  # fmt: skip
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    s_base = ws_e + (offs_n // WROWS) * stride_wsn
    z_base = wz_ptr + expert.to(tl.int64) * stride_wse + offs_n * stride_wsn
    a_s_base = xs_ptr + slot * stride_xs
    if QUANT == 5:
        gscale = tl.load(wg_ptr + expert)
    else:
        gscale = 1.0
    DOT_DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    acc = _zeros_acc(BM, BLOCK_N, SWAP_AB)
    sc1, sc2 = _step_scales(s_base, z_base, a_s_base, gscale, k_lo, K, QUANT, ASCALE, WSCALE,
                            GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
    for ki in range(k_lo, k_hi):
        nx1, nx2 = _step_scales(s_base, z_base, a_s_base, gscale, ki + 1, K, QUANT, ASCALE,
                                WSCALE, GROUP, SG, HAS_ZERO, BLOCK_K, True)  # fmt: skip
        k_left = K - ki * BLOCK_K
        if USE_TMA and BM == ROW_BLOCK and ROWS != 2:  # (a whole block of consecutive rows)
            a = h_desc.load([slot0, ki * BLOCK_K])
        else:
            a = load_a_tile(a_ptrs, k_left, EVEN_K, BLOCK_K)
        if USE_TMA:
            b = desc_w_tile(w_desc, expert * N + n0, ki * BLOCK_K)
        elif PACK == 1:
            b = _w_tile(b_ptrs, s_base, k_left, QUANT, EVEN_K, BLOCK_K, DOT_DTYPE)
        if PACK == 2:
            acc = _packed_mma(a, b_ptrs, sc1, sc2, k_left, acc, QUANT, EVEN_K, BLOCK_K, SG, HALF,
                              ASM, SWAP_AB, DOT_PRECISION, HAS_ZERO)  # fmt: skip
        else:
            a, a_qs = _fused_act_quant(a, QUANT, ASCALE)
            acc = _stored_mma(a, a_qs, b, acc, s_base, a_s_base, ki, K, QUANT, ASCALE, WSCALE,
                              GROUP, BLOCK_K, INT_DOT, SWAP_AB, DOT_PRECISION)  # fmt: skip
            if SIDE > 0:
                a2 = load_a_tile(a2_ptrs, k_left, EVEN_K, BLOCK_K)
                acc2 = _mma(a2, b, acc2, True, DOT_PRECISION)
        a_ptrs += BLOCK_K
        if SIDE > 0:
            a2_ptrs += BLOCK_K
        if not USE_TMA:
            b_ptrs += BLOCK_K // PACK
        sc1, sc2 = nx1, nx2
    acc = _unswap(acc, SWAP_AB)
    if SIDE > 0:
        acc2 = _unswap(acc2, True)
    if QUANT == 1:
        acc = _w8a8_scale(acc, a_s_base, s_base, ASCALE, WSCALE)

    if HAS_BIAS:
        bias = tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n).to(tl.float32)
        bias = tl.where(split == 0, bias, 0.0)
        acc += bias[None, :]
        if SIDE > 0:
            acc2 += bias[None, :]
    n_out = n0 + tl.arange(0, BLOCK_N)
    _store_down(acc, row_ok, pair, token, slot, n_out, out_ptr, topk_weights_ptr, stride_om, N,
                ROWS, ATOMIC)  # fmt: skip
    if SIDE > 0:
        _store_down(acc2, row_ok2, pair2, token2, slot2, n_out, out_ptr, topk_weights_ptr,
                    stride_om, N, ROWS, ATOMIC)  # fmt: skip


@triton.jit
def _store_down(acc, row_ok, pair, token, slot, n_out, out_ptr, topk_weights_ptr, stride_om, N,
                ROWS: tl.constexpr, ATOMIC: tl.constexpr):  # fmt: skip
    """The down GEMM's rows acc [BM, BLOCK_N] (columns n_out) into out: at out[slot] (masked
    rows), or times the pair's routing weight at out[pair], or added into out[token] (ATOMIC)."""
    mask = row_ok[:, None] & (n_out[None, :] < N)
    if ROWS == 1:
        out_rows = slot
    else:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
        if ATOMIC:
            out_rows = token.to(tl.int64)
        else:
            out_rows = pair.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + n_out[None, :]
    val = acc.to(out_ptr.dtype.element_ty)
    if ATOMIC:
        tl.atomic_add(out_ptrs, val, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptrs, val, mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "capacity", "blocks_per_expert", "num_pid_m"])
def _down_kernel(
    h_ptr,
    h_desc,
    w_ptr,
    w_desc,
    b_ptr,
    out_ptr,
    topk_weights_ptr,
    row_map_ptr,
    block_expert_ptr,
    num_rows_ptr,
    counts_ptr,
    num_pairs,
    top_k,
    num_experts,
    capacity,
    blocks_per_expert,
    align_m,
    num_pid_m,
    N,
    K,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    ws_ptr,
    wz_ptr,
    wg_ptr,
    xs_ptr,
    stride_wse,
    stride_wsn,
    stride_xs,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    ATOMIC: tl.constexpr,
    QUANT: tl.constexpr,
    ASCALE: tl.constexpr,
    WSCALE: tl.constexpr,
    WROWS: tl.constexpr,
    GROUP: tl.constexpr,
    SG: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    PACK: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
    INT_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GDC_WAIT: tl.constexpr = False,
    TAIL_LEVELS: tl.constexpr = 0,
    DIRECT_P: tl.constexpr = 1,
    FOLD: tl.constexpr = 0,
    FOLD_LEVELS: tl.constexpr = 1,
):
    """y = h[slot] @ w2[e].T + b2[e] for N = H output columns, K = I.

    Sorted / direct rows: y is multiplied by the pair's routing weight and either stored at
    out[pair] (out [P, H], summed over K later) or, with ATOMIC, added into out[token]
    (out [T, H], zeroed before). Masked rows: stored unweighted at out[slot] (out [E*C, H]).
    USE_TMA: h_desc (h [slots, I], block [BLOCK_M, BLOCK_K]) and w_desc (w2 viewed [E * H, I],
    block [BLOCK_N, BLOCK_K]) replace the pointer loads. Quantized weights: as `_gate_up_kernel`
    (w8a8: h holds the quantized intermediate, xs its scales). SPLIT_K (ATOMIC only):
    consecutive programs share one output tile, each adding the product over its share of
    the K steps (the bias with the first share). GDC_WAIT, TAIL_LEVELS, FOLD: as
    `_gate_up_kernel`.
    """
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    pid = pid // SPLIT_K
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    if ROWS == 0:
        if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
            return
    _, row_ok, _, _, _, _, first_ok = _tile_rows(
        pid_m, row_map_ptr, block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts,
        capacity, blocks_per_expert, align_m, BLOCK_M, BLOCK_M, ROWS, DIRECT_P,
    )  # fmt: skip
    if not first_ok:
        return
    _run_row_block(
        _down_block,
        (h_ptr, h_desc, w_ptr, w_desc, b_ptr, out_ptr, topk_weights_ptr, row_map_ptr,
         block_expert_ptr, counts_ptr, num_pairs, top_k, num_experts, capacity, blocks_per_expert,
         align_m, N, K, stride_hm, stride_we, stride_wn, stride_be, stride_om, ws_ptr, wz_ptr,
         wg_ptr, xs_ptr, stride_wse, stride_wsn, stride_xs, pid_m, pid_n, split, HAS_BIAS, ROWS,
         ATOMIC, QUANT, ASCALE, WSCALE, WROWS, GROUP, SG, HAS_ZERO, PACK, HALF, ASM, INT_DOT,
         SPLIT_K, USE_TMA, EVEN_K, SWAP_AB, DOT_PRECISION, BLOCK_N, BLOCK_K, BLOCK_M, DIRECT_P),
        pid_m, row_ok, row_map_ptr, block_expert_ptr, num_rows_ptr, num_pairs, align_m, ROWS,
        BLOCK_M, TAIL_LEVELS, FOLD, FOLD_LEVELS,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Sum over the K experts of each token
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def _sum_topk_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    T,
    H,
    top_k,
    E,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t, :] = sum over k of y[t*K + k, :] for the k whose id is in [0, E) (others were
    never written). y [P, H], out [T, H], both row-major with row stride H; float32 sum."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < T
    h_ok = h < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in range(0, top_k):
        pair = t.to(tl.int64) * top_k + k
        e = tl.load(ids_ptr + pair, mask=t_ok, other=-1)
        ok = (e >= 0) & (e < E)
        acc += tl.load(
            y_ptr + pair[:, None] * H + h[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0
        ).to(tl.float32)
    out_ptrs = out_ptr + t.to(tl.int64)[:, None] * H + h[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & h_ok[None, :])
