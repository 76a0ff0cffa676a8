"""Normal mode's first step: plan the send layout and exchange the counts, then read them on
the host (the one host synchronisation of a normal-mode dispatch).

R = EP ranks, E = local experts per rank, NC = MAX_CHUNKS + 1 (chunk counts, then T).

Two ways, same result (a NormalPlan, and the counts [2, R, NC]: sent | received):
  eager: the plan kernel, an async all_to_all_single of the counts, and a copy to pinned host
         memory on a side stream that waits only for the exchange (so the packing kernel the
         caller queues next runs while the host waits);
  graph: the same three steps replayed from a CUDA graph, one per (bucket of T, chunks): the
         host launches one graph instead of a kernel, a collective and a copy (together some
         100 us of host time, while the GPU sits idle at the start of a dispatch). T is
         rounded up to a bucket (4 per power of two); the padding tokens carry id -1 and go
         nowhere. The padded T is what the counts report, so every rank derives the number of
         chunks from the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.dispatch.layout import MAX_CHUNKS, NormalPlan, normal_plan
from moekit.dispatch.rows import _use_triton
from moekit.dispatch.slots import SlotMap


def _all_to_all(out, inp, group, out_splits=None, in_splits=None, async_op=False):
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


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [Tb, K] int32, the graph's input (tail rows -1)
    plan: NormalPlan  # the graph's outputs (static buffers)
    host: torch.Tensor  # [2, R, NC] int64 pinned
    event: torch.cuda.Event
    last_T: int  # rows of ids the previous replay filled (the rest are -1)


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
        self._tickets: dict = {}
        self._sides: dict = {}
        self._eager_calls = 0

    def reset(self, slots: SlotMap) -> None:
        """A new placement: the graphs read the old slot table, drop them."""
        self.slots = slots
        self._graphs.clear()

    def planned_tokens(self, ids_TK: torch.Tensor, impl: str) -> int:
        """The T the plan covers (and the counts report): T, or its bucket under graphs."""
        T = ids_TK.shape[0]
        return bucket(T) if self._graphed(ids_TK, impl) else T

    def _graphed(self, ids_TK: torch.Tensor, impl: str) -> bool:
        return (self.use_graphs and self.group is not None and self._eager_calls > 0
                and _use_triton(ids_TK, impl) and ids_TK.shape[1] > 0
                and not torch.cuda.is_current_stream_capturing())

    def __call__(self, ids_TK: torch.Tensor, num_chunks: int, impl: str = "auto"):
        """ids_TK [T, K] logical -> (NormalPlan over the first T tokens, reader of counts)."""
        if not self._graphed(ids_TK, impl):
            return self._eager(ids_TK, num_chunks, impl)
        dev = ids_TK.device
        T, K = ids_TK.shape
        Tb = bucket(T)
        key = (dev, Tb, K, num_chunks)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(dev, Tb, K, num_chunks)
        if T < g.last_T:
            g.ids[T:g.last_T].fill_(-1)
        g.ids[:T].copy_(ids_TK)
        g.last_T = T
        g.graph.replay()
        g.event.record()
        return g.plan.first(T), _Replayed(g.host, g.event)

    def _eager(self, ids_TK: torch.Tensor, num_chunks: int, impl: str):
        dev, R = ids_TK.device, self.R
        self._eager_calls += 1
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        plan = normal_plan(ids_TK, self.slots, R, self.E, num_chunks, impl,
                           counts_out=counts[0], ticket=self._ticket(dev))
        work = _all_to_all(counts[1], counts[0], self.group, async_op=True)
        return plan, CountsReader(counts, work, self._side(dev))

    def _capture(self, dev: torch.device, Tb: int, K: int, num_chunks: int) -> _Graph:
        R = self.R
        ids = torch.full((Tb, K), -1, dtype=torch.int32, device=dev)
        counts = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, device=dev)
        host = torch.empty(2, R, MAX_CHUNKS + 1, dtype=torch.int64, pin_memory=True)
        ticket = torch.zeros(1, dtype=torch.int32, device=dev)

        def step():
            plan = normal_plan(ids, self.slots, R, self.E, num_chunks, "triton",
                               counts_out=counts[0], ticket=ticket)
            _all_to_all(counts[1], counts[0], self.group)
            host.copy_(counts, non_blocking=True)
            return plan

        # compile the plan kernel for this shape outside the capture (no collective here)
        normal_plan(ids, self.slots, R, self.E, num_chunks, "triton", counts_out=counts[0],
                    ticket=ticket)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan = step()
        if len(self._graphs) >= self.max_graphs:
            self._graphs.pop(next(iter(self._graphs)))
        g = _Graph(graph, ids, plan, host, torch.cuda.Event(), 0)
        self._graphs[(dev, Tb, K, num_chunks)] = g
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
