"""Dispatcher `alltoall`: expert parallelism over torch.distributed `all_to_all_single` (NCCL on
GPU, gloo on CPU), with the serving engines' `--deepep-mode`s; within one host, normal mode
writes the rows over NVLink instead (normal_transport 'p2p', `moekit.dispatch.p2p`: PyTorch's
symmetric memory, our kernels). Not DeepEP: no NVSHMEM.

Each rank dispatches its own tokens (x [T, H], topk with logical ids) to the EP ranks that hold
their experts and gets the results back in combine. R = EP ranks, E = experts per rank (local
slots), K = top-k, C = --max-dispatch-tokens-per-rank.

normal (prefill, throughput; variable sizes, one host synchronisation):
  1. one plan kernel numbers the tokens per destination rank, in chunks of tokens
     (normal_chunks, default 1; None: one per NORMAL_CHUNK_BYTES of payload); the
     per-(rank, chunk) counts and T are exchanged (one all_to_all_single of R * 5 int64) and
     copied to the host; by default these steps and the packing below are one CUDA graph
     replay (`moekit.dispatch.exchange`: the host time of the launches was most of the
     overhead);
  2. each token is sent once per destination rank (not once per expert), as one packed row:
     its payload (H values of x's dtype, exactly what a raw all-to-all of the tokens moves;
     fp8: the fp8 row and its scales), then its K local ids there (-1 for experts elsewhere)
     and K top-k weights (8K bytes). One all_to_all_single per chunk; chunk c+1 is packed
     while chunk c travels. The split sizes are the one host read; every rank derives the
     number of calls from every rank's T, so the group agrees. Measured on 4 x H200 at 4096
     tokens per rank (59 MB of payload): one chunk is fastest (each extra call costs more
     than the packing and summing it overlaps), hence the default;
  3. the runner gets the standard format: received rows [N, H] (rows of the receive buffer,
     unit last stride) ordered by chunk, source rank, then token, with local ids; it applies
     the weights and sums over its local experts;
  4. combine sends each row's partial sum back, one call per chunk, and adds a token's
     partials (float32 sum) chunk by chunk as the calls land.
  normal_transport (default 'auto'): 'p2p' where it can run (CUDA, an NCCL group of ranks on
  one host): the same rows, layout and handle, but the plan, the counts and the packing
  happen on the device, each row written straight into its destination's receive buffer in
  symmetric memory, so the rows do not wait for the host and no collective is launched; a
  call in which some rank would send or receive more than R * p2p_tokens rows takes the
  NCCL path. Measured on 4 x H200 (deepseek-v3, 4096 tokens per rank, bf16): dispatch +
  combine 1.04-1.10 x the raw NCCL all-to-all of the same bytes over four runs, against
  1.19-1.31 x for the NCCL path in the same runs
  (benchmarks/results/20261122T00*_H200x4_deepseek-v3_ep_bench*.json).

low_latency (decode; fixed shapes, no host synchronisation, CUDA-graph capturable):
  every rank sends a fixed [R, C] block of rows (unused rows ignored); the receiver lays them out
  masked, x [E, R * C, H] + counts [E] (the worst case: every token of every rank picks the same
  local expert, as DeepEP low-latency sizes it), rows ordered by source rank, then token. The
  runner returns unweighted outputs; combine applies the top-k weights on the expert side, sends
  one row per (source token, rank) back, and sums them. The layout metadata is built by two
  fused Triton kernels on CUDA (`moekit.dispatch.layout`), so dispatch is a handful of kernels
  and one collective; combine is two gathers and one collective. The ids of one token must be
  distinct (as top-k gives them): the per-expert capacity counts each token once.
  A batch over capacity (T > C) is never truncated: it raises `CapacityError` before any
  communication. Every rank of the group must stay within C (the raise happens only on the
  ranks over it; the others would wait in the collective), so bound decode batches or use auto.

auto: low_latency when every rank of the group has at most C tokens, else normal. The ranks
  agree through an all-reduce of max T (one tiny collective and a host read); while a CUDA graph
  is being captured the local T decides (capture the same batch size on every rank).

fp8_dispatch: the token rows travel as float8_e4m3fn with one float32 scale per 128 columns
  (about half the bytes of bf16); the receiver dequantizes to the input dtype for the runner.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.config import DEEPEP_MODES, ConfigError, ParallelConfig, check_choice
from moekit.dispatch.base import Dispatcher
from moekit.dispatch.exchange import GRAPH_MODES, PackJob, PlanExchange, all_to_all
from moekit.dispatch.layout import MAX_CHUNKS, pack_rows, recv_plan, send_plan
from moekit.dispatch.p2p import P2PExchange, agreed, p2p_unavailable
from moekit.dispatch.rows import gather_reduce, scatter_rows, use_triton
from moekit.dispatch.slots import SlotMap
from moekit.hardware import Availability, Platform
from moekit.log import log_once
from moekit.placement import ExpertPlacement
from moekit.router import TopKOutput
from moekit.stages import (
    MaskedDispatchOutput,
    MaskedRunnerOutput,
    StandardDispatchOutput,
    StandardRunnerOutput,
)

NORMAL, LOW_LATENCY, AUTO = "normal", "low_latency", "auto"
TRANSPORTS = ("nccl", "p2p", "auto")  # normal mode's transport (see the module docstring)
FP8_GROUP = 128
NORMAL_CHUNK_BYTES = 24 << 20  # normal_chunks=None: one all-to-all call per this much payload
NEEDS_DIST = (
    "needs torch.distributed initialised with several processes (launch with torchrun and "
    "call moekit.parallel.init_parallel)"
)


class CapacityError(ValueError):
    """A low-latency batch holds more tokens than --max-dispatch-tokens-per-rank."""


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class RowLayout:
    """Bytes of one packed token row: x (H values in `dtype`, or H fp8 bytes then ceil(H/128)
    float32 scales), then K int32 local ids and K float32 weights when top_k > 0."""

    hidden: int
    dtype: torch.dtype
    top_k: int = 0
    fp8: bool = False

    @property
    def num_groups(self) -> int:
        return -(-self.hidden // FP8_GROUP) if self.fp8 else 0

    @property
    def payload_bytes(self) -> int:
        """x (and scales): the part a token carries whatever its destination."""
        if self.fp8:
            return _align(self.hidden, 4) + 4 * self.num_groups
        return _align(self.hidden * self.dtype.itemsize, 4)

    @property
    def row_bytes(self) -> int:
        return self.payload_bytes + 8 * self.top_k

    def payload_view(self, buf: torch.Tensor) -> torch.Tensor:
        """[N, H] in dtype (plain) or [N, payload_bytes] uint8 (fp8) view of buf [N, row_bytes]."""
        if self.fp8:
            return buf[:, : self.payload_bytes]
        return buf[:, : self.hidden * self.dtype.itemsize].view(self.dtype)

    def meta_views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [N, K] int32, weights [N, K] float32) views of buf."""
        p, K = self.payload_bytes, self.top_k
        return buf[:, p : p + 4 * K].view(torch.int32), buf[:, p + 4 * K :].view(torch.float32)

    def pack_tokens(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The per-token payload: x itself, or [T, payload_bytes] uint8 of fp8 x + scales."""
        if not self.fp8:
            return x_TH
        q, s = _quantize_fp8(x_TH)
        T = x_TH.shape[0]
        out = torch.zeros(T, self.payload_bytes, dtype=torch.uint8, device=x_TH.device)
        out[:, : self.hidden] = q.view(torch.uint8)
        out[:, _align(self.hidden, 4) :] = s.contiguous().view(torch.uint8)
        return out

    def unpack_tokens(self, payload: torch.Tensor) -> torch.Tensor:
        """Payload rows (a view of received rows) -> x [N, H] in dtype."""
        if not self.fp8:
            return payload
        from moekit.quant.act_quant import dequantize_act

        q = payload[:, : self.hidden].contiguous().view(torch.float8_e4m3fn)
        s = payload[:, _align(self.hidden, 4) :].contiguous().view(torch.float32)
        return dequantize_act(q, s, "token_group", group_size=FP8_GROUP).to(self.dtype)

    def unpack_scatter(self, payload: torch.Tensor, dest_NK: torch.Tensor, num_rows: int,
                       impl: str = "auto") -> torch.Tensor:
        """out [num_rows, H] in dtype with out[dest[n, k]] = unpacked payload row n (rows nobody
        writes are undefined). fp8 with Triton: one kernel dequantizes from the (strided)
        payload rows straight into their destinations; otherwise unpack, then scatter_rows."""
        if not (self.fp8 and use_triton(payload, impl)):
            return scatter_rows(self.unpack_tokens(payload), dest_NK, num_rows, impl)
        from moekit.dispatch._kernels import launch_dequant_scatter

        out = torch.empty(num_rows, self.hidden, dtype=self.dtype, device=payload.device)
        if payload.shape[0] == 0 or num_rows == 0 or self.hidden == 0:
            return out
        if payload.stride(1) != 1 or payload.stride(0) % 4 or payload.data_ptr() % 4:
            raise ValueError("unpack_scatter: fp8 payload rows must be 4-byte aligned")
        words = payload.view(torch.float32)  # [N, payload_bytes / 4]
        scales = words[:, _align(self.hidden, 4) // 4:]
        launch_dequant_scatter(payload, scales, dest_NK.contiguous(), out, FP8_GROUP)
        return out


def _quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32)."""
    from moekit.quant.act_quant import quantize_act, quantize_act_ref

    if x_TH.is_cuda:
        try:
            return quantize_act(x_TH, "token_group", torch.float8_e4m3fn, group_size=FP8_GROUP)
        except ImportError:
            pass
    return quantize_act_ref(x_TH, "token_group", torch.float8_e4m3fn, group_size=FP8_GROUP)


def _wait(works) -> None:
    """The current stream waits for these all_to_all_single works (None: a local copy)."""
    for w in works:
        if w is not None:
            w.wait()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class Phases:
    """Per-phase timing of normal-mode dispatch / combine (for benchmarks): `begin()` at the
    start of a call, `mark(name)` at the end of each phase; CUDA events on the current stream
    (host clock on CPU), and the host clock alongside (when the host got there: on an idle GPU
    the events follow the host). A phase that ends in a host read (count_sync) also holds the
    wait for the work queued before it. `durations()` -> {name: [ms, ...]} (synchronises);
    `host_durations()` -> the same from the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[str, object, object, float, float]] = []
        self._last = None
        self._last_host = 0.0

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self) -> None:
        self._last = self._now()
        self._last_host = time.perf_counter()

    def mark(self, name: str) -> None:
        now = self._now()
        host = time.perf_counter()
        self._pairs.append((name, self._last, now, self._last_host, host))
        self._last, self._last_host = now, host

    def reset(self) -> None:
        self._pairs.clear()

    def durations(self) -> dict[str, list[float]]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for name, a, b, _, _ in self._pairs:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
            out.setdefault(name, []).append(ms)
        return out

    def host_durations(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for name, _, _, a, b in self._pairs:
            out.setdefault(name, []).append((b - a) * 1e3)
        return out


@dataclass(frozen=True)
class NormalHandle:
    """Metadata for the return trip of a normal-mode dispatch.

    send_splits / recv_splits [calls][R]: rows sent to / received from each rank in each
    all-to-all call; rows_TR [T, R] int64: where the partial result of (token, rank) lands in
    the combine's receive buffer (-1 where the token has no expert on that rank); chunks: the
    token range (t0, t1) of each of this rank's chunks (chunk c travels in call c)."""

    num_tokens: int
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    rows_TR: torch.Tensor
    dtype: torch.dtype
    chunks: list[tuple[int, int]]
    route: object = None  # p2p: the ReturnRoute (rows_TR then index the return buffer)


@dataclass(frozen=True)
class LowLatencyHandle:
    """Metadata for the return trip of a low-latency dispatch (all fixed shapes).

    dest_NK [R*C, K]: masked slot (expert * R*C + row) of each received (row, k), E*R*C where
    unused; weights_NK [R*C, K] float32; rows_TR [T, R]: the row of (token, rank) in the
    returned block, R*C where unused."""

    num_tokens: int
    dest_NK: torch.Tensor
    weights_NK: torch.Tensor
    rows_TR: torch.Tensor
    dtype: torch.dtype


class AllToAllDispatcher(Dispatcher):
    """Expert parallelism over all_to_all_single in the EP group (see the module docstring).

    placement: the physical slots and their EP ranks (placement.ep_size must equal the group
    size); group: the EP process group (None: a single rank, the collectives become copies);
    mode: 'normal', 'low_latency' or 'auto' (--deepep-mode); max_dispatch_tokens_per_rank: C;
    fp8_dispatch: send fp8 rows; normal_chunks: all-to-all calls per normal-mode dispatch
    (1..MAX_CHUNKS, default 1; None: by payload size); normal_graphs: what normal mode replays
    from CUDA graphs (`moekit.dispatch.exchange`): 'pack' (default: plan, counts exchange and
    packing), 'plan' (plan and counts exchange) or 'none'; normal_transport: 'nccl'
    (all_to_all_single), 'p2p' (NVLink writes into symmetric memory, one host:
    `moekit.dispatch.p2p`) or 'auto' (p2p where it can run); p2p_tokens: tokens per rank the
    p2p buffers have room for (R * p2p_tokens rows each way: a call in which some rank would
    send or receive more rows takes the NCCL path); impl: row kernels, 'auto' | 'torch' |
    'triton'."""

    name = "alltoall"

    def __init__(
        self,
        placement: ExpertPlacement,
        *,
        group: dist.ProcessGroup | None = None,
        num_logical_experts: int | None = None,
        mode: str = AUTO,
        max_dispatch_tokens_per_rank: int = 128,
        fp8_dispatch: bool = False,
        normal_chunks: int | None = 1,
        normal_graphs: str = "pack",
        normal_transport: str = "auto",
        p2p_tokens: int = 4096,
        impl: str = "auto",
    ) -> None:
        check_choice("deepep_mode", mode, DEEPEP_MODES)
        if normal_chunks is not None and not (isinstance(normal_chunks, int)
                                              and 1 <= normal_chunks <= MAX_CHUNKS):
            raise ConfigError(f"normal_chunks must be an integer in [1, {MAX_CHUNKS}] or None "
                              f"(by payload size), got {normal_chunks!r}")
        if not isinstance(max_dispatch_tokens_per_rank, int) or max_dispatch_tokens_per_rank < 1:
            raise ConfigError(
                "--max-dispatch-tokens-per-rank must be a positive integer, got "
                f"{max_dispatch_tokens_per_rank!r}"
            )
        size = 1 if group is None else dist.get_world_size(group)
        if placement.ep_size != size:
            raise ConfigError(
                f"--ep-size ({placement.ep_size}, from the placement) must equal the EP group "
                f"size ({size} ranks)"
            )
        self.group = group
        self.ep_size = size
        self.ep_rank = 0 if group is None else dist.get_rank(group)
        self.slots = SlotMap(placement, num_logical_experts)
        self.num_local = placement.slots_per_rank
        self.mode = mode
        self.capacity = max_dispatch_tokens_per_rank
        self.fp8 = fp8_dispatch
        self.normal_chunks = normal_chunks
        self.chunk_bytes = NORMAL_CHUNK_BYTES
        self.impl = impl
        self.phases: Phases | None = None  # set by benchmarks: per-phase timing of normal mode
        check_choice("normal_graphs", normal_graphs, GRAPH_MODES)
        self.normal_graphs = normal_graphs
        self.exchange = PlanExchange(self.slots, size, self.num_local, group,
                                     use_graphs=normal_graphs != "none")
        check_choice("normal_transport", normal_transport, TRANSPORTS)
        if not isinstance(p2p_tokens, int) or p2p_tokens < 1:
            raise ConfigError(f"p2p_tokens must be a positive integer, got {p2p_tokens!r}")
        if normal_transport == "p2p" and impl == "torch":
            raise ConfigError("normal_transport 'p2p' runs Triton kernels; impl 'torch' allows "
                              "normal_transport 'nccl' or 'auto'")
        self.p2p, why = None, "nccl was asked for" if normal_transport == "nccl" else "impl 'torch'"
        if normal_transport != "nccl" and impl != "torch":
            # CUDA only for an NCCL group: a gloo group's ranks may be forked from a process
            # that already holds a CUDA context (re-initialising CUDA there fails)
            nccl = group is not None and dist.get_backend(group) == "nccl"
            dev = torch.device("cuda", torch.cuda.current_device()) \
                if nccl and torch.cuda.is_available() else torch.device("cpu")
            why = agreed(group, p2p_unavailable(group, dev))
            if why is None:
                self.p2p = P2PExchange(self.slots, size, self.num_local, group, p2p_tokens,
                                       use_graphs=normal_graphs != "none")
            elif normal_transport == "p2p":
                raise ConfigError(f"normal_transport 'p2p' cannot run here: {why}; allowed "
                                  f"here: 'nccl', or 'auto' (which then uses nccl)")
        self.normal_transport = "p2p" if self.p2p is not None else "nccl"
        self.p2p_fallbacks = 0  # p2p calls that did not fit the buffers (took the NCCL path)
        log_once(logging.INFO, f"alltoall normal mode: transport {self.normal_transport} "
                 f"(asked: {normal_transport}; "
                 + (f"p2p buffers for {p2p_tokens} tokens per rank)" if self.p2p
                    else f"not p2p: {why})"))

    @classmethod
    def availability(cls, platform: Platform, parallel: ParallelConfig) -> Availability:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return Availability(False, NEEDS_DIST)
        return Availability(True)

    def update_placement(self, placement: ExpertPlacement, num_logical: int | None = None) -> bool:
        """Take a new placement (EPLB) of the same slots, in place: the exchanges and their
        graphs read the slot map's tensors, which are rewritten."""
        self.slots.update_(placement, num_logical)
        return True

    # ---- mode ----------------------------------------------------------------------------

    def mode_for(self, num_tokens: int, device: torch.device) -> str:
        """The mode this call runs in: the configured one, or auto's choice (see module doc)."""
        if self.mode != AUTO:
            return self.mode
        worst = num_tokens
        if self.group is not None and not _capturing(device):
            t = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            worst = int(t.item())
        return LOW_LATENCY if worst <= self.capacity else NORMAL

    # ---- protocol --------------------------------------------------------------------------

    def dispatch(self, x_TH: torch.Tensor, topk: TopKOutput):
        """x_TH [T, H], topk (logical ids [T, K], float32 weights) -> StandardDispatchOutput
        (normal) or MaskedDispatchOutput (low_latency) for this rank's experts."""
        if x_TH.dim() != 2 or topk.ids.shape[0] != x_TH.shape[0]:
            raise ValueError(
                f"dispatch: x must be [T, H] and topk ids [T, K]; got {list(x_TH.shape)} and "
                f"{list(topk.ids.shape)}"
            )
        mode = self.mode_for(x_TH.shape[0], x_TH.device)
        if mode == LOW_LATENCY:
            return self.dispatch_low_latency(x_TH, topk)
        return self.dispatch_normal(x_TH, topk)

    def combine(self, runner_out, dispatched) -> torch.Tensor:
        handle = dispatched.handle
        if isinstance(handle, LowLatencyHandle):
            if not isinstance(runner_out, MaskedRunnerOutput):
                raise TypeError("a low-latency dispatch needs a MaskedRunnerOutput to combine")
            return self.combine_low_latency(runner_out.out, handle)
        if isinstance(handle, NormalHandle):
            if not isinstance(runner_out, StandardRunnerOutput):
                raise TypeError("a normal dispatch needs a StandardRunnerOutput to combine")
            return self.combine_normal(runner_out.out, handle)
        raise TypeError(f"combine: not a dispatch of this dispatcher (handle {type(handle)})")

    # ---- normal ----------------------------------------------------------------------------

    def chunks_for(self, num_tokens: int, row_bytes: int) -> int:
        """Chunks (all-to-all calls) a rank with `num_tokens` tokens cuts its normal-mode
        dispatch into: the configured normal_chunks, or one per chunk_bytes of payload
        (NORMAL_CHUNK_BYTES; at most MAX_CHUNKS). Every rank evaluates it for every rank's T
        (the counts exchange carries them), so the group agrees on the number of calls."""
        if self.normal_chunks is not None:
            return self.normal_chunks
        return max(1, min(MAX_CHUNKS, -(-num_tokens * row_bytes // self.chunk_bytes)))

    # Normal mode reads the counts back to the host and juggles byte buffers through views of
    # other dtypes; under torch.compile both halves run eagerly, as graph breaks (dynamo cannot
    # trace the host synchronisation, and AOTAutograd refuses in-place writes into such views).
    @torch.compiler.disable
    def dispatch_normal(self, x_TH: torch.Tensor, topk: TopKOutput) -> StandardDispatchOutput:
        """One send buffer of packed rows (RowLayout: the payload, then K local ids and K
        weights), one row per (token, destination rank), laid out in chunks of tokens. The
        plan, the counts exchange and its copy to the host (`moekit.dispatch.exchange`; with
        normal_graphs 'pack' the packing too, replayed from one CUDA graph); the one host
        synchronisation; then per chunk c one all_to_all_single (packing chunk c here, while
        chunk c-1 travels, when the graph did not). Returns x [N, H] (rows of the receive
        buffer: unit last stride, row stride RowLayout.row_bytes; contiguous for fp8) ordered
        by chunk, source rank, token; local ids and weights contiguous."""
        T, H = x_TH.shape
        K, R, E = topk.ids.shape[1], self.ep_size, self.num_local
        dev = x_TH.device
        ph = self.phases
        if ph is not None:
            ph.begin()
        layout = RowLayout(H, x_TH.dtype, K, self.fp8)
        nc = self.chunks_for(T, layout.row_bytes)
        payload = layout.pack_tokens(x_TH)
        w = topk.weights if topk.weights.dtype == torch.float32 else topk.weights.float()
        job = PackJob(payload, w, E, layout.payload_bytes, layout.row_bytes)
        if self.p2p is not None:
            if x_TH.is_cuda and use_triton(x_TH, self.impl) and (
                    layout.fp8 or H * x_TH.element_size() % 4 == 0):
                out = self._dispatch_p2p(x_TH, topk, layout, job)
                if out is not None:
                    return out
            else:
                log_once(logging.WARNING, "alltoall normal mode: p2p needs CUDA tokens, the "
                         "Triton kernels and rows of whole 4-byte words (fp8, or an even H in "
                         "16-bit); these calls take the NCCL path")
        prep = self.exchange(topk.ids, nc, self.impl, job if self.normal_graphs == "pack" else None)
        plan, reader = prep.plan, prep.reader
        if ph is not None:
            ph.mark("plan")
        bounds = plan.chunk_bounds()
        send, rows_TR = prep.send, prep.rows_TR
        if send is None:  # pack here, chunk by chunk (else the graph packed every chunk)
            send = torch.empty(T * R, layout.row_bytes, dtype=torch.uint8, device=dev)
            rows_TR = torch.empty(T, R, dtype=torch.int64, device=dev)
            send_x, send_meta = job.views(send)

        def pack(c: int) -> None:
            if prep.send is None and c < nc:
                pack_rows(payload, plan, job.weights, E, send_x, send_meta, rows_TR, bounds[c],
                          self.impl)

        pack(0)
        if ph is not None:
            ph.mark("gather")
        sizes = reader.result()  # the one host synchronisation: [2, R, MAX_CHUNKS + 1]
        calls = max(self.chunks_for(sizes[1][s][MAX_CHUNKS], layout.row_bytes)
                    for s in range(R))
        send_splits = [[sizes[0][r][c] for r in range(R)] for c in range(calls)]
        recv_splits = [[sizes[1][s][c] for s in range(R)] for c in range(calls)]
        if ph is not None:
            ph.mark("count_sync")
        recv = torch.empty(sum(map(sum, recv_splits)), layout.row_bytes, dtype=torch.uint8,
                           device=dev)
        works = []
        s_off = r_off = 0
        for c in range(calls):
            if c:
                pack(c)  # queued before call c, so the call waits for it (and overlaps c-1)
            ns, nr = sum(send_splits[c]), sum(recv_splits[c])
            works.append(all_to_all(recv[r_off:r_off + nr], send[s_off:s_off + ns], self.group,
                                     recv_splits[c], send_splits[c], async_op=True))
            s_off, r_off = s_off + ns, r_off + nr
        if prep.send is not None:  # the combine needs rows_TR after the next replay
            rows_TR = rows_TR.clone()
        _wait(works)
        if ph is not None:
            ph.mark("payload_a2a")
        x_recv = layout.unpack_tokens(layout.payload_view(recv))
        ids, weights = layout.meta_views(recv)
        local = TopKOutput(weights.contiguous(), ids.contiguous())
        if ph is not None:
            ph.mark("unpack")
        handle = NormalHandle(T, send_splits, recv_splits, rows_TR, x_TH.dtype, bounds)
        return StandardDispatchOutput(x_recv, local, handle,
                                      local_share=self._received_share(topk.top_k))

    def _dispatch_p2p(self, x_TH, topk, layout: RowLayout, job: PackJob):
        """dispatch_normal over NVLink writes (`moekit.dispatch.p2p`); None when the batch did
        not fit the buffers (nothing moved: the caller takes the NCCL path)."""
        T = x_TH.shape[0]
        ph = self.phases
        res = self.p2p.dispatch(topk.ids, job, layout.hidden, x_TH.dtype)
        if not res.ok:
            self.p2p_fallbacks += 1
            log_once(logging.WARNING, "alltoall normal mode: a batch over the p2p buffers "
                     "(p2p_tokens per rank) took the NCCL path; raise p2p_tokens to keep it on "
                     "NVLink")
            return None
        if ph is not None:
            ph.mark("p2p_counts")
        R = self.ep_size
        send_splits = [[res.counts[0][r][0] for r in range(R)]]
        recv_splits = [[res.counts[1][s][0] for s in range(R)]]
        x_recv = layout.unpack_tokens(layout.payload_view(res.recv))
        ids, weights = layout.meta_views(res.recv)
        local = TopKOutput(weights.contiguous(), ids.contiguous())
        if ph is not None:
            ph.mark("unpack")
        handle = NormalHandle(T, send_splits, recv_splits, res.rows_TR, x_TH.dtype, [(0, T)],
                              res.route)
        return StandardDispatchOutput(x_recv, local, handle,
                                      local_share=self._received_share(topk.top_k))

    def _received_share(self, K: int) -> float:
        """`StandardDispatchOutput.local_share` of the received rows: a token comes here when
        one of its K pairs is local, so a row holds K * s / (1 - (1 - s)^K) local pairs on
        average (s: this rank's share of the pairs)."""
        s = self.slots.local_share(self.ep_rank)
        if K == 0 or s <= 0:
            return 1.0
        return min(1.0, s / (1.0 - (1.0 - s) ** K))

    @torch.compiler.disable  # as dispatch_normal
    def combine_normal(self, out_NH: torch.Tensor, handle: NormalHandle) -> torch.Tensor:
        """out_NH [N received, H] weighted partial sums -> [T, H] for this rank's tokens. Chunk
        by chunk: all the return calls are queued at once, and chunk c's tokens are summed as
        soon as call c has landed (while the later calls travel)."""
        n_recv = sum(map(sum, handle.recv_splits))
        if out_NH.shape[0] != n_recv:
            raise ValueError(f"combine: runner output has {out_NH.shape[0]} rows, dispatched "
                             f"{n_recv}")
        ph = self.phases
        if ph is not None:
            ph.begin()
        if handle.route is not None:
            out = self.p2p.combine(out_NH, handle.route, handle.rows_TR,
                                   handle.recv_splits[0], self.impl)
            if ph is not None:
                ph.mark("combine")
            return out
        H = out_NH.shape[1]
        src = out_NH.contiguous()
        back = out_NH.new_empty(sum(map(sum, handle.send_splits)), H)
        works = []
        s_off = r_off = 0
        for sends, recvs in zip(handle.send_splits, handle.recv_splits):
            ns, nr = sum(sends), sum(recvs)
            works.append(all_to_all(back[s_off:s_off + ns], src[r_off:r_off + nr], self.group,
                                     sends, recvs, async_op=True))
            s_off, r_off = s_off + ns, r_off + nr
        out = torch.empty(handle.num_tokens, H, dtype=handle.dtype, device=out_NH.device)
        for c, (t0, t1) in enumerate(handle.chunks):
            _wait(works[c:c + 1])
            if t1 > t0:
                gather_reduce(back, handle.rows_TR[t0:t1], None, handle.dtype, self.impl,
                              out=out[t0:t1])
        _wait(works[len(handle.chunks):])
        if ph is not None:
            ph.mark("combine")
        return out

    # ---- low latency -----------------------------------------------------------------------

    def check_capacity(self, num_tokens: int) -> None:
        if num_tokens > self.capacity:
            raise CapacityError(
                f"--deepep-mode low_latency: {num_tokens} tokens on this rank exceed "
                f"--max-dispatch-tokens-per-rank {self.capacity}; raise it, or use "
                "--deepep-mode auto (normal mode for larger batches) or normal"
            )

    def dispatch_low_latency(self, x_TH: torch.Tensor, topk: TopKOutput) -> MaskedDispatchOutput:
        T, H = x_TH.shape
        self.check_capacity(T)
        K, R, E, C = topk.ids.shape[1], self.ep_size, self.num_local, self.capacity
        RC = R * C
        layout = RowLayout(H, x_TH.dtype, K, self.fp8)
        send = torch.empty(RC, layout.row_bytes, dtype=torch.uint8, device=x_TH.device)
        send_ids, send_w = layout.meta_views(send)
        # sender: block r holds, in token order, the tokens with an expert on rank r
        rows_TR = send_plan(topk.ids, topk.weights, self.slots, R, E, C, send_ids, send_w,
                            self.impl)
        scatter_rows(layout.pack_tokens(x_TH), rows_TR, RC, self.impl,
                     out=layout.payload_view(send))
        recv = torch.empty_like(send)
        all_to_all(recv, send, self.group)
        # receiver: (row, k) pairs -> masked rows of their expert, in (source rank, row, k) order
        recv_ids, recv_w = layout.meta_views(recv)
        dest, counts, weights = recv_plan(recv_ids, recv_w, E, self.impl)
        x_masked = layout.unpack_scatter(layout.payload_view(recv), dest, E * RC,
                                         self.impl).view(E, RC, H)
        handle = LowLatencyHandle(T, dest, weights, rows_TR, x_TH.dtype)
        # mean rows per local expert under uniform routing, every rank sending T tokens
        expected = math.ceil(R * T * K * self.slots.local_share(self.ep_rank) / E)
        return MaskedDispatchOutput(x_masked, counts, handle, expected_rows=expected)

    def combine_low_latency(self, out_ECH: torch.Tensor, handle: LowLatencyHandle) -> torch.Tensor:
        """out_ECH [E, R*C, H] unweighted expert outputs -> [T, H] for this rank's tokens."""
        E, RC = self.num_local, self.ep_size * self.capacity
        if out_ECH.shape[:2] != (E, RC):
            raise ValueError(f"combine: runner output {list(out_ECH.shape)}; expected [{E}, {RC}, H]")
        flat = out_ECH.reshape(E * RC, out_ECH.shape[2])
        send = gather_reduce(flat, handle.dest_NK, handle.weights_NK, handle.dtype, self.impl)
        back = torch.empty_like(send)
        all_to_all(back, send, self.group)
        return gather_reduce(back, handle.rows_TR, None, handle.dtype, self.impl)
