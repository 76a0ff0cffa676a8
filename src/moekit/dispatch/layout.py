"""The fixed layout of low-latency dispatch: where each token goes in the send buffer, and where
each received (row, k) pair goes in the masked expert buffer. Fixed shapes, no host
synchronisation. Each plan is one Triton kernel on CUDA, with a PyTorch twin (`*_torch`) used
on CPU and as the reference in tests.

R ranks, E local experts per rank, C = capacity (tokens per rank), RC = R * C rows per buffer.
Send buffer block r (rows r*C .. r*C + C-1) holds, in token order, the tokens that have an
expert on rank r; its meta rows hold their local ids there (-1 for experts elsewhere) and the
weights (0 there); rows past them hold ids -1.
"""

from __future__ import annotations

import torch

from moekit.dispatch.rows import _use_triton
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
    if not _use_triton(ids_TK, impl) or ids_TK.shape[0] == 0:
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
    if not _use_triton(recv_ids, impl):
        return recv_plan_torch(recv_ids, recv_w, E)
    from moekit.dispatch._kernels import launch_ll_recv_plan

    RC, K = recv_ids.shape
    dev = recv_ids.device
    dest = torch.empty(RC, K, dtype=torch.int64, device=dev)
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    w_out = torch.empty(RC, K, dtype=torch.float32, device=dev)
    launch_ll_recv_plan(recv_ids, recv_w, dest, counts, w_out, E)
    return dest, counts, w_out
