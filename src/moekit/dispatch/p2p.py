"""Normal mode over NVLink peer-to-peer writes (normal_transport 'p2p'): the ranks of one host
write token rows straight into each other's receive buffers in symmetric memory
(torch.distributed._symmetric_memory): no collective is launched per call, and the rows
travel without waiting for the host (which reads the counts while they move, to size the
runner's input).

R = EP ranks, NC = MAX_CHUNKS + 1 (the counts header: rows per destination in column 0, T in
the last), cap_rows = R * tokens (the room of each buffer, in rows).

Per dispatch (one CUDA graph per bucket of T, as `moekit.dispatch.exchange` does for NCCL;
the graph reads its inputs in place through a pinned args vector):
  1. the plan kernel numbers the tokens per destination and writes the counts into this
     rank's header (symmetric memory); barrier;
  2. one small kernel reads every rank's header (the R x R matrix of rows), decides whether
     every buffer has room (the same verdict on every rank) and works out where this rank's
     rows go in each peer's receive buffer (ranks' rows back to back, in rank order, as the
     NCCL path receives them) and where the results go back; the counts and the verdict are
     copied to the host (the one host read, while the GPU goes on);
  3. the packing kernel writes each (token, destination) row, payload + K ids + K weights,
     into the destination's receive buffer (remote stores over NVLink: packing and transfer
     are one pass); barrier.
Combine: one kernel writes each received row's partial sum into its source rank's return
buffer, at the row the source packed it from; barrier; the source sums its tokens' rows
(gather_reduce), as the NCCL path does.

A batch that does not fit (verdict false: some rank would send or receive more than cap_rows
rows) moves nothing here; the dispatcher then takes the NCCL path for that call (every rank
reaches the same verdict). The buffers are shared by every dispatcher of the process with the
same layout and reused by the next dispatch: combine a dispatch before the next one (checked;
overlapping two batches, dispatch A, dispatch B, combine A, needs normal_transport 'nccl').
Partials return in the tokens' dtype (a runner that returns float32 is rounded there before
the sum; the NCCL path sends its dtype). A rank that does not reach a barrier within WAIT_S
stops the others' kernels (a device trap) instead of hanging them.
Ordering: a rank writes into a peer's buffers only after a barrier that the peer reaches after
its previous use of them (stream order), and reads its own only after the barrier that
follows the writes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.dispatch.exchange import WAIT_S, PackJob, _Replayed, bucket, packable
from moekit.dispatch.layout import MAX_CHUNKS, normal_plan
from moekit.dispatch.slots import SlotMap

NC = MAX_CHUNKS + 1


def p2p_unavailable(group, device: torch.device) -> str | None:
    """Why peer-to-peer normal mode cannot run for this group on this device (None: it can).
    The same answer on every rank of a torchrun launch."""
    if device.type != "cuda":
        return "needs CUDA devices"
    if group is None or dist.get_world_size(group) < 2:
        return "needs an EP group of 2+ ranks"
    if dist.get_backend(group) != "nccl":
        return f"needs an NCCL process group (this one is {dist.get_backend(group)})"
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is None or world != local:
        return ("needs every rank on one host (torchrun's LOCAL_WORLD_SIZE == WORLD_SIZE); "
                f"got WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}")
    R, n = dist.get_world_size(group), torch.cuda.device_count()
    if n < R:
        return (f"needs every rank to see every GPU of the group: {n} visible, {R} ranks "
                "(CUDA_VISIBLE_DEVICES narrowed per process?)")
    me = device.index if device.index is not None else torch.cuda.current_device()
    blocked = [d for d in range(n) if d != me and not torch.cuda.can_device_access_peer(me, d)]
    if blocked:
        return f"needs peer access between the GPUs (NVLink or PCIe P2P); GPU {me} cannot reach {blocked}"
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError as e:
        return f"torch symmetric memory is missing ({e})"
    if not (hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")):
        return f"this torch {torch.__version__} lacks symm_mem.empty / rendezvous"
    return None


_AGREED: dict = {}  # group name -> the group's answer (every dispatcher of a group shares it)


def agreed(group, why: str | None) -> str | None:
    """p2p_unavailable's answer made the same on every rank of the (NCCL) group: one all-reduce
    the first time a group asks (every rank builds its dispatchers in the same order), so that
    no rank takes p2p while another takes NCCL."""
    if group is None or dist.get_world_size(group) < 2 or dist.get_backend(group) != "nccl":
        return why
    if group.group_name in _AGREED:
        return _AGREED[group.group_name]
    ok = torch.tensor([0 if why else 1], dtype=torch.int32,
                      device=torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if why is None and not int(ok.item()):
        why = "another rank of the EP group cannot use it"
    _AGREED[group.group_name] = why
    return why


def _symmetric(nbytes: int, device: torch.device, group) -> tuple[torch.Tensor, object, list]:
    """A uint8 [nbytes] buffer in symmetric memory (collective over `group`) -> (buffer, its
    handle, every rank's address of it)."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(max(nbytes, 16), dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    shift = buf.data_ptr() - handle.buffer_ptrs[handle.rank]
    return buf, handle, [p + shift for p in handle.buffer_ptrs]


class PeerBuffers:
    """One row layout's symmetric buffers on every rank: the counts header [R, NC] int64, the
    receive buffer [cap_rows, row_bytes] uint8 and the return buffer [cap_rows, H] of the
    tokens' dtype, with every rank's addresses of them (int64 [R] on the device). One set per
    (group, device, layout, room) in the process (`shared_buffers`), used by every dispatcher
    (the layers of a model run one after another on one stream); `generation` counts the
    dispatches that used it."""

    def __init__(self, group, device: torch.device, R: int, cap_rows: int, row_bytes: int,
                 hidden: int, dtype: torch.dtype) -> None:
        self.cap_rows, self.row_bytes, self.hidden, self.dtype = cap_rows, row_bytes, hidden, dtype
        self.back_row_bytes = hidden * dtype.itemsize
        hdr, self.handle, hdr_ptrs = _symmetric(R * NC * 8, device, group)
        recv, _, recv_ptrs = _symmetric(cap_rows * row_bytes, device, group)
        back, _, back_ptrs = _symmetric(cap_rows * self.back_row_bytes, device, group)
        self.header = hdr[:R * NC * 8].view(torch.int64).view(R, NC)
        self.recv = recv[:cap_rows * row_bytes].view(cap_rows, row_bytes)
        self.back = back[:cap_rows * self.back_row_bytes].view(dtype).view(cap_rows, hidden)
        self.ptrs = torch.tensor([hdr_ptrs, recv_ptrs, back_ptrs], dtype=torch.int64,
                                 device=device)
        self.generation = 0

    def barrier(self) -> None:
        """Every rank's stream reaches this point before any goes on (device side; a rank
        missing for WAIT_S traps the kernel)."""
        self.handle.barrier(channel=0, timeout_ms=WAIT_S * 1000)


_SHARED: dict = {}


def shared_buffers(group, device, R: int, cap_rows: int, row_bytes: int, hidden: int,
                   dtype: torch.dtype) -> PeerBuffers:
    """The process's PeerBuffers for this group and layout (allocated, collectively, on first
    use: every rank asks for the same ones in the same order)."""
    key = (group.group_name, device, cap_rows, row_bytes, hidden, dtype)
    b = _SHARED.get(key)
    if b is None:
        b = _SHARED[key] = PeerBuffers(group, device, R, cap_rows, row_bytes, hidden, dtype)
    return b


@dataclass(frozen=True)
class ReturnRoute:
    """Where combine sends the received rows back: ret [R] addresses and bounds [R + 1] (see
    launch_p2p_offsets) into `buffers`, for their dispatch number `generation`."""

    ret: torch.Tensor
    bounds: torch.Tensor
    generation: int
    buffers: PeerBuffers


@dataclass
class P2PResult:
    """A peer-to-peer dispatch: counts [2, R, NC] (sent | received, as lists), ok (the rows
    moved; False: nothing moved, take the NCCL path), the receive rows [N, row_bytes] (a view
    of the shared buffer), rows_TR [T, R] (this call's) and the return route."""

    counts: list
    ok: bool
    recv: torch.Tensor | None
    rows_TR: torch.Tensor | None
    route: ReturnRoute | None


@dataclass
class _Graph:
    run: object  # replays (or runs) the steps
    args_np: object  # the pinned args vector the host writes: T, ids, payload, weights, stride, seq
    host: torch.Tensor  # pinned: counts [2 R NC], then dst [R + 1]
    flag: torch.Tensor
    event: torch.cuda.Event
    rows: torch.Tensor  # [Tb, R] int64
    small: torch.Tensor  # device: counts | dst | ret | bounds
    keep: tuple


class P2PExchange:
    """Peer-to-peer normal-mode dispatch and its return trip for a dispatcher (slots, R ranks,
    E local experts, the EP group): buffers with room for `tokens` rows per rank (cap_rows =
    R * tokens), allocated (collectively) on the first call of each row layout.
    use_graphs: replay each bucket of T from a CUDA graph (else run the same steps eagerly)."""

    def __init__(self, slots: SlotMap, R: int, E: int, group, tokens: int,
                 use_graphs: bool = True, max_graphs: int = 32) -> None:
        self.slots, self.R, self.E, self.group = slots, R, E, group
        self.me = dist.get_rank(group)
        self.cap_rows = R * tokens
        self.use_graphs, self.max_graphs = use_graphs, max_graphs
        self._graphs: dict = {}
        self._seq = 0
        self.captures = 0

    def dispatch(self, ids_TK: torch.Tensor, pack: PackJob, hidden: int,
                 dtype: torch.dtype) -> P2PResult:
        """ids_TK [T, K] logical; pack: the payload [T, P] (int32 words: P * itemsize % 4 == 0)
        and weights; hidden / dtype: the return rows. See the module docstring."""
        dev = ids_TK.device
        T, K = ids_TK.shape
        bufs = shared_buffers(self.group, dev, self.R, self.cap_rows, pack.row_bytes, hidden,
                              dtype)
        ids = ids_TK.to(torch.int32).contiguous()
        payload = pack.payload
        if not packable(pack):  # rows must be whole 4-byte words, aligned
            payload = payload.clone(memory_format=torch.contiguous_format)
        weights = pack.weights.contiguous()
        key = (dev, bucket(T), K, pack.payload.dtype, pack.payload.shape[1], pack.row_bytes,
               pack.payload_bytes, pack.E, hidden, dtype)
        g = self._graphs.get(key)
        if g is None:
            g = self._build(bufs, bucket(T), K, pack)
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = g
        self._seq += 1
        bufs.generation += 1
        a = g.args_np
        a[0], a[1], a[2], a[3] = T, ids.data_ptr(), payload.data_ptr(), weights.data_ptr()
        a[4], a[5] = payload.stride(0) * payload.element_size() // 4, self._seq
        g.run()
        g.event.record()
        flat = _Replayed(g.host, g.flag, self._seq, g.event).result()
        R = self.R
        counts = [[flat[(i * R + r) * NC:(i * R + r + 1) * NC] for r in range(R)]
                  for i in range(2)]
        if not flat[2 * R * NC + R]:
            return P2PResult(counts, False, None, None, None)
        n = sum(c[0] for c in counts[1])
        tail = g.small[2 * R * NC + R + 1:].clone()  # ret [R], bounds [R + 1]
        route = ReturnRoute(tail[:R], tail[R:], bufs.generation, bufs)
        return P2PResult(counts, True, bufs.recv[:n], g.rows[:T].clone(), route)

    def combine(self, out_NH: torch.Tensor, route: ReturnRoute, rows_TR: torch.Tensor,
                recv_counts: list[int], impl: str) -> torch.Tensor:
        """out_NH [N, H] partial sums of the received rows (recv_counts [R] from each rank)
        -> [T, H] in the tokens' dtype (T = rows_TR's rows)."""
        from moekit.dispatch._kernels import launch_push_back
        from moekit.dispatch.rows import gather_reduce

        bufs = route.buffers
        if route.generation != bufs.generation:
            raise RuntimeError("p2p normal mode: combine each dispatch before the next one (the "
                               "receive buffers are shared by every dispatcher of this layout); "
                               "this dispatch was overwritten. Overlapping batches need "
                               "normal_transport='nccl'")
        if out_NH.shape[1] != bufs.hidden:
            raise ValueError(f"combine: runner output has {out_NH.shape[1]} columns, the "
                             f"tokens {bufs.hidden}")
        src = out_NH if out_NH.stride(-1) == 1 else out_NH.contiguous()
        launch_push_back(src, route.ret, route.bounds, bufs.back, max(recv_counts))
        bufs.barrier()
        out = torch.empty(rows_TR.shape[0], bufs.hidden, dtype=bufs.dtype, device=out_NH.device)
        if rows_TR.shape[0]:
            gather_reduce(bufs.back, rows_TR, None, bufs.dtype, impl, out=out)
        return out

    def _build(self, bufs: PeerBuffers, Tb: int, K: int, pack: PackJob) -> _Graph:
        """The steps for up to Tb tokens, as a CUDA graph (or a function, without graphs)."""
        from moekit.dispatch._kernels import launch_p2p_offsets, launch_pack_rows

        dev, R = bufs.recv.device, self.R
        args_host = torch.zeros(6, dtype=torch.int64, pin_memory=True)
        args = torch.zeros(6, dtype=torch.int64, device=dev)
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        n_small = 2 * R * NC + (R + 1) + R + (R + 1)
        small = torch.zeros(n_small, dtype=torch.int64, device=dev)
        n_host = 2 * R * NC + R + 1
        host = torch.zeros(n_host, dtype=torch.int64, pin_memory=True)
        counts = small[:2 * R * NC].view(2, R, NC)
        dst = small[2 * R * NC:n_host]
        ret = small[n_host:n_host + R]
        bounds = small[n_host + R:]
        shape_ids = torch.empty(Tb, K, dtype=torch.int32, device=dev)
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)
        rows = torch.empty(Tb, R, dtype=torch.int64, device=dev)
        nw = pack.payload.shape[1] * pack.payload.element_size() // 4
        shape_x = torch.empty(1, nw, dtype=torch.int32, device=dev).expand(Tb, nw)
        shape_w = torch.empty(1, K, dtype=torch.float32, device=dev).expand(Tb, K)
        words = bufs.recv.view(torch.int32)  # [cap_rows, row_bytes / 4]: the row stride
        scratch = torch.zeros(R, NC, dtype=torch.int64, device=dev)
        p = bufs.ptrs

        def steps(header, barrier: bool):
            args.copy_(args_host, non_blocking=True)
            plan = normal_plan(shape_ids, self.slots, R, self.E, 1, "triton",
                               counts_out=header, ticket=ticket, args=args)
            if barrier:
                bufs.barrier()  # every header is written
            launch_p2p_offsets(p[0], p[1], p[2], counts, dst, ret, bounds, self.me,
                               self.cap_rows, bufs.row_bytes, bufs.back_row_bytes)
            host.copy_(small[:n_host], non_blocking=True)
            flag.copy_(args[5:], non_blocking=True)  # after the counts: they have landed
            launch_pack_rows(shape_x, plan.slot, shape_w, plan.local, plan.base, rows, words,
                             words, pack.E, plan.block, 0, Tb, args, dst=dst,
                             meta_words=pack.payload_bytes // 4)
            if barrier:
                bufs.barrier()  # every row has landed

        # compile the kernels outside any capture: T = 0 moves nothing; no barrier, and the
        # counts go to a scratch header (peers may be reading the real one)
        steps(scratch, barrier=False)
        torch.cuda.synchronize(dev)
        if self.use_graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                steps(bufs.header, barrier=True)
            self.captures += 1
            run = graph.replay
            keep = (graph,)
        else:
            def run():
                steps(bufs.header, barrier=True)
            keep = ()
        return _Graph(run, args_host.numpy(), host, flag, torch.cuda.Event(), rows, small,
                      keep + (args, shape_ids, ticket, scratch, shape_x, shape_w))
