"""Normal mode's first step: plan the send layout and exchange the counts, then read them on
the host (the one host synchronisation of a normal-mode dispatch).

R = EP ranks, E = local experts per rank, NC = MAX_CHUNKS + 1 (chunk counts, then T).

Three ways (GRAPH_MODES), same result (a NormalPlan, and the counts [2, R, NC]: sent |
received):
  none:  the plan kernel, an async all_to_all_single of the counts, and a copy to pinned host
         memory on a side stream that waits only for the exchange (so the packing kernel the
         caller queues next runs while the host waits);
  plan:  the same three steps replayed from a CUDA graph, one per (bucket of T, chunks): the
         host launches one graph instead of a kernel, a collective and a copy (some 100 us of
         host time, while the GPU sits idle at the start of a dispatch). T is rounded up to a
         bucket (4 per power of two); the padding tokens carry id -1 and go nowhere. The
         padded T is what the counts report, so every rank derives the number of chunks from
         the same numbers;
  pack:  the graph packs the send rows as well, from copies of x and the weights in buffers
         the graphs of one row layout share (grown for a larger bucket): the host then goes
         from the counts straight to the first all-to-all call. Costs one copy of x on the GPU
         (about 30 us for 4096 x 7168 bf16), saves the packing kernel's launch on the host.
The first call of a dispatcher is eager (it sets up the communicator the graphs capture).
Measured on 4 x H200 (deepseek-v3, 4096 tokens per rank, one chunk), dispatch + combine over
the raw all-to-all of the same bytes: none 1.49-1.51, plan 1.36-1.38, pack 1.33-1.37
(benchmarks/results/*_H200x4_deepseek-v3_ep_bench.json). 'plan' is the default: nearly as
fast, without the copy of x and the shared buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.dispatch.layout import MAX_CHUNKS, NormalPlan, normal_plan
from moekit.dispatch.rows import _use_triton
from moekit.dispatch.slots import SlotMap

GRAPH_MODES = ("plan", "pack", "none")  # what normal mode replays from CUDA graphs


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
    """CountsReader of a graph replay: the event recorded after it, the pinned buffer."""

    def __init__(self, host: torch.Tensor, event) -> None:
        self.host, self.event = host, event

    def result(self) -> list:
        self.event.synchronize()
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


@dataclass
class Prepared:
    """A normal-mode dispatch after the plan: the plan, the counts reader and, when the graph
    packed the rows too, the send buffer [>= T * R, row_bytes] uint8 and rows_TR [T, R]."""

    plan: NormalPlan
    reader: object
    send: torch.Tensor | None = None
    rows_TR: torch.Tensor | None = None


@dataclass
class _Stage:
    """Inputs and send buffer the packing graphs share (one set per payload layout): room for
    `tokens` tokens."""

    tokens: int
    x: torch.Tensor  # [tokens, P]
    weights: torch.Tensor  # [tokens, K] float32
    send: torch.Tensor  # [tokens * R, row_bytes] uint8
    rows: torch.Tensor  # [tokens, R] int64


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [Tb, K] int32, the graph's input (tail rows -1)
    plan: NormalPlan  # the graph's outputs (static buffers)
    host: torch.Tensor  # [2, R, NC] int64 pinned
    event: torch.cuda.Event
    last_T: int  # rows of ids the previous replay filled (the rest are -1)
    buffers: tuple  # every other tensor the graph reads or writes, kept alive with it
    stage: _Stage | None = None  # packing graphs: the shared inputs and send buffer


class PlanExchange:
    """Plans and exchanges the counts for a dispatcher (slots, R ranks, E local experts, the
    EP group). `use_graphs`: replay CUDA graphs on CUDA with a group and the Triton plan kernel
    (after one eager call has set up the communicator); `max_graphs` bounds the cache (oldest
    dropped)."""

    def __init__(self, slots: SlotMap, R: int, E: int, group, use_graphs: bool = True,
                 max_graphs: int = 32) -> None:
        self.slots, self.R, self.E, self.group = slots, R, E, group
        self.use_graphs, self.max_graphs = use_graphs, max_graphs
        self._graphs: dict = {}
        self._stages: dict = {}  # (device, payload layout) -> _Stage
        self._tickets: dict = {}
        self._sides: dict = {}
        self._eager_calls = 0
        self.captures = 0  # graphs captured so far (for tests and logs)

    def reset(self, slots: SlotMap) -> None:
        """A new placement: the graphs read the old slot table, drop them."""
        self.slots = slots
        self._graphs.clear()
        self._stages.clear()

    def planned_tokens(self, ids_TK: torch.Tensor, impl: str) -> int:
        """The T the plan covers (and the counts report): T, or its bucket under graphs."""
        T = ids_TK.shape[0]
        return bucket(T) if self._graphed(ids_TK, impl) else T

    def _graphed(self, ids_TK: torch.Tensor, impl: str) -> bool:
        return (self.use_graphs and self.group is not None and self._eager_calls > 0
                and _use_triton(ids_TK, impl) and ids_TK.shape[1] > 0
                and not torch.cuda.is_current_stream_capturing())

    def __call__(self, ids_TK: torch.Tensor, num_chunks: int, impl: str = "auto",
                 pack: PackJob | None = None) -> Prepared:
        """ids_TK [T, K] logical -> Prepared: the NormalPlan over the first T tokens and the
        counts reader; with `pack` under graphs, the graph packs the rows too (the inputs are
        copied into its buffers first)."""
        if not self._graphed(ids_TK, impl):
            return self._eager(ids_TK, num_chunks, impl)
        dev = ids_TK.device
        T, K = ids_TK.shape
        Tb = bucket(T)
        layout = None if pack is None else (pack.payload.dtype, pack.payload.shape[1],
                                            pack.row_bytes, pack.payload_bytes, pack.E)
        key = (dev, Tb, K, num_chunks, layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(dev, Tb, K, num_chunks, pack, layout)
        if T < g.last_T:
            g.ids[T:g.last_T].fill_(-1)
        g.ids[:T].copy_(ids_TK)
        g.last_T = T
        if g.stage is not None:
            g.stage.x[:T].copy_(pack.payload)
            g.stage.weights[:T].copy_(pack.weights)
        g.graph.replay()
        g.event.record()
        reader = _Replayed(g.host, g.event)
        if g.stage is None:
            return Prepared(g.plan.first(T), reader)
        # rows_TR outlives this dispatch (the combine reads it): a copy of the graph's
        return Prepared(g.plan.first(T), reader, g.stage.send, g.stage.rows[:T].clone())

    def _eager(self, ids_TK: torch.Tensor, num_chunks: int, impl: str):
        dev, R = ids_TK.device, self.R
        self._eager_calls += 1
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        plan = normal_plan(ids_TK, self.slots, R, self.E, num_chunks, impl,
                           counts_out=counts[0], ticket=self._ticket(dev))
        work = all_to_all(counts[1], counts[0], self.group, async_op=True)
        return Prepared(plan, CountsReader(counts, work, self._side(dev)))

    def _stage(self, dev: torch.device, Tb: int, pack: PackJob, layout) -> _Stage:
        """The shared packing buffers for this layout with room for Tb tokens (grown, and the
        graphs that used the old ones dropped, when Tb does not fit)."""
        st = self._stages.get((dev, layout))
        if st is not None and st.tokens >= Tb:
            return st
        for k in [k for k, g in self._graphs.items() if g.stage is st and st is not None]:
            del self._graphs[k]
        P, K = pack.payload.shape[1], pack.weights.shape[1]
        st = _Stage(Tb, torch.zeros(Tb, P, dtype=pack.payload.dtype, device=dev),
                    torch.zeros(Tb, K, dtype=torch.float32, device=dev),
                    torch.empty(Tb * self.R, pack.row_bytes, dtype=torch.uint8, device=dev),
                    torch.empty(Tb, self.R, dtype=torch.int64, device=dev))
        self._stages[(dev, layout)] = st
        return st

    def _capture(self, dev: torch.device, Tb: int, K: int, num_chunks: int,
                 pack: PackJob | None, layout) -> _Graph:
        from moekit.dispatch.layout import pack_rows

        R = self.R
        stage = None if pack is None else self._stage(dev, Tb, pack, layout)
        ids = torch.full((Tb, K), -1, dtype=torch.int32, device=dev)
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        host = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, pin_memory=True)
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)

        def plan_step():
            return normal_plan(ids, self.slots, R, self.E, num_chunks, "triton",
                               counts_out=counts[0], ticket=ticket)

        def pack_step(plan):  # every token of the bucket: the padding ones go nowhere
            send_x, meta = PackJob(stage.x[:Tb], stage.weights[:Tb], pack.E,
                                   pack.payload_bytes, pack.row_bytes).views(stage.send)
            pack_rows(stage.x[:Tb], plan, stage.weights[:Tb], pack.E, send_x, meta,
                      stage.rows[:Tb], None, "triton")

        # compile the kernels for these shapes outside the capture (no collective here)
        plan = plan_step()
        if stage is not None:
            pack_step(plan)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan = plan_step()
            all_to_all(counts[1], counts[0], self.group)
            host.copy_(counts, non_blocking=True)
            if stage is not None:
                pack_step(plan)
        self.captures += 1
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        g = _Graph(graph, ids, plan, host, torch.cuda.Event(), 0, (counts, ticket), stage)
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
