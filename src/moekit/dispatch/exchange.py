"""Normal mode's first step: plan the send layout and exchange the counts, then read them on
the host (the one host synchronisation of a normal-mode dispatch).

R = EP ranks, E = local experts per rank, NC = MAX_CHUNKS + 1 (chunk counts, then T).

Three ways (GRAPH_MODES), same result (a NormalPlan, and the counts [2, R, NC]: sent |
received):
  none:  the plan kernel, an async all_to_all_single of the counts, and a copy to pinned host
         memory on a side stream that waits only for the exchange (so the packing kernel the
         caller queues next runs while the host waits);
  plan:  the same three steps replayed from a CUDA graph, one per (bucket of T, chunks), that
         reads T and the ids where the caller has them (see PlanExchange): the host launches
         one graph instead of a kernel, a collective and a copy (some 100 us of host time,
         while the GPU sits idle at the start of a dispatch). T is rounded up to a bucket (4
         per power of two) for the graph's capacity;
  pack:  the graph packs the send rows as well, into a send buffer the graphs of one row
         layout share, in every dispatcher of the process (grown for a larger bucket): the
         host goes from the counts straight to the first all-to-all call.
The first call of a dispatcher is eager (it sets up the communicator the graphs capture).
Measured on 4 x H200 (deepseek-v3, 4096 tokens per rank, one chunk), dispatch + combine over
the raw all-to-all of the same bytes, before the graphs read their inputs in place (they
copied them): none 1.49-1.51, plan 1.36-1.38, pack 1.33-1.37
(benchmarks/results/*_H200x4_deepseek-v3_ep_bench.json).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from moekit.dispatch.layout import MAX_CHUNKS, NormalPlan, blocks_per_chunk, normal_plan
from moekit.dispatch.rows import use_triton
from moekit.dispatch.slots import SlotMap

GRAPH_MODES = ("pack", "plan", "none")  # what normal mode replays from CUDA graphs
WAIT_S = 600  # the longest a rank waits for the others (host spins; p2p device barriers)


def all_to_all(out, inp, group, out_splits=None, in_splits=None, async_op=False):
    """all_to_all_single over `group`; a copy for a group of one rank (None). Returns the
    work handle when async_op."""
    if group is None:
        out.copy_(inp)
        return None
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                  async_op=async_op)


def bucket(T: int) -> int:
    """T rounded up to one of 4 steps per power of two (16 at least): 16, 20, 24, 28, 32,
    40, ... (padding under 25%)."""
    if T <= 16:
        return 16
    step = 1 << max(0, T.bit_length() - 3)
    return -(-T // step) * step


class CountsReader:
    """The host's view of counts [2, R, NC] int64 once the exchange `work` is done. On CUDA a
    side stream (stream, pinned host buffer, event: `side`) waits for the exchange and copies;
    elsewhere result() waits and reads."""

    def __init__(self, counts: torch.Tensor, work, side) -> None:
        self.counts, self.work, self.event, self.host = counts, work, None, None
        if side is None:
            return
        stream, self.host, self.event = side
        stream.wait_stream(torch.cuda.current_stream(counts.device))  # the plan wrote counts
        with torch.cuda.stream(stream):
            if work is not None:
                work.wait()  # the side stream waits for the exchange
            self.host.copy_(counts, non_blocking=True)
            self.event.record(stream)

    def result(self) -> list:
        if self.event is None:
            if self.work is not None:
                self.work.wait()
            return self.counts.tolist()
        self.event.synchronize()
        return self.host.tolist()


class _Replayed:
    """CountsReader of a graph replay: the graph copies the counts to the pinned `host`, then
    the call's sequence number to the pinned `flag`; the host spins on the flag (it need not
    wait for the rest of the graph, the packing)."""

    def __init__(self, host: torch.Tensor, flag: torch.Tensor, seq: int, event) -> None:
        self.host, self.flag, self.seq, self.event = host, flag, seq, event

    def result(self) -> list:
        flag = self.flag.numpy()
        deadline = time.monotonic() + WAIT_S
        while flag[0] != self.seq:
            if self.event.query() and flag[0] != self.seq:
                raise RuntimeError("normal-mode plan graph finished without its counts")
            if time.monotonic() > deadline:
                raise RuntimeError(f"normal mode: no counts after {WAIT_S} s (a rank of the EP "
                                   "group did not reach this dispatch)")
        return self.host.tolist()


@dataclass(frozen=True)
class PackJob:
    """What the packing kernel needs (see layout.pack_rows): payload [T, P] rows (x, or its fp8
    bytes), weights [T, K] float32, E local experts, and the packed row: payload_bytes, then
    8K bytes of ids and weights, row_bytes in all."""

    payload: torch.Tensor
    weights: torch.Tensor
    E: int
    payload_bytes: int
    row_bytes: int

    def views(self, send: torch.Tensor):
        """(payload view [N, P] in the payload dtype, meta view [N, 2K] int32) of send rows."""
        P = self.payload.shape[1]
        width = P * self.payload.element_size()
        return (send[:, :width].view(self.payload.dtype),
                send[:, self.payload_bytes:].view(torch.int32))


def packable(pack: PackJob) -> bool:
    """Payload rows in whole 4-byte words at 4-byte aligned addresses (what the packing
    kernels read in place from a graph)."""
    p = pack.payload
    nbytes, es = p.shape[1] * p.element_size(), p.element_size()
    return (p.stride(1) == 1 and nbytes % 4 == 0 and (p.stride(0) * es) % 4 == 0
            and p.data_ptr() % 4 == 0)


@dataclass
class Prepared:
    """A normal-mode dispatch after the plan: the plan, the counts reader and, when the graph
    packed the rows too, the send buffer [>= T * R, row_bytes] uint8 and rows_TR [T, R] (both
    the graph's: the next replay overwrites them)."""

    plan: NormalPlan
    reader: object
    send: torch.Tensor | None = None
    rows_TR: torch.Tensor | None = None


@dataclass
class _Stage:
    """The send buffer the packing graphs of one row layout share, in every dispatcher of the
    process (the layers of a model run one after another on one stream, and each all-to-all
    has read it before the stream goes on): room for `tokens` tokens."""

    tokens: int
    send: torch.Tensor  # [tokens * R, row_bytes] uint8
    rows: torch.Tensor  # [tokens, R] int64


_STAGES: dict = {}  # (device, R, payload layout) -> the _Stage of every PlanExchange
_EXCHANGES: weakref.WeakSet = weakref.WeakSet()  # live PlanExchanges (to drop stale graphs)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    args: torch.Tensor  # [6] int64 pinned: T, ids, payload, weights addresses, row stride, seq
    plan: NormalPlan  # the graph's outputs (static buffers, capacity Tb)
    host: torch.Tensor  # [2, R, NC] int64 pinned
    flag: torch.Tensor  # [1] int64 pinned: the seq of the last replay whose counts landed
    event: torch.cuda.Event
    buffers: tuple  # every other tensor the graph reads or writes, kept alive with it
    stage: _Stage | None = None  # packing graphs: the shared send buffer

    def __post_init__(self) -> None:
        self.args_np = self.args.numpy()  # the host writes through this view


class PlanExchange:
    """Plans and exchanges the counts for a dispatcher (slots, R ranks, E local experts, the
    EP group). `use_graphs`: replay CUDA graphs on CUDA with a group and the Triton plan kernel
    (after one eager call has set up the communicator); `max_graphs` bounds the cache (oldest
    dropped).

    A graph reads its inputs where the caller has them: before each replay the host writes
    [T, address of ids, of the payload, of the weights, payload row stride in 4-byte words,
    call number] into a pinned vector, which the graph's first node copies to the device; the
    kernels read T and the addresses from there (their INDIRECT mode). So a replay costs the
    host a few scalar writes and one graph launch, and the GPU no copy of the inputs. Node
    order: args, plan, counts exchange, counts to the host, call number to the host, packing:
    the host reads the counts (spinning on the call number) while the GPU still packs. The
    ids must be int32 and the weights float32, both contiguous (converted otherwise); packing
    graphs need payload rows in whole 4-byte words (else that call packs eagerly)."""

    def __init__(self, slots: SlotMap, R: int, E: int, group, use_graphs: bool = True,
                 max_graphs: int = 32) -> None:
        self.slots, self.R, self.E, self.group = slots, R, E, group
        self.use_graphs, self.max_graphs = use_graphs, max_graphs
        self._graphs: dict = {}
        self._tickets: dict = {}
        self._sides: dict = {}
        self._eager_calls = 0
        self._seq = 0
        self.captures = 0  # graphs captured so far (for tests and logs)
        _EXCHANGES.add(self)

    def _graphed(self, ids_TK: torch.Tensor, impl: str) -> bool:
        return (self.use_graphs and self.group is not None and self._eager_calls > 0
                and use_triton(ids_TK, impl) and ids_TK.shape[1] > 0
                and not torch.cuda.is_current_stream_capturing())

    def __call__(self, ids_TK: torch.Tensor, num_chunks: int, impl: str = "auto",
                 pack: PackJob | None = None) -> Prepared:
        """ids_TK [T, K] logical -> Prepared: the NormalPlan over the first T tokens and the
        counts reader; with `pack` under graphs (when its rows allow), the graph packs the
        rows too."""
        if not self._graphed(ids_TK, impl):
            return self._eager(ids_TK, num_chunks, impl)
        if pack is not None and not packable(pack):
            pack = None
        dev = ids_TK.device
        T, K = ids_TK.shape
        ids = ids_TK if ids_TK.dtype == torch.int32 else ids_TK.to(torch.int32)
        if not ids.is_contiguous():
            ids = ids.contiguous()
        Tb = bucket(T)
        layout = None if pack is None else (pack.payload.dtype, pack.payload.shape[1],
                                            pack.row_bytes, pack.payload_bytes, pack.E)
        key = (dev, Tb, K, num_chunks, layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(dev, Tb, K, num_chunks, pack, layout)
        self._seq += 1
        a = g.args_np
        a[0], a[1], a[5] = T, ids.data_ptr(), self._seq
        if pack is not None:
            weights = pack.weights
            if not weights.is_contiguous():
                weights = weights.contiguous()
            a[2], a[3] = pack.payload.data_ptr(), weights.data_ptr()
            a[4] = pack.payload.stride(0) * pack.payload.element_size() // 4
        g.graph.replay()
        g.event.record()
        # the plan of the first T tokens; chunks of the size the kernel used for this T
        plan = replace(g.plan.first(T),
                       blocks_per_chunk=blocks_per_chunk(T, g.plan.block, num_chunks))
        reader = _Replayed(g.host, g.flag, self._seq, g.event)
        if g.stage is None:
            return Prepared(plan, reader)
        return Prepared(plan, reader, g.stage.send, g.stage.rows[:T])

    def _eager(self, ids_TK: torch.Tensor, num_chunks: int, impl: str):
        dev, R = ids_TK.device, self.R
        self._eager_calls += 1
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        plan = normal_plan(ids_TK, self.slots, R, self.E, num_chunks, impl,
                           counts_out=counts[0], ticket=self._ticket(dev))
        work = all_to_all(counts[1], counts[0], self.group, async_op=True)
        return Prepared(plan, CountsReader(counts, work, self._side(dev)))

    def _stage(self, dev: torch.device, Tb: int, pack: PackJob, layout) -> _Stage:
        """The process's send buffer for this layout with room for Tb tokens (grown when Tb
        does not fit; then every exchange drops its graphs that used the old one)."""
        key = (dev, self.R, layout)
        st = _STAGES.get(key)
        if st is not None and st.tokens >= Tb:
            return st
        if st is not None:
            for ex in list(_EXCHANGES):
                for k in [k for k, g in ex._graphs.items() if g.stage is st]:
                    del ex._graphs[k]
        st = _Stage(Tb, torch.empty(Tb * self.R, pack.row_bytes, dtype=torch.uint8, device=dev),
                    torch.empty(Tb, self.R, dtype=torch.int64, device=dev))
        _STAGES[key] = st
        return st

    def _capture(self, dev: torch.device, Tb: int, K: int, num_chunks: int,
                 pack: PackJob | None, layout) -> _Graph:
        from moekit.dispatch._kernels import launch_pack_rows

        R = self.R
        stage = None if pack is None else self._stage(dev, Tb, pack, layout)
        args_host = torch.zeros(6, dtype=torch.int64, pin_memory=True)
        args = torch.zeros(6, dtype=torch.int64, device=dev)
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        shape_ids = torch.empty(Tb, K, dtype=torch.int32, device=dev)  # capacity and K only
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        host = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, pin_memory=True)
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)
        if stage is not None:
            nw = pack.payload.shape[1] * pack.payload.element_size() // 4
            shape_x = torch.empty(1, nw, dtype=torch.int32, device=dev).expand(Tb, nw)
            shape_w = torch.empty(1, K, dtype=torch.float32, device=dev).expand(Tb, K)
            send = stage.send[:Tb * R]
            send_words = send[:, :nw * 4].view(torch.int32)
            meta = send[:, pack.payload_bytes:].view(torch.int32)

        def plan_step():
            args.copy_(args_host, non_blocking=True)
            return normal_plan(shape_ids, self.slots, R, self.E, num_chunks, "triton",
                               counts_out=counts[0], ticket=ticket, args=args)

        def pack_step(plan):  # every token of the capacity: those past T do nothing
            launch_pack_rows(shape_x, plan.slot, shape_w, plan.local, plan.base, stage.rows,
                             send_words, meta, pack.E, plan.block, 0, Tb, args)

        # compile the kernels for these shapes outside the capture (T = 0: nothing moves)
        plan = plan_step()
        if stage is not None:
            pack_step(plan)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan = plan_step()
            all_to_all(counts[1], counts[0], self.group)
            host.copy_(counts, non_blocking=True)
            flag.copy_(args[5:], non_blocking=True)  # after the counts: they have landed
            if stage is not None:
                pack_step(plan)
        self.captures += 1
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        g = _Graph(graph, args_host, plan, host, flag, torch.cuda.Event(),
                   (args, shape_ids, counts, ticket), stage)
        self._graphs[(dev, Tb, K, num_chunks, layout)] = g
        return g

    def _ticket(self, device: torch.device) -> torch.Tensor | None:
        """The eager plan kernel's zeroed counter on `device` (kept zeroed by the kernel)."""
        if device.type != "cuda":
            return None
        t = self._tickets.get(device)
        if t is None:
            t = self._tickets[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return t

    def _side(self, device: torch.device):
        """(side stream, pinned host buffer, event) for reading the counts; None off CUDA."""
        if device.type != "cuda":
            return None
        s = self._sides.get(device)
        if s is None:
            s = self._sides[device] = (
                torch.cuda.Stream(device),
                torch.empty(2, self.R, MAX_CHUNKS + 1, dtype=torch.int64, pin_memory=True),
                torch.cuda.Event(),
            )
        return s
