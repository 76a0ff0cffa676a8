"""The `w4a16` kernels' weight layout: 4-bit weights permuted once so that each lane of a warp
loads its MMA fragments with one 16-byte load (see csrc/w4a16.cu).

A matrix [E, N, K] (N output rows, K the reduction) of 4-bit codes becomes tiles of 16 rows x
64 columns, int32 [E, N/16, K/64, 32 lanes, 4 words]. Lane l = 4g + c holds, in word s, the
codes of rows g and g + 8 at columns 16c + 4s + (0..3) of the tile, as the A registers of one
m16n8k16 MMA: register j (0..3) is row g + 8 (j & 1), columns 16c + 4s + 2 (j >> 1) + (0, 1).
Where the bits of its two codes sit in the word (`bit_positions`) is what the kernel's bit
operations expect: few operations per register.

Scales become bytes [E, N/16, K/B, groups in the block, 8, 2], in blocks of B = max(group, 64)
columns (one K chunk, or the chunks of one group: each scale is stored once): for each scale
group that starts in the block, the entries of rows (g, g + 8), g = 0..7. int4: bf16 scales and
zero offsets 128 + z in bf16 (the kernel subtracts them from 128 + q); mxfp4: the e8m0 codes;
nvfp4: the e4m3 codes (and the float32 global scale per expert, unchanged).

`unpack_codes` / `unpack_scales` invert the permutation: the reference twins the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts import ExpertWeights
from moekit.quant.packing import unpack_uint4

TILE_ROWS, CHUNK = 16, 64
LANES, WORDS = 32, 4
FMT_CODES = {"int4_w4a16": 0, "mxfp4": 1, "nvfp4": 2}
# The largest fp4 scale that still lets the kernel fold 2^126 into one bf16 multiplier:
# bf16 tops out below 2^128, so scale * 2^126 must stay below 4 * 2^126.
ONE_MUL_MAX_SCALE = 3.98


@dataclass(frozen=True)
class PackedMatrix:
    """One expert matrix [E, N, K] in the kernels' layout (see the module docstring).
    fmt: FMT_CODES value; two_mul: fp4 scales too large for one bf16 multiplier."""

    codes: torch.Tensor  # int32 [E, N/16, K/64, 32, 4]
    scales: torch.Tensor  # uint8 [E, N/16, K/max(group, 64), scale bytes per block]
    zeros: torch.Tensor | None  # int4 with zero points: like scales
    global_scale: torch.Tensor | None  # nvfp4: float32 [E]
    fmt: int
    group: int
    two_mul: bool

    @property
    def has_zero(self) -> bool:
        return self.zeros is not None

    @property
    def post_scale(self) -> bool:
        """int4 with groups of 64 or more: a K chunk lies in one group, so the kernels multiply
        q - z on the tensor cores and scale each chunk's float32 sums."""
        return self.fmt == FMT_CODES["int4_w4a16"] and self.group >= CHUNK

    @property
    def build(self) -> tuple[int, bool, bool, bool]:
        """The compiled kernel variant these weights take: (fmt, has_zero, two_mul,
        post_scale)."""
        return (self.fmt, self.has_zero, self.two_mul, self.post_scale)


@dataclass(frozen=True)
class PackedExperts:
    """w13 with gate rows first, then up rows (interleaved checkpoints de-interleaved), w2, and
    the biases in the same row order (bf16)."""

    w13: PackedMatrix
    w2: PackedMatrix
    b13: torch.Tensor | None  # [E, 2I]
    b2: torch.Tensor | None  # [E, H]


def _lane_map(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) in the 16 x 64 tile of each code, long [32 lanes, 4 words, 4 registers j,
    2 halves]: register j of word s holds rows g + 8 (j & 1), columns 16c + 4s + 2 (j >> 1) +
    half."""
    lane = torch.arange(LANES).view(LANES, 1, 1, 1)
    word = torch.arange(WORDS).view(1, WORDS, 1, 1)
    j = torch.arange(4).view(1, 1, 4, 1)
    half = torch.arange(2).view(1, 1, 1, 2)
    g, c = lane // 4, lane % 4
    row = (g + 8 * (j & 1)).expand(LANES, WORDS, 4, 2)
    col = (16 * c + 4 * word + 2 * (j >> 1) + half).expand(LANES, WORDS, 4, 2)
    return row.to(device), col.to(device)


def bit_positions(fmt: int) -> torch.Tensor:
    """long [4 registers j, 2 halves, 4 code bits]: where bit b of each code sits in its word.
    int4: the code is nibble j + 4 half (the kernel masks nibbles j and j + 4 after a shift of
    4j). e2m1 (bits: 0 mantissa, 1-2 exponent, 3 sign): registers 0..2 sit where one left
    shift by 3j puts them at their bf16 places (sign at bit 15, exponent and mantissa at bits
    8..6, +16 for the high half); register 3 fills the other eight bits (14, 13, 11, 10)."""
    pos = torch.empty(4, 2, 4, dtype=torch.int64)
    for j in range(4):
        for half in range(2):
            if fmt == FMT_CODES["int4_w4a16"]:
                bits = [4 * (j + 4 * half) + b for b in range(4)]
            elif j < 3:
                bits = [6 - 3 * j, 7 - 3 * j, 8 - 3 * j, 15 - 3 * j]
            else:
                bits = [10, 11, 13, 14]
            pos[j, half] = torch.tensor(bits) + (16 * half if fmt != 0 else 0)
    return pos


def pack_codes(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    """uint8 codes 0..15 [E, N, K] -> int32 [E, N/16, K/64, 32, 4] (N % 16 == 0, K % 64 == 0)."""
    E, N, K = codes.shape
    row, col = _lane_map(codes.device)
    flat = (row * CHUNK + col).reshape(-1)
    pos = bit_positions(fmt).to(codes.device)
    out = torch.empty(E, N // TILE_ROWS, K // CHUNK, LANES, WORDS, dtype=torch.int32,
                      device=codes.device)  # fmt: skip
    for e in range(E):  # one expert at a time: the int64 words of all of them would be large
        t = codes[e].view(N // TILE_ROWS, TILE_ROWS, K // CHUNK, CHUNK).permute(0, 2, 1, 3)
        t = t.reshape(N // TILE_ROWS, K // CHUNK, TILE_ROWS * CHUNK)[..., flat]
        t = t.view(N // TILE_ROWS, K // CHUNK, LANES, WORDS, 4, 2, 1).to(torch.int64)
        bits = (t >> torch.arange(4, device=t.device)) & 1
        words = (bits << pos).sum((-3, -2, -1))
        out[e] = (words - ((words >> 31) << 32)).to(torch.int32)  # the low 32 bits, signed
    return out


def unpack_codes(packed: torch.Tensor, fmt: int) -> torch.Tensor:
    """The inverse of pack_codes: int32 [E, N/16, K/64, 32, 4] -> uint8 [E, N, K]."""
    E, NT, KC = packed.shape[:3]
    row, col = _lane_map(packed.device)
    pos = bit_positions(fmt).to(packed.device)
    words = packed.to(torch.int64).view(E, NT, KC, LANES, WORDS, 1, 1, 1)
    codes = (((words >> pos) & 1) << torch.arange(4, device=packed.device)).sum(-1)
    tile = torch.empty(E, NT, KC, TILE_ROWS * CHUNK, dtype=torch.uint8, device=packed.device)
    tile[..., (row * CHUNK + col).reshape(-1)] = codes.to(torch.uint8).reshape(E, NT, KC, -1)
    tile = tile.view(E, NT, KC, TILE_ROWS, CHUNK).permute(0, 1, 3, 2, 4)
    return tile.reshape(E, NT * TILE_ROWS, KC * CHUNK)


def _groups_per_block(group: int) -> int:
    """Scale groups in a block of max(group, 64) columns: 64 / group below 64, else one."""
    return max(1, CHUNK // group)


def _block_groups(K: int, group: int, device) -> torch.Tensor:
    """long [K/B, groups per block]: the scale groups of each block of B = max(group, 64)
    columns."""
    per = _groups_per_block(group)
    starts = torch.arange(0, K, max(group, CHUNK)).view(-1, 1) + group * torch.arange(per)
    return (starts // group).to(device)


def pack_scales(scale: torch.Tensor, group: int) -> torch.Tensor:
    """[E, N, K/group] per-group values (any dtype) -> uint8 [E, N/16, K/max(group, 64), bytes
    per block] in the kernels' order (bytes of the dtype, little-endian)."""
    E, N, _ = scale.shape
    K = scale.shape[2] * group
    idx = _block_groups(K, group, scale.device)
    s = scale[:, :, idx]  # [E, N, KC, GC]
    s = s.view(E, N // TILE_ROWS, 2, 8, *idx.shape).permute(0, 1, 4, 5, 3, 2).contiguous()
    return s.view(torch.uint8).reshape(E, N // TILE_ROWS, idx.shape[0], -1)


def unpack_scales(packed: torch.Tensor, dtype: torch.dtype, group: int) -> torch.Tensor:
    """The inverse of pack_scales: -> [E, N, K/group] of `dtype`."""
    E, NT, KB = packed.shape[:3]
    GB = _groups_per_block(group)
    s = packed.contiguous().view(dtype).view(E, NT, KB, GB, 8, 2).permute(0, 1, 5, 4, 2, 3)
    return s.reshape(E, NT * TILE_ROWS, KB * GB)  # blocks hold consecutive groups


def pack_matrix(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                global_scale: torch.Tensor | None, spec) -> PackedMatrix:  # fmt: skip
    """A 4-bit format's stored matrix [E, N, K/2] (two codes per byte) and its scale tensors
    (moekit.quant.spec) -> PackedMatrix."""
    fmt = FMT_CODES[spec.name]
    group = spec.group_size
    codes = pack_codes(unpack_uint4(data), fmt)
    two_mul = False
    if spec.name == "int4_w4a16":
        scales = pack_scales(scale.to(torch.bfloat16), group)
        zeros = None
        if zero is not None:
            zeros = pack_scales((zero.float() + 128).to(torch.bfloat16), group)
    else:
        scales, zeros = pack_scales(scale.view(torch.uint8), group), None
        if spec.name == "mxfp4":  # 2^(code - 1) must be a finite bf16
            two_mul = bool(scale.numel()) and int(scale.max()) > 128
        else:
            largest = scale.float().amax(dim=(1, 2)) * global_scale
            two_mul = bool(largest.numel()) and float(largest.max()) > ONE_MUL_MAX_SCALE
    gs = global_scale.float().contiguous() if global_scale is not None else None
    return PackedMatrix(codes, scales, zeros, gs, fmt, group, two_mul)


def _gate_up_rows(t: torch.Tensor | None, interleaved: bool) -> torch.Tensor | None:
    """Rows of a w13-shaped tensor [E, 2I, ...] in gate-then-up order (None stays None)."""
    if t is None or not interleaved:
        return t
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1).contiguous()


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bfloat16).contiguous()


def pack_experts(w: ExpertWeights, interleaved: bool) -> PackedExperts:
    """ExpertWeights of a 4-bit format -> PackedExperts (w13 rows in gate-then-up order)."""
    w13, s13, z13, b13 = (_gate_up_rows(t, interleaved) for t in (w.w13, w.w13_scale,
                                                                    w.w13_zero, w.b13))  # fmt: skip
    w2 = pack_matrix(w.w2, w.w2_scale, w.w2_zero, w.w2_global_scale, w.spec)
    return PackedExperts(pack_matrix(w13, s13, z13, w.w13_global_scale, w.spec), w2, _bf16(b13),
                         _bf16(w.b2))  # fmt: skip
