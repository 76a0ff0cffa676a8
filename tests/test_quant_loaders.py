"""Checkpoint loaders: small synthetic checkpoints written here in each convention (by plain
loops, independent of the library's packers), loaded, and dequantized exactly."""

import pytest
import torch

from moekit.quant import dequantize, from_quantized, quantize
from moekit.quant.loaders import (
    cat_rows,
    load_awq,
    load_fp8,
    load_gptq,
    load_int8,
    load_mxfp4_blocks,
    load_nvfp4,
    load_packed,
    stack,
)

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _to_int32(t64: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> int32 with the same bits."""
    t64 = t64 & 0xFFFFFFFF
    return torch.where(t64 >= 2**31, t64 - 2**32, t64).to(torch.int32)


def _int4_groups(W_KN: torch.Tensor, g: int, sym: bool):
    """GPTQ/AWQ-style quantization of W [K, N] per group of g rows: q [K, N], z, s [K/g, N]."""
    K, N = W_KN.shape
    q, zs, ss = torch.empty(K, N, dtype=torch.int64), [], []
    for j in range(K // g):
        Wg = W_KN[j * g : (j + 1) * g]
        if sym:
            s = (2 * Wg.abs().amax(0) / 15).clamp_min(1e-8)
            z = torch.full((N,), 8.0)
        else:
            lo, hi = Wg.amin(0).clamp(max=0), Wg.amax(0).clamp(min=0)
            s = ((hi - lo) / 15).clamp_min(1e-8)
            z = torch.round(-lo / s)
        s = s.half().float()
        q[j * g : (j + 1) * g] = torch.clamp(torch.round(Wg / s) + z, 0, 15).long()
        zs.append(z.long())
        ss.append(s.half())
    return q, torch.stack(zs), torch.stack(ss)


def _expected(q_KN, z_GN, s_GN, g):
    s = s_GN.float().repeat_interleave(g, 0)
    z = z_GN.float().repeat_interleave(g, 0)
    return ((q_KN.float() - z) * s).T  # [N, K]


def gptq_checkpoint(w_NK, g, sym, zero_offset=1):
    """(qweight [K/8, N], qzeros [K/g, N/8], scales [K/g, N], g_idx [K]), expected w [N, K]."""
    N, K = w_NK.shape
    q, z, s = _int4_groups(w_NK.T, g, sym)
    qweight = torch.zeros(K // 8, N, dtype=torch.int64)
    for r in range(K // 8):
        for i in range(8):
            qweight[r] |= q[8 * r + i] << (4 * i)
    stored = (z - zero_offset) & 0xF
    qzeros = torch.zeros(K // g, N // 8, dtype=torch.int64)
    for c in range(N // 8):
        for i in range(8):
            qzeros[:, c] |= stored[:, 8 * c + i] << (4 * i)
    g_idx = torch.tensor([k // g for k in range(K)], dtype=torch.int32)
    return (_to_int32(qweight), _to_int32(qzeros), s, g_idx), _expected(q, z, s, g)


def awq_checkpoint(w_NK, g):
    """(qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N]), expected w [N, K]."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    N, K = w_NK.shape
    q, z, s = _int4_groups(w_NK.T, g, sym=False)

    def pack(v):
        out = torch.zeros(v.shape[0], N // 8, dtype=torch.int64)
        for c in range(N // 8):
            for i in range(8):
                out[:, c] |= v[:, 8 * c + order[i]] << (4 * i)
        return _to_int32(out)

    return (pack(q), pack(z), s), _expected(q, z, s, g)


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("zero_offset", [1, 0], ids=["v1", "v2"])
def test_gptq(g, sym, zero_offset):
    w = torch.randn(2, 48, 256)  # two experts, N = 48, K = 256
    parts = [gptq_checkpoint(w[e], g, sym, zero_offset) for e in range(2)]
    tensors = [torch.stack([p[0][i] for p in parts]) for i in range(4)]
    expect = torch.stack([p[1] for p in parts])
    q = load_gptq(*tensors, zero_offset=zero_offset)
    assert q.shape == (2, 48, 256) and q.spec.group_size == g
    assert q.spec.symmetric == sym and (q.zero is None) == sym
    assert q.spec.scale_dtype == torch.float16
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)
    rel = ((dequantize(q) - w).norm() / w.norm()).item()
    assert rel < 0.15  # the checkpoint is a real quantization of w


def test_gptq_errors():
    (qweight, qzeros, scales, g_idx), _ = gptq_checkpoint(torch.randn(16, 128), 32, True)
    with pytest.raises(ValueError, match="act-order"):
        load_gptq(qweight, qzeros, scales, g_idx.flip(0))
    with pytest.raises(ValueError, match="needs scales"):
        load_gptq(qweight, qzeros, scales[:2])
    with pytest.raises(ValueError, match="must be int32"):
        load_gptq(qweight.to(torch.int64), qzeros, scales)
    (qw, qz, sc, _), _ = gptq_checkpoint(torch.randn(16, 128), 128, True)
    with pytest.raises(ValueError, match=r"group size 16.0; supported group sizes: \(32, 64, 128\)"):
        load_gptq(qw, torch.cat([qz] * 8), torch.cat([sc] * 8))


@pytest.mark.parametrize("g", [64, 128])
def test_awq(g):
    w = torch.randn(3, 40, 256)
    parts = [awq_checkpoint(w[e], g) for e in range(3)]
    tensors = [torch.stack([p[0][i] for p in parts]) for i in range(3)]
    q = load_awq(*tensors)
    assert q.shape == (3, 40, 256) and q.spec.group_size == g and not q.spec.symmetric
    torch.testing.assert_close(dequantize(q), torch.stack([p[1] for p in parts]), rtol=0, atol=0)


def test_awq_order_matters():
    """A checkpoint packed in plain (GPTQ) column order must not load as the same weight."""
    w = torch.randn(16, 128)
    (qweight, qzeros, scales), expect = awq_checkpoint(w, 128)
    q = load_awq(qweight, qzeros, scales)
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)
    nib = torch.stack([(qweight >> (4 * i)) & 0xF for i in range(8)], -1)  # nibble i
    plain = torch.zeros_like(qweight, dtype=torch.int64)
    for i in range(8):  # re-pack the same columns with nibble j = column j
        j = [0, 2, 4, 6, 1, 3, 5, 7][i]
        plain |= nib[..., i].long() << (4 * j)
    assert not torch.equal(dequantize(load_awq(_to_int32(plain), qzeros, scales)), expect)


def _fp8_blocks(w, bn=128, bk=128):
    N, K = w.shape
    nb, kb = -(-N // bn), -(-K // bk)
    s = torch.empty(nb, kb)
    wq = torch.empty(N, K)
    for i in range(nb):
        for j in range(kb):
            blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            s[i, j] = blk.abs().max() / 448
            wq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = blk / s[i, j]
    return wq.to(torch.float8_e4m3fn), s


def test_fp8_deepseek_block():
    w = torch.randn(2, 200, 300)
    weights, scale_inv = zip(*(_fp8_blocks(w[e]) for e in range(2)))
    weight, scale_inv = torch.stack(weights), torch.stack(scale_inv)
    q = load_fp8(weight, scale_inv)
    assert q.spec.weight_scale == "block"
    assert q.spec.act_scheme == "token_group" and q.scale.shape == (2, 2, 3)
    expect = weight.float() * scale_inv.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :300]
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)
    # e4m3: half an ulp relative, and half the subnormal step 2^-9 * scale absolute
    atol = 2**-10 * scale_inv.max().item()
    torch.testing.assert_close(dequantize(q), w, rtol=2**-4, atol=atol)


def test_fp8_per_tensor_and_channel():
    w = torch.randn(2, 16, 64)
    s_t = w.abs().amax((1, 2)) / 448
    q = load_fp8((w / s_t[:, None, None]).to(torch.float8_e4m3fn), s_t[:, None])
    assert q.spec.weight_scale == "tensor" and q.scale.shape == (2,)
    s_c = w.abs().amax(2, keepdim=True) / 448  # [E, N, 1] as compressed-tensors stores it
    q = load_fp8((w / s_c).to(torch.float8_e4m3fn), s_c, activation_scheme="static_tensor")
    assert q.spec.weight_scale == "channel" and q.spec.act_scheme == "static_tensor"
    torch.testing.assert_close(dequantize(q), w, rtol=2**-4, atol=0)
    with pytest.raises(ValueError, match=r"must be per tensor \[2\], per channel \[2, 16\] or block-wise"):
        load_fp8(w.to(torch.float8_e4m3fn), torch.ones(2, 3))
    with pytest.raises(ValueError, match="e4m3fn"):
        load_fp8(w.half(), s_t)


def ct_packed_checkpoint(w_NK, bits, g=None, sym=True, packed_zeros=True):
    """compressed-tensors pack-quantized tensors of w [N, K] (dict of suffix -> tensor) and the
    weight they hold: signed values q in [-2^(b-1), 2^(b-1)) stored plus 2^(b-1), packed 32/b
    to an int32 along K (padded); 4 bits: scales per group of g along K, asymmetric zero
    points signed, packed likewise along N (or stored unpacked in int8); 8 bits: per channel."""
    N, K = w_NK.shape
    half, per = 1 << (bits - 1), 32 // bits
    g = g or K
    wg = w_NK.reshape(N, K // g, g)
    if sym:
        s = (wg.abs().amax(-1) / (half - 1)).clamp_min(1e-8)
        z = torch.zeros(N, K // g)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / (2 * half - 1)).clamp_min(1e-8)
        z = torch.round(-lo / s) - half  # signed: q = round(w / s) + z
    s = s.bfloat16().float()
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], -half, half - 1)
    expect = ((q - z[..., None]) * s[..., None]).reshape(N, K)
    u = (q.reshape(N, K) + half).long()
    P = -(-K // per)
    packed = torch.zeros(N, P, dtype=torch.int64)
    for k in range(K):
        packed[:, k // per] |= u[:, k] << (bits * (k % per))
    out = {".weight_packed": _to_int32(packed), ".weight_scale": s.bfloat16(),
           ".weight_shape": torch.tensor([N, K], dtype=torch.int32)}  # fmt: skip
    if not sym:
        if packed_zeros:
            zp = torch.zeros(-(-N // 8), K // g, dtype=torch.int64)
            for n in range(N):
                zp[n // 8] |= (z[n].long() + 8) << (4 * (n % 8))
            out[".weight_zero_point"] = _to_int32(zp)
        else:
            out[".weight_zero_point"] = z.to(torch.int8)
    return out, expect


def _packed_args(t):
    return (t[".weight_packed"], t[".weight_scale"], t[".weight_shape"],
            t.get(".weight_zero_point"), t.get(".weight_g_idx"))  # fmt: skip


@pytest.mark.parametrize("g", [32, 128])
@pytest.mark.parametrize("sym, packed_zeros", [(True, True), (False, True), (False, False)],
                         ids=["sym", "asym", "asym-unpacked-zeros"])  # fmt: skip
def test_compressed_tensors_int4(g, sym, packed_zeros):
    w = torch.randn(2, 44, 256)  # two experts, N = 44 (zero points pad to 48 rows), K = 256
    parts = [ct_packed_checkpoint(w[e], 4, g, sym, packed_zeros) for e in range(2)]
    stacked = {k: torch.stack([p[0][k] for p in parts]) for k in parts[0][0]}
    q = load_packed(*_packed_args(stacked))
    assert q.shape == (2, 44, 256) and q.spec.name == "int4_w4a16" and q.spec.group_size == g
    assert q.spec.symmetric == sym and q.spec.scale_dtype == torch.bfloat16
    torch.testing.assert_close(dequantize(q), torch.stack([p[1] for p in parts]), rtol=0, atol=0)
    assert ((dequantize(q) - w).norm() / w.norm()).item() < 0.15


def test_compressed_tensors_int8_weight_only_and_padding():
    w = torch.randn(6, 50)  # K = 50: 13 words, the last holding 2 values and padding
    t, expect = ct_packed_checkpoint(w, 8)
    assert t[".weight_packed"].shape == (6, 13)
    q = load_packed(*_packed_args(t))
    assert q.spec.name == "int8_w8a16" and q.shape == (6, 50)
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)
    assert load_packed(*_packed_args(t), int8_weight_only=False).spec.name == "int8_w8a8"


def test_compressed_tensors_errors():
    t, _ = ct_packed_checkpoint(torch.randn(16, 128), 4, 32)
    args = _packed_args(t)
    with pytest.raises(ValueError, match="act-order"):
        load_packed(*args[:4], torch.arange(128).flip(0) // 32)
    with pytest.raises(ValueError, match=r"does not hold weight_shape \[16, 100\]"):
        load_packed(args[0], args[1], torch.tensor([16, 100]))
    with pytest.raises(ValueError, match="weight_zero_point must be int32"):
        load_packed(*args[:3], torch.zeros(16, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight_shape must hold one"):
        load_packed(args[0], args[1], torch.tensor([[16, 128], [16, 64]]))
    t8, _ = ct_packed_checkpoint(torch.randn(16, 128), 8)
    with pytest.raises(ValueError, match="symmetric per-channel int8"):
        load_packed(*_packed_args(t8)[:3], torch.zeros(2, 1, dtype=torch.int32))


def test_int8():
    w = torch.randn(4, 32)
    s = w.abs().amax(1, keepdim=True) / 127
    q = load_int8(torch.round(w / s).to(torch.int8), s)
    assert q.spec.name == "int8_w8a8"
    torch.testing.assert_close(dequantize(q), torch.round(w / s) * s, rtol=0, atol=0)
    assert load_int8(q.data, s[:, 0], weight_only=True).spec.name == "int8_w8a16"
    with pytest.raises(ValueError, match="per channel"):
        load_int8(q.data, s.T)


def test_mxfp4_gpt_oss_blocks():
    E, N, G = 2, 24, 4  # K = 128
    codes = torch.randint(0, 16, (E, N, G, 32))
    exps = torch.randint(118, 136, (E, N, G), dtype=torch.uint8)
    blocks = torch.zeros(E, N, G, 16, dtype=torch.uint8)
    for j in range(16):  # gpt-oss: low nibble = element 2j, high nibble = element 2j + 1
        blocks[..., j] = (codes[..., 2 * j] | (codes[..., 2 * j + 1] << 4)).to(torch.uint8)
    lut = torch.tensor(FP4_VALUES)
    expect = torch.ldexp(lut[codes], exps.long()[..., None] - 127).reshape(E, N, G * 32)
    q = load_mxfp4_blocks(blocks, exps)
    assert q.shape == (E, N, 128) and q.spec.name == "mxfp4"
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"blocks must be \[.., N, K/32, 16\]"):
        load_mxfp4_blocks(blocks[..., :8], exps)


def test_nvfp4_modelopt():
    N, K = 8, 64
    codes = torch.randint(0, 16, (N, K))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    block = (torch.rand(N, K // 16) * 100 + 0.1).to(torch.float8_e4m3fn)
    g = torch.tensor(0.003)
    q = load_nvfp4(packed, block, g)
    expect = torch.tensor(FP4_VALUES)[codes] * block.float().repeat_interleave(16, 1) * g
    torch.testing.assert_close(dequantize(q), expect, rtol=0, atol=0)


@pytest.mark.parametrize("fmt, params", [
    ("int4_w4a16", dict(group_size=32, symmetric=False)),
    ("mxfp4", {}),
    ("fp8_w8a8", {}),  # block-wise, parts of 128 rows: exact
    ("fp8_w8a8", dict(weight_scale="channel")),
    ("int8_w8a8", {}),
])
def test_cat_rows_and_stack_exact(fmt, params):
    """gate [I, H] + up [I, H] per expert -> w13 [E, 2I, H] equals quantizing nothing anew."""
    gates = [quantize(torch.randn(128, 256), fmt, **params) for _ in range(3)]
    ups = [quantize(torch.randn(128, 256) * 3, fmt, **params) for _ in range(3)]
    w13 = stack([cat_rows([g, u]) for g, u in zip(gates, ups)])
    assert w13.shape == (3, 256, 256)
    expect = torch.stack([torch.cat([dequantize(g), dequantize(u)]) for g, u in zip(gates, ups)])
    torch.testing.assert_close(dequantize(w13), expect, rtol=0, atol=0)


@pytest.mark.parametrize("fmt, params", [("int4_w4a16", dict(symmetric=False)), ("nvfp4", {}),
                                         ("fp8_w8a8", dict(weight_scale="tensor"))])  # fmt: skip
def test_indexing_picks_one_expert(fmt, params):
    """q[e] of a stacked [E, N, K] weight is expert e as quantized alone (zeros, global scales)."""
    parts = [quantize(torch.randn(64, 128) * (e + 1), fmt, **params) for e in range(3)]
    w = stack(parts)
    for e, part in enumerate(parts):
        assert w[e].shape == (64, 128) and w[e].spec == part.spec
        torch.testing.assert_close(dequantize(w[e]), dequantize(part), rtol=0, atol=0)
    with pytest.raises(IndexError, match="no leading dim"):
        parts[0][0]


@pytest.mark.parametrize("fmt, params", [("fp8_w8a8", dict(weight_scale="tensor")), ("nvfp4", {})])
def test_cat_rows_requantizes_tensor_scales(fmt, params):
    g, u = quantize(torch.randn(64, 128), fmt, **params), quantize(torch.randn(64, 128) * 4, fmt, **params)
    w13 = cat_rows([g, u])
    expect = torch.cat([dequantize(g), dequantize(u)])
    assert ((dequantize(w13) - expect).norm() / expect.norm()).item() < 0.1
    # the larger part (up) keeps its scale, so its values come back exactly
    torch.testing.assert_close(dequantize(w13)[64:], expect[64:], rtol=1e-6, atol=0)


def test_loaded_experts_assemble_into_expert_weights():
    E, I, H = 2, 32, 128
    gate = [load_mxfp4_blocks(*_random_mxfp4(I, H)) for _ in range(E)]
    up = [load_mxfp4_blocks(*_random_mxfp4(I, H)) for _ in range(E)]
    down = [load_mxfp4_blocks(*_random_mxfp4(H, I)) for _ in range(E)]
    ew = from_quantized(stack([cat_rows([g, u]) for g, u in zip(gate, up)]), stack(down))
    assert (ew.num_experts, ew.intermediate_size, ew.hidden_size) == (E, I, H)
    torch.testing.assert_close(ew.dequantized(torch.float32).w2[1], dequantize(down[1]))


def _random_mxfp4(N, K):
    blocks = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8)
    return blocks, torch.randint(120, 130, (N, K // 32), dtype=torch.uint8)
