"""Expert-parallel benchmark, run under torchrun (one process per GPU; gloo on CPU for tests):
the `alltoall` dispatcher against raw all_to_all_single, and the EP layer against TP with `none`.

    torchrun --standalone --nproc-per-node 4 -m moekit.bench_ep --out ep_bench.json

Parts (--parts, comma-separated, in this order):
  normal       normal-mode dispatch + combine with T = --prefill-tokens per rank, against a raw
               all_to_all_single round trip of the same payload: the dispatch's splits, rows of
               H values in x's dtype, there and back (exactly the payload bytes the dispatcher
               moves; its routing metadata, 2K int32 per row, and the counts exchange are extra
               and count against it). The "runner" output is a fixed contiguous copy of the
               received rows (same routing every call), which combine sends back. Target:
               ratio <= 1.25 (max over ranks of both). Every --normal-chunks setting is timed
               side by side (the first is the headline). Also a per-phase breakdown (CUDA
               events): NCCL path: plan, gather (packing chunk 0), count_sync (counts exchange
               + the host read), payload_a2a (the other chunks' packing and every call),
               unpack, combine; p2p path: p2p_counts (plan, offsets, the host read: the rows
               travel after it, overlapped), unpack, combine;
               raw one-way times of the two transport layouts (metadata in each payload row,
               as the dispatcher sends it, vs a separate message); and with --profile a
               torch.profiler trace per rank.
  low_latency  low-latency dispatch and combine, each captured in its own CUDA graph (eager on
               CPU), T = --decode-tokens per rank = the capacity. Target: < 100 us each. Raw
               all_to_all_single of the same fixed buffers, also in graphs, for reference.
  layer        the whole MoE layer, routing precomputed: EP (alltoall; normal at prefill,
               low_latency at decode, in a CUDA graph when the runner allows) with T tokens per
               rank, against TP (`none`, ep 1, I split over the ranks) on the same global batch
               (R * T tokens, replicated). Reported as time per call and global tokens/s.
Routing: deepseek-v3 shape by default (E=256, K=8, H=7168, I=2048), uniform random top-k
(--routing zipf for skew). Each part records per-rank times and an aggregate: max over ranks
(what a step waits for) and mean. Rank 0 prints a summary and writes the JSON after each part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from moekit.bench import capture_graph
from moekit.config import DTYPES, ParallelConfig, RunnerConfig
from moekit.dispatch.alltoall import AllToAllDispatcher, Phases, RowLayout
from moekit.dispatch.exchange import GRAPH_MODES
from moekit.layer import MoE
from moekit.parallel import init_parallel
from moekit.placement import ExpertPlacement
from moekit.presets import model_config
from moekit.router import TopKOutput
from moekit.stages import MaskedRunnerOutput, StandardRunnerOutput

PARTS = ("normal", "low_latency", "layer")
TARGETS = {"normal_ratio_max": 1.25, "low_latency_us_max": 100.0}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _barrier(dev: torch.device) -> None:
    """All ranks here, device idle (a tiny all-reduce: works on gloo and NCCL alike)."""
    t = torch.zeros(1, device=dev)
    dist.all_reduce(t)
    _sync(dev)


def time_eager(fn: Callable[[], object], dev: torch.device, iters: int, warmup: int) -> float:
    """Median wall time of fn() in ms, ranks aligned before each call (fn may sync the host)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        _barrier(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_graph(fn: Callable[[], object], dev: torch.device, iters: int, reps: int) -> float:
    """Median ms of one replay of fn captured in a CUDA graph; every rank replays the same
    number of times (the graph holds collectives). Eager timing on CPU."""
    if dev.type != "cuda":
        return time_eager(fn, dev, iters, 2)
    graph = capture_graph(fn, dev)
    graph.replay()
    _sync(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        _barrier(dev)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _aggregate(per_rank: list[dict], keys: tuple[str, ...]) -> dict:
    agg = {}
    for k in keys:
        vals = [r[k] for r in per_rank if r.get(k) is not None]
        if vals:
            agg[k + "_max"] = max(vals)
            agg[k + "_mean"] = sum(vals) / len(vals)
    return agg


def _routing(args, T: int, E: int, K: int, rank: int, dev) -> TopKOutput:
    from moekit.sweep import make_routing

    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    return make_routing(T, E, K, routing=args.routing, zipf_s=args.zipf_s, generator=g,
                        device=dev)


def _inputs(args, T: int, rank: int, dev):
    moe = args.moe
    g = torch.Generator().manual_seed(args.seed * 1000 + rank + 7)
    x = torch.randn(T, moe.hidden_size, generator=g).to(dev, moe.torch_dtype)
    return x, _routing(args, T, moe.num_experts, moe.top_k, rank, dev)


def _variant(name: str) -> dict:
    """A --normal-chunks setting -> AllToAllDispatcher keywords: 'default' (the dispatcher's
    defaults), 'auto' (chunks by payload size) or 1..4 (all-to-all calls), optionally with
    '/none', '/plan' or '/pack' appended: what normal mode replays from CUDA graphs; or
    'nccl' / 'p2p': normal mode's transport (NCCL all-to-all or NVLink writes)."""
    if name in ("nccl", "p2p"):  # normal mode's transport, the other settings default
        return {"normal_transport": name}
    chunks, _, how = name.partition("/")
    if how not in ("",) + GRAPH_MODES or not (chunks in ("default", "auto") or chunks.isdigit()):
        raise SystemExit(f"--normal-chunks: {name!r}; allowed: default, auto or 1..4, "
                         f"optionally /{', /'.join(GRAPH_MODES)}; or nccl / p2p (transport)")
    kw = {} if chunks == "default" else {
        "normal_chunks": None if chunks == "auto" else int(chunks)}
    return {**kw, "normal_graphs": how} if how else kw


def bench_normal(args, state, dev) -> dict:
    moe, R, rank = args.moe, state.ep_size, state.rank
    T = args.prefill_tokens
    placement = ExpertPlacement.contiguous(moe.num_experts, R)
    variants = [v for v in args.normal_chunks.split(",") if v]
    ds = {v: AllToAllDispatcher(placement, group=state.ep_group, mode="normal", **_variant(v))
          for v in variants}
    d = ds[variants[0]]  # the headline: the first variant
    x, topk = _inputs(args, T, rank, dev)
    probe = d.dispatch(x, topk)
    h = probe.handle
    # the "runner": its output is a contiguous [N, H] buffer, as a real runner's is (the
    # received rows themselves, copied once here; every call routes the same tokens)
    y = StandardRunnerOutput(probe.x.contiguous())

    def round_trip(disp=d):
        return disp.combine(y, disp.dispatch(x, topk))

    def dispatch_only():
        return d.dispatch(x, topk)

    send_splits = [sum(c[r] for c in h.send_splits) for r in range(R)]  # over the calls
    recv_splits = [sum(c[r] for c in h.recv_splits) for r in range(R)]
    send_rows, recv_rows = sum(send_splits), sum(recv_splits)
    H, K = moe.hidden_size, moe.top_k
    send = torch.randn(send_rows, H, device=dev).to(moe.torch_dtype)
    recv = torch.empty(recv_rows, H, device=dev, dtype=moe.torch_dtype)
    g = state.ep_group

    def raw_trip():
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=g)
        dist.all_to_all_single(send, recv, send_splits, recv_splits, group=g)

    def raw_one_way():
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=g)

    # the two ways to carry the routing metadata, one way, same splits
    row_bytes = H * x.element_size() + 8 * K
    packed_send = torch.zeros(send_rows, row_bytes, dtype=torch.uint8, device=dev)
    packed_recv = torch.empty(recv_rows, row_bytes, dtype=torch.uint8, device=dev)
    meta_send = torch.zeros(send_rows, 2 * K, dtype=torch.int32, device=dev)
    meta_recv = torch.empty(recv_rows, 2 * K, dtype=torch.int32, device=dev)

    def raw_packed_rows():
        dist.all_to_all_single(packed_recv, packed_send, recv_splits, send_splits, group=g)

    def raw_payload_plus_meta():
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=g)
        dist.all_to_all_single(meta_recv, meta_send, recv_splits, send_splits, group=g)

    it, wu = args.iters, args.warmup
    res = {
        "rank": rank,
        "tokens": T,
        "rows_sent": send_rows,
        "rows_received": recv_rows,
        "calls": len(h.send_splits),
        "bytes_sent_one_way": send_rows * H * x.element_size(),
        "meta_bytes_sent_one_way": send_rows * 8 * K,
        "dispatch_ms": time_eager(dispatch_only, dev, it, wu),
        "dispatch_combine_ms": time_eager(round_trip, dev, it, wu),
        "raw_one_way_ms": time_eager(raw_one_way, dev, it, wu),
        "raw_round_trip_ms": time_eager(raw_trip, dev, it, wu),
        "raw_packed_rows_one_way_ms": time_eager(raw_packed_rows, dev, it, wu),
        "raw_payload_plus_meta_one_way_ms": time_eager(raw_payload_plus_meta, dev, it, wu),
        # every --normal-chunks variant, side by side with the raw round trip above
        "variants_ms": {v: time_eager(lambda v=v: round_trip(ds[v]), dev, it, wu)
                        for v in variants},
    }
    # per-phase breakdown (CUDA events on the current stream), round trips with identity runner
    phases = Phases(dev)
    d.phases = phases
    for _ in range(it):
        _barrier(dev)
        round_trip()
    d.phases = None
    res["phases_ms"] = {k: statistics.median(v) for k, v in phases.durations().items()}
    res["phases_host_ms"] = {k: statistics.median(v) for k, v in phases.host_durations().items()}
    if args.profile:
        _profile(round_trip, dev, rank, args.profile)
    res["combine_ms"] = res["dispatch_combine_ms"] - res["dispatch_ms"]
    res["ratio"] = res["dispatch_combine_ms"] / res["raw_round_trip_ms"]
    res["raw_GBps_per_rank"] = 2 * res["bytes_sent_one_way"] / res["raw_round_trip_ms"] / 1e6
    per_rank = _gather(res)
    agg = _aggregate(per_rank, ("dispatch_ms", "combine_ms", "dispatch_combine_ms",
                                "raw_one_way_ms", "raw_round_trip_ms",
                                "raw_packed_rows_one_way_ms", "raw_payload_plus_meta_one_way_ms"))
    agg["headline_chunks"] = variants[0]
    agg["calls_max"] = max(r["calls"] for r in per_rank)
    agg["variants_ratio_of_max"] = {
        v: max(r["variants_ms"][v] for r in per_rank) / agg["raw_round_trip_ms_max"]
        for v in variants}
    agg["phases_ms_max"] = {k: max(r["phases_ms"].get(k, 0.0) for r in per_rank)
                            for k in per_rank[0]["phases_ms"]}
    agg["phases_host_ms_max"] = {k: max(r["phases_host_ms"].get(k, 0.0) for r in per_rank)
                                 for k in per_rank[0]["phases_host_ms"]}
    agg["ratio_of_max"] = agg["dispatch_combine_ms_max"] / agg["raw_round_trip_ms_max"]
    agg["target_ratio_max"] = TARGETS["normal_ratio_max"]
    agg["meets_target"] = agg["ratio_of_max"] <= TARGETS["normal_ratio_max"]
    return {"per_rank": per_rank, "aggregate": agg}


def _profile(fn: Callable[[], object], dev: torch.device, rank: int, out_dir: str) -> None:
    """A torch.profiler trace (host and device) of a few fn() calls, ranks aligned before each:
    out_dir/ep_trace_rank{rank}.json; rank 0 prints the top operators by host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    os.makedirs(out_dir, exist_ok=True)
    with profile(activities=acts) as prof:
        for _ in range(5):
            _barrier(dev)
            fn()
        _sync(dev)
    prof.export_chrome_trace(os.path.join(out_dir, f"ep_trace_rank{rank}.json"))
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25),
              flush=True)


def bench_low_latency(args, state, dev) -> dict:
    moe, R, rank = args.moe, state.ep_size, state.rank
    T = args.decode_tokens
    placement = ExpertPlacement.contiguous(moe.num_experts, R)
    d = AllToAllDispatcher(placement, group=state.ep_group, mode="low_latency",
                           max_dispatch_tokens_per_rank=T, fp8_dispatch=args.fp8)
    x, topk = _inputs(args, T, rank, dev)
    static = d.dispatch(x, topk)  # eager: the combine graph reads this dispatch's handle
    y = MaskedRunnerOutput(static.x.clone())
    H, C = moe.hidden_size, T
    layout = RowLayout(H, x.dtype, moe.top_k, args.fp8)
    raw_send = torch.zeros(R * C, layout.row_bytes, dtype=torch.uint8, device=dev)
    raw_recv = torch.empty_like(raw_send)
    back_send = torch.zeros(R * C, H, dtype=x.dtype, device=dev)
    back_recv = torch.empty_like(back_send)
    it, reps = args.iters, args.graph_reps
    res = {
        "rank": rank,
        "tokens": T,
        "capacity": C,
        "fp8": args.fp8,
        "dispatch_bytes_per_rank": raw_send.numel(),
        "combine_bytes_per_rank": back_send.numel() * back_send.element_size(),
        "dispatch_ms": time_graph(lambda: d.dispatch(x, topk), dev, it, reps),
        "combine_ms": time_graph(lambda: d.combine(y, static), dev, it, reps),
        "raw_dispatch_ms": time_graph(
            lambda: dist.all_to_all_single(raw_recv, raw_send, group=state.ep_group), dev, it, reps),
        "raw_combine_ms": time_graph(
            lambda: dist.all_to_all_single(back_recv, back_send, group=state.ep_group), dev, it,
            reps),
        "cuda_graph": dev.type == "cuda",
    }
    per_rank = _gather(res)
    agg = _aggregate(per_rank, ("dispatch_ms", "combine_ms", "raw_dispatch_ms", "raw_combine_ms"))
    agg["target_us_max"] = TARGETS["low_latency_us_max"]
    agg["meets_target"] = (max(agg["dispatch_ms_max"], agg["combine_ms_max"]) * 1e3
                           < TARGETS["low_latency_us_max"])
    return {"per_rank": per_rank, "aggregate": agg}


def _layer_time(layer: MoE, x, topk, dev, args, graph: bool) -> tuple[float, bool, str]:
    fn = lambda: layer.forward_topk(x, topk)  # noqa: E731
    fn()  # first call: runner selection (host work) outside any graph
    backend = ",".join(sorted({d.backend for d in layer.runners._decisions.values()}))
    if graph and dev.type == "cuda":
        try:
            return time_graph(fn, dev, args.iters, args.graph_reps), True, backend
        except Exception as err:  # noqa: BLE001 - fall back to eager, record why
            if dist.get_rank() == 0:
                print(f"[bench_ep] CUDA graph of the layer failed ({err}); timing eagerly")
            torch.cuda.synchronize(dev)
    return time_eager(fn, dev, args.iters, args.warmup), False, backend


def bench_layer(args, state_ep, state_tp, dev) -> dict:
    moe, R, rank = args.moe, state_ep.ep_size, state_ep.rank
    runner = RunnerConfig(moe_runner_backend=args.runner)
    rows = []
    for label, T in (("prefill", args.prefill_tokens), ("decode", args.decode_tokens)):
        mode = "normal" if label == "prefill" else "low_latency"
        ep_cfg = replace(state_ep.config, deepep_mode=mode, max_dispatch_tokens_per_rank=max(
            args.decode_tokens, 1))
        ep_state = replace(state_ep, config=ep_cfg)
        ep = MoE(moe, runner=runner, state=ep_state, device=dev)
        x, topk = _inputs(args, T, rank, dev)
        ep_ms, ep_graph, ep_runner = _layer_time(ep, x, topk, dev, args, mode == "low_latency")
        del ep
        tp = MoE(moe, runner=runner, state=state_tp, device=dev)
        xs, topks = zip(*(_inputs(args, T, r, dev) for r in range(R)))  # the global batch
        xg = torch.cat(xs)
        tg = TopKOutput(torch.cat([t.weights for t in topks]), torch.cat([t.ids for t in topks]))
        tp_ms, tp_graph, tp_runner = _layer_time(tp, xg, tg, dev, args, False)
        del tp
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"rank": rank, "batch": label, "tokens_per_rank": T, "global_tokens": R * T,
                     "ep_ms": ep_ms, "ep_mode": mode, "ep_cuda_graph": ep_graph,
                     "ep_runner": ep_runner, "tp_ms": tp_ms, "tp_runner": tp_runner,
                     "tp_cuda_graph": tp_graph})
    per_rank = _gather(rows)
    agg = []
    for i, row in enumerate(rows):
        ep_max = max(r[i]["ep_ms"] for r in per_rank)
        tp_max = max(r[i]["tp_ms"] for r in per_rank)
        agg.append({"batch": row["batch"], "tokens_per_rank": row["tokens_per_rank"],
                    "global_tokens": row["global_tokens"], "ep_ms_max": ep_max,
                    "tp_ms_max": tp_max,
                    "ep_tokens_per_s": row["global_tokens"] / (ep_max * 1e-3),
                    "tp_tokens_per_s": row["global_tokens"] / (tp_max * 1e-3),
                    "ep_speedup_over_tp": tp_max / ep_max,
                    "ep_runner": row["ep_runner"], "tp_runner": row["tp_runner"],
                    "ep_cuda_graph": row["ep_cuda_graph"]})
    return {"per_rank": per_rank, "aggregate": agg}


def summary(doc: dict) -> str:
    """The human-readable lines of one EP benchmark JSON document."""
    lines = [f"EP benchmark: {doc['world_size']} ranks, {doc['device_name']}, {doc['shape']}"]
    n = doc.get("normal", {}).get("aggregate")
    if n:
        lines.append(
            f"normal  T={doc['args']['prefill_tokens']}/rank: dispatch+combine "
            f"{n['dispatch_combine_ms_max']:.3f} ms (max over ranks) vs raw a2a "
            f"{n['raw_round_trip_ms_max']:.3f} ms -> ratio {n['ratio_of_max']:.2f} "
            f"(target <= {TARGETS['normal_ratio_max']})")
        lines.append(
            f"normal  dispatch {n['dispatch_ms_max']:.3f} ms, combine {n['combine_ms_max']:.3f} "
            f"ms, raw one way {n['raw_one_way_ms_max']:.3f} ms")
        if "raw_packed_rows_one_way_ms_max" in n:
            lines.append(
                f"normal  metadata transport, raw one way: in each row "
                f"{n['raw_packed_rows_one_way_ms_max']:.3f} ms, separate message "
                f"{n['raw_payload_plus_meta_one_way_ms_max']:.3f} ms")
        variants = n.get("variants_ratio_of_max")
        if variants:
            lines.append("normal  ratio by --normal-chunks: " + ", ".join(
                f"{k} {v:.3f}" for k, v in variants.items())
                + f" (headline {n.get('headline_chunks')}: {n.get('calls_max')} calls)")
        phases = n.get("phases_ms_max")
        if phases:
            lines.append("normal  phases (median, max over ranks, ms): " + ", ".join(
                f"{k} {v:.3f}" for k, v in phases.items()))
        host = n.get("phases_host_ms_max")
        if host:
            lines.append("normal  phases on the host clock (ms): " + ", ".join(
                f"{k} {v:.3f}" for k, v in host.items()))
    ll = doc.get("low_latency", {}).get("aggregate")
    if ll:
        lines.append(
            f"low_latency T={doc['args']['decode_tokens']}/rank: dispatch "
            f"{ll['dispatch_ms_max'] * 1e3:.1f} us, combine {ll['combine_ms_max'] * 1e3:.1f} us "
            f"(raw {ll['raw_dispatch_ms_max'] * 1e3:.1f} / {ll['raw_combine_ms_max'] * 1e3:.1f} "
            f"us; target < {TARGETS['low_latency_us_max']:.0f} us)")
    for row in doc.get("layer", {}).get("aggregate", []):
        lines.append(
            f"layer {row['batch']:7s} T={row['tokens_per_rank']}/rank: EP {row['ep_ms_max']:.3f} "
            f"ms ({row['ep_runner']}) vs TP {row['tp_ms_max']:.3f} ms ({row['tp_runner']}) on "
            f"{row['global_tokens']} tokens -> EP speed-up {row['ep_speedup_over_tp']:.2f}x")
    for part, err in doc.get("errors", {}).items():
        lines.append(f"{part}: FAILED: {err.splitlines()[-1] if err else err}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moekit.bench_ep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="JSON file rank 0 writes (default: $OUT/ep_bench.json or "
                   "./ep_bench.json)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--model", default="deepseek-v3",
                   help="preset, or a Hugging Face config.json (file or directory), for E, K, H, I")
    p.add_argument("--num-experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--intermediate-size", type=int)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens per rank (normal)")
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="tokens per rank (low_latency) = --max-dispatch-tokens-per-rank")
    p.add_argument("--routing", default="uniform", choices=("uniform", "zipf"))
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--fp8", action="store_true", help="fp8 dispatch in the low_latency part")
    p.add_argument("--runner", default="auto", help="--moe-runner-backend of the layer part")
    p.add_argument("--normal-chunks", default="default",
                   help="normal part: comma-separated settings to time side by side: default "
                        "(the dispatcher's), auto (by payload size) or 1..4 all-to-all calls "
                        "per dispatch, optionally with /none, /plan or /pack: what is replayed "
                        "from CUDA graphs; or nccl / p2p: the transport; the first is the "
                        "headline")
    p.add_argument("--profile", metavar="DIR",
                   help="normal part: write a torch.profiler trace per rank into DIR")
    p.add_argument("--iters", type=int, default=20, help="timed samples per point")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--graph-reps", type=int, default=20, help="graph replays per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300, help="process-group timeout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the parts; returns the JSON document (on every rank)."""
    args = parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"--parts: unknown {sorted(unknown)}; allowed: {', '.join(PARTS)}")
    overrides = {k: v for k, v in (("num_experts", args.num_experts), ("top_k", args.top_k),
                                   ("hidden_size", args.hidden_size),
                                   ("intermediate_size", args.intermediate_size),
                                   ("dtype", args.dtype)) if v is not None}
    if args.num_experts is not None:  # a custom E drops the preset's expert groups
        overrides.update(num_expert_group=None, topk_group=None)
    moe = model_config(args.model, **overrides)
    args.moe = moe
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise SystemExit("run under torchrun, e.g. torchrun --standalone --nproc-per-node 4 "
                         "-m moekit.bench_ep")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    state_ep = init_parallel(ParallelConfig(tp_size=world, ep_size=world,
                                            moe_a2a_backend="alltoall"),
                             timeout_s=args.timeout_s)
    dev = state_ep.device
    rank = state_ep.rank
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "ep_bench.json")
    try:
        from moekit.report import metadata

        meta = metadata(sys.argv)
    except Exception:  # noqa: BLE001 - metadata is nice to have
        meta = {}
    doc = {
        "schema": "moekit.bench_ep/1",
        **meta,
        "world_size": world,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "backend": state_ep.backend,
        "shape": {"num_experts": moe.num_experts, "top_k": moe.top_k,
                  "hidden_size": moe.hidden_size, "intermediate_size": moe.intermediate_size,
                  "dtype": moe.dtype},
        "args": {k: v for k, v in vars(args).items() if k != "moe"},
        "targets": TARGETS,
        "errors": {},
    }
    for part in parts:
        try:
            if part == "normal":
                doc["normal"] = bench_normal(args, state_ep, dev)
            elif part == "low_latency":
                doc["low_latency"] = bench_low_latency(args, state_ep, dev)
            elif part == "layer":
                state_tp = init_parallel(ParallelConfig(tp_size=world, ep_size=1),
                                         timeout_s=args.timeout_s)
                doc["layer"] = bench_layer(args, state_ep, state_tp, dev)
        except Exception:  # noqa: BLE001 - record, go on with the next part
            doc["errors"][part] = traceback.format_exc()
            if rank == 0:
                print(f"[bench_ep] part {part} failed:\n{doc['errors'][part]}", flush=True)
            if dev.type == "cuda":
                raise  # a rank that failed alone would leave the others in a collective
        if rank == 0:
            _write(doc, out_path)
    if rank == 0:
        print(summary(doc), flush=True)
        print(f"[bench_ep] wrote {out_path}", flush=True)
    return doc


def _write(doc: dict, path: str) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
