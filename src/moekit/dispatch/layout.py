"""Send-buffer layouts of the all-to-all dispatcher. Each plan / pack is one Triton kernel on
CUDA, with a PyTorch twin (`*_torch`) used on CPU and as the reference in tests.

Normal mode (variable sizes): `normal_plan` numbers, per destination rank, the tokens that have
an expert there, chunk by chunk (the tokens are cut into a few chunks, one all-to-all call
each; in a chunk the rank blocks are back to back, tokens in order); `pack_rows` writes each
token's payload once per destination rank into the packed send buffer, with the row's
metadata (local ids there, weights) in the same row, so that one all_to_all_single per chunk
moves everything. Neither synchronises with the host.

Low latency (fixed shapes): where each token goes in the send buffer, and where each received
(row, k) pair goes in the masked expert buffer; no host synchronisation.

R ranks, E local experts per rank, C = capacity (tokens per rank), RC = R * C rows per buffer.
Send buffer block r (rows r*C .. r*C + C-1) holds, in token order, the tokens that have an
expert on rank r; its meta rows hold their local ids there (-1 for experts elsewhere) and the
weights (0 there); rows past them hold ids -1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.dispatch.rows import use_triton
from moekit.dispatch.slots import SlotMap


def send_plan_torch(ids_TK, weights_TK, slots: SlotMap, R: int, E: int, C: int,
                    send_ids, send_w) -> torch.Tensor:
    """Fill send_ids / send_w [RC, K] (views of the send buffer); return rows_TR [T, R] int64:
    the send row of (token, rank), RC where the token has no expert on that rank."""
    T, K = ids_TK.shape
    RC, dev = R * C, ids_TK.device
    slot = slots.physical(ids_TK)
    start = (torch.arange(R, device=dev) * E).view(1, R, 1)
    here = (slot.unsqueeze(1) >= start) & (slot.unsqueeze(1) < start + E)  # [T, R, K]
    hit = here.any(dim=-1)
    pos = hit.long().cumsum(dim=0) - 1
    rows_TR = torch.where(hit, torch.arange(R, device=dev) * C + pos, RC)
    local = torch.where(here, slot.unsqueeze(1) - start, -1).to(torch.int32)
    weights = torch.where(here, weights_TK.float().unsqueeze(1), 0.0)
    ids_out = torch.full((RC + 1, K), -1, dtype=torch.int32, device=dev)  # last row: trash
    w_out = torch.zeros(RC + 1, K, dtype=torch.float32, device=dev)
    flat = rows_TR.reshape(-1)
    ids_out.index_put_((flat,), local.reshape(T * R, K))
    w_out.index_put_((flat,), weights.reshape(T * R, K))
    send_ids.copy_(ids_out[:RC])
    send_w.copy_(w_out[:RC])
    return rows_TR


def send_plan(ids_TK, weights_TK, slots: SlotMap, R: int, E: int, C: int, send_ids, send_w,
              impl: str = "auto") -> torch.Tensor:
    """See `send_plan_torch` (T <= C is the caller's check)."""
    if not use_triton(ids_TK, impl) or ids_TK.shape[0] == 0:
        return send_plan_torch(ids_TK, weights_TK, slots, R, E, C, send_ids, send_w)
    from moekit.dispatch._kernels import launch_ll_send_plan

    T = ids_TK.shape[0]
    table, copies = slots._on(ids_TK.device)
    rows = torch.empty(T, R, dtype=torch.int64, device=ids_TK.device)
    launch_ll_send_plan(ids_TK.to(torch.int32).contiguous(), weights_TK.float().contiguous(),
                        table, copies, slots.redundant and slots.spread, rows, send_ids, send_w,
                        E, C, R)
    return rows


def recv_plan_torch(recv_ids, recv_w, E: int):
    """recv_ids / recv_w [RC, K] (views of the receive buffer) -> (dest [RC, K] int64: masked
    slot e * RC + position of each pair, E * RC where unused; counts [E] int32; weights [RC, K]
    float32 contiguous). Pairs of one expert are numbered in (row, k) order."""
    RC, K = recv_ids.shape
    dev = recv_ids.device
    ids = recv_ids.long()
    onehot = ids.reshape(-1, 1) == torch.arange(E, device=dev)  # [RC*K, E]
    ranked = onehot.long().cumsum(dim=0)
    counts = ranked[-1].to(torch.int32)
    index = ranked.gather(1, ids.clamp(min=0).reshape(-1, 1)).view(RC, K) - 1
    dest = torch.where(ids >= 0, ids * RC + index, E * RC)
    return dest, counts, recv_w.contiguous()


def recv_plan(recv_ids, recv_w, E: int, impl: str = "auto"):
    """See `recv_plan_torch`."""
    if not use_triton(recv_ids, impl):
        return recv_plan_torch(recv_ids, recv_w, E)
    from moekit.dispatch._kernels import launch_ll_recv_plan

    RC, K = recv_ids.shape
    dev = recv_ids.device
    dest = torch.empty(RC, K, dtype=torch.int64, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    w_out = torch.empty(RC, K, dtype=torch.float32, device=dev)
    launch_ll_recv_plan(recv_ids, recv_w, dest, counts, w_out, E)
    return dest, counts, w_out


# ---- normal mode -----------------------------------------------------------------------------

PLAN_BLOCK = 128  # tokens per plan block (the Triton plan kernel runs one program per block)
MAX_CHUNKS = 4  # at most this many chunks (all-to-all calls) per normal-mode dispatch


@dataclass(frozen=True)
class NormalPlan:
    """Where each (token, destination rank) goes in the packed send buffer; no host sync.

    The tokens are cut into `num_chunks` chunks of whole blocks (`chunk_tokens` tokens each,
    the last one shorter, the ones past T empty), one all-to-all call each; the send buffer
    holds the chunks back to back, and in each chunk the rank blocks back to back, tokens in
    order.

    slot [T, K] int32: physical slot of each pair (-1 masked); local [T, R] int32: position of
    token t among the tokens of its block of `block` tokens with an expert on rank r (-1 if
    none); base [NB, R] int64: send row of block b's first token for rank r; counts
    [R, MAX_CHUNKS + 1] int64: rows of chunk c sent to rank r (zero for c >= num_chunks), and
    T in the last column (the counts exchange tells every rank every rank's T). Send row of
    (t, r) = base[t // block, r] + local[t, r]."""

    slot: torch.Tensor
    local: torch.Tensor
    base: torch.Tensor
    counts: torch.Tensor
    block: int
    num_chunks: int = 1
    blocks_per_chunk: int = 1

    @property
    def chunk_tokens(self) -> int:
        return self.blocks_per_chunk * self.block

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """[(t0, t1)] token range of each chunk c < num_chunks (empty ranges past T)."""
        T, S = self.local.shape[0], self.chunk_tokens
        return [(min(c * S, T), min((c + 1) * S, T)) for c in range(self.num_chunks)]

    def first(self, T: int) -> NormalPlan:
        """The plan of the first T tokens (the rest, padding, go nowhere)."""
        return replace(self, slot=self.slot[:T], local=self.local[:T])

    def rows(self) -> torch.Tensor:
        """[T, R] int64: the send row of (token, rank), -1 where the token does not go."""
        T = self.local.shape[0]
        b = torch.arange(T, device=self.local.device) // self.block
        return torch.where(self.local >= 0, self.base[b] + self.local.long(), -1)


def blocks_per_chunk(T: int, block: int, num_chunks: int) -> int:
    """Plan blocks per chunk: num_chunks chunks of whole blocks cover T (the last shorter)."""
    blocks = -(-T // block)
    return max(1, -(-blocks // num_chunks))


def chunk_tokens(T: int, block: int, num_chunks: int) -> int:
    """Tokens per chunk (see blocks_per_chunk)."""
    return blocks_per_chunk(T, block, num_chunks) * block


PLAN_TILE = 4096  # the plan kernel's last program sums an [blocks, ranks] tile this large


def _plan_block(R: int, K: int, T: int = 0) -> int:
    """Tokens per plan program: PLAN_BLOCK, less for wide [tokens, K, R] tiles, more when T
    needs more than PLAN_TILE / R blocks (powers of two)."""
    import math

    rp = 1 << max(0, math.ceil(math.log2(max(R, 1))))
    kp = 1 << max(1, math.ceil(math.log2(max(K, 1))))
    block = max(16, min(PLAN_BLOCK, 8192 // (rp * kp)))
    max_blocks = max(2, PLAN_TILE // max(rp, 2))
    while -(-T // block) > max_blocks:
        block *= 2
    return block


def _check_chunks(num_chunks: int) -> None:
    if not 1 <= num_chunks <= MAX_CHUNKS:
        raise ValueError(f"normal plan: num_chunks must be in [1, {MAX_CHUNKS}], got {num_chunks}")


def normal_plan_torch(ids_TK, slots: SlotMap, R: int, E: int, num_chunks: int = 1,
                      counts_out=None, block: int | None = None) -> NormalPlan:
    """ids_TK [T, K] logical (-1 masked) -> NormalPlan (see there). counts_out: an
    [R, MAX_CHUNKS + 1] int64 tensor to hold the counts (e.g. a view of the counts-exchange
    buffer)."""
    _check_chunks(num_chunks)
    T, K = ids_TK.shape
    block = block or _plan_block(R, K, T)
    dev = ids_TK.device
    slot = slots.physical(ids_TK)
    rank = torch.where(slot >= 0, slot // E, -1)
    hit = (rank.unsqueeze(1) == torch.arange(R, device=dev).view(1, R, 1)).any(dim=-1)  # [T, R]
    NB = -(-T // block)
    padded = torch.zeros(NB * block, R, dtype=torch.int64, device=dev)
    padded[:T] = hit.long()
    per_block = padded.view(NB, block, R)
    local = (per_block.cumsum(dim=1) - 1).view(NB * block, R)[:T]
    local = torch.where(hit, local, -1).to(torch.int32)
    bcount = per_block.sum(dim=1)  # [NB, R]
    counts = torch.zeros(R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
    counts[:, MAX_CHUNKS] = T
    base = torch.empty(NB, R, dtype=torch.int64, device=dev)
    bpc = blocks_per_chunk(T, block, num_chunks)
    start = 0
    for c in range(num_chunks):
        blk = bcount[c * bpc:(c + 1) * bpc]  # [blocks of chunk c, R]
        total = blk.sum(dim=0)
        counts[:, c] = total
        base[c * bpc:(c + 1) * bpc] = (start + total.cumsum(0) - total).view(1, R) + \
            blk.cumsum(dim=0) - blk
        start += int(total.sum())
    if counts_out is not None:
        counts_out.copy_(counts)
        counts = counts_out
    return NormalPlan(slot.to(torch.int32), local, base, counts, block, num_chunks, bpc)


def normal_plan(ids_TK, slots: SlotMap, R: int, E: int, num_chunks: int = 1, impl: str = "auto",
                counts_out=None, ticket=None, args=None) -> NormalPlan:
    """See `normal_plan_torch`: one Triton kernel on CUDA (one program per block of tokens;
    the last program to finish turns the block counts into counts and bases). ticket: a zeroed
    int32 [1] tensor the kernel counts finished programs in (and leaves zeroed); reuse one per
    stream, never on two streams at once (None: a fresh one). args: the kernel reads T and the
    ids from this int64 device tensor [T, ids address, ...] (a launch a CUDA graph replays);
    ids_TK then only gives the capacity and K, and the plan's blocks_per_chunk is for T =
    capacity (the caller sets it for the real T)."""
    _check_chunks(num_chunks)
    T, K = ids_TK.shape
    if args is None and (not use_triton(ids_TK, impl) or T == 0 or K == 0):
        return normal_plan_torch(ids_TK, slots, R, E, num_chunks, counts_out)
    from moekit.dispatch._kernels import launch_normal_plan

    dev = ids_TK.device
    block = _plan_block(R, K, T)
    NB = -(-T // block)
    table, copies = slots._on(dev)
    slot = torch.empty(T, K, dtype=torch.int32, device=dev)
    local = torch.empty(T, R, dtype=torch.int32, device=dev)
    bcount = torch.empty(NB, R, dtype=torch.int32, device=dev)
    base = torch.empty(NB, R, dtype=torch.int64, device=dev)
    counts = counts_out if counts_out is not None else torch.empty(
        R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
    if ticket is None:
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)
    bpc = blocks_per_chunk(T, block, num_chunks)
    launch_normal_plan(ids_TK.contiguous(), table, copies, slots.redundant and slots.spread,
                       slot, local, bcount, base, counts, ticket, E, R, block, bpc, args,
                       num_chunks)
    return NormalPlan(slot, local, base, counts, block, num_chunks, bpc)


def pack_rows_torch(payload_TP, plan: NormalPlan, weights_TK, E: int, out, meta, rows_TR=None,
                    tokens: tuple[int, int] | None = None) -> torch.Tensor:
    """Write token t's payload row (payload_TP [T, P], any dtype) to out [N, P] (same dtype) at
    its send row for each rank r it hits (NormalPlan.rows), and that row's metadata to meta
    [N, 2K] int32 (may be a view into the rows of out): K local ids on r (-1 for experts
    elsewhere), then the K float32 weights' bits (0 elsewhere). tokens: (t0, t1), only those
    tokens (one chunk; default all). Returns rows_TR [T, R] int64 (-1 where the token does not
    go to r), written into rows_TR when given (only the rows of `tokens`). Rows not named stay
    unwritten."""
    rows = plan.rows()
    T, R = rows.shape
    t0, t1 = tokens if tokens is not None else (0, T)
    if rows_TR is None:
        rows_TR = rows
    else:
        rows_TR[t0:t1] = rows[t0:t1]
    K = plan.slot.shape[1]
    if t1 <= t0 or out.shape[0] == 0:
        return rows_TR
    t_idx, r_idx = (rows[t0:t1] >= 0).nonzero(as_tuple=True)
    t_idx = t_idx + t0
    dest = rows[t_idx, r_idx]
    out[dest] = payload_TP[t_idx]
    ids, w = _local_meta(plan.slot, weights_TK, R, E)
    meta[dest, :K] = ids[t_idx, r_idx]
    meta[dest, K:] = w[t_idx, r_idx].view(torch.int32)
    return rows_TR


def _local_meta(slot_TK, weights_TK, R: int, E: int):
    """-> (local ids [T, R, K] int32, -1 off rank r; weights [T, R, K] float32, 0 off rank r)."""
    start = (torch.arange(R, device=slot_TK.device) * E).view(1, R, 1)
    s = slot_TK.long().unsqueeze(1)
    here = (s >= start) & (s < start + E)
    ids = torch.where(here, s - start, -1).to(torch.int32)
    return ids, torch.where(here, weights_TK.float().unsqueeze(1), 0.0)


def _word_dtype(t: torch.Tensor, nbytes: int) -> torch.dtype:
    """The widest of int32 / int16 / uint8 that divides the row bytes, row stride and base."""
    for dt in (torch.int32, torch.int16):
        n = dt.itemsize
        if nbytes % n == 0 and (t.stride(0) * t.element_size()) % n == 0 and t.data_ptr() % n == 0:
            return dt
    return torch.uint8


def pack_rows(payload_TP, plan: NormalPlan, weights_TK, E: int, out, meta, rows_TR=None,
              tokens: tuple[int, int] | None = None, impl: str = "auto") -> torch.Tensor:
    """See `pack_rows_torch`; payload rows may be strided (last dim contiguous); out must have
    contiguous rows."""
    if not use_triton(payload_TP, impl):
        return pack_rows_torch(payload_TP, plan, weights_TK, E, out, meta, rows_TR, tokens)
    from moekit.dispatch._kernels import launch_pack_rows

    T, R = plan.local.shape
    if rows_TR is None:
        rows_TR = torch.empty(T, R, dtype=torch.int64, device=plan.local.device)
    t0, t1 = tokens if tokens is not None else (0, T)
    if t1 <= t0:
        return rows_TR
    if payload_TP.stride(-1) != 1:
        payload_TP = payload_TP.contiguous()
    nbytes = payload_TP.shape[1] * payload_TP.element_size()
    wd = _word_dtype(payload_TP, nbytes)
    if wd != _word_dtype(out, nbytes):
        wd = torch.uint8
    src, dst = payload_TP.view(torch.uint8), out.view(torch.uint8)
    if wd != torch.uint8:
        src, dst = src.view(wd), dst.view(wd)
    launch_pack_rows(src, plan.slot, weights_TK.float().contiguous(), plan.local, plan.base,
                     rows_TR, dst, meta, E, plan.block, t0, t1)
    return rows_TR
