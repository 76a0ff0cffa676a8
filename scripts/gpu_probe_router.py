"""The routing of the presets: `select_experts` (PyTorch ops) against `select_experts_fused` (one
Triton kernel), timed in turns under CUDA-graph replay, with the picks compared.

For each preset's routing (softmax top-k, or DeepSeek-V3 / Kimi-K2's sigmoid with a correction
bias and grouped top-k) and each batch size, both functions route the same logits; the probe
reports us per call of each, their ratio, and the tokens whose experts differ (near-ties only).

    PYTHONPATH=src python3 scripts/gpu_probe_router.py [--batches 1,4,16,64,256,1024,4096,16384]
        [--models qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,kimi-k2,gpt-oss-120b]

With `--tiles 1,4,16` it also times the fused kernel with 1, 4, 16 tokens a program (fewer
where T is smaller) instead of what `router.tokens_per_program` gives, checked to route the same.

With `--layers qwen3-30b-a3b:1:1,deepseek-v3:8:8` (model:tp:ep) it also times the whole
`MoE.forward` (routing from logits + dispatch + experts + combine, rank 0 of the layout, the
`auto` runner) with `fused_router` off and on, in turns, at `--layer-batches`; what a user's
layer call gains from the fused routing. `--compiled` adds the same layer under torch.compile
with each routing (the PyTorch ops as Inductor compiles them, against the op moekit::route).
`--record` adds the kernel counting its pairs per expert (EPLB's load; also on logits where
every token picks expert 0, so that one counter takes every token's atomic add), and the layer
with its expert load recorded: counted inside the routing kernel (`forward`), and counted after
it with `count_experts` (`forward_topk`, as before); with `--compiled` also the compiled layer
counting inside `moekit::route`. `--gdc` adds the layer with the routing kernel (and the EP rank's
local-ids kernel) not letting the runner's first kernel start while it runs (`pdl_capable` off).
`--variants "group_tile=0,num_warps=4;tokens=2,num_warps=4"` adds the kernel (and the layers) with
`router.ROUTE_KERNEL` changed so (tokens=n: also n tokens a program), each checked to route the
same, in turns with the default.

`--count-variants "count=1;count=2"` (with --record): the counting kernel changed so, as --variants.
`--logits-dtype float32`: the kernel timings route float32 logits (default bfloat16; with 16-byte
loads a warp then covers 128 scores of a row, not 256).

Writes $OUT/router.json (router_float32.json for float32 logits; `--out-name NAME` another
name). Runs on the CPU too (interpreter; a smoke test, no timing worth reading).
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe

from moekit import router
from moekit._triton_host import next_pow2
from moekit.bench import time_ms_interleaved
from moekit.eplb.recorder import ExpertLoadRecorder
from moekit.presets import PRESETS
from moekit.router import select_experts, select_experts_fused
from moekit.select_tune import sweep_spec
from moekit.sweep import build_layer


def _kwargs(cfg, bias) -> dict:
    return dict(scoring_func=cfg.scoring_func, renormalize=cfg.renormalize,
                num_expert_group=cfg.num_expert_group, topk_group=cfg.topk_group,
                correction_bias_E=bias, routed_scaling_factor=cfg.routed_scaling_factor,
                num_fused_shared_experts=cfg.num_shared_experts)  # fmt: skip


def main() -> None:
    on_gpu = torch.cuda.is_available()
    dev = "cuda" if on_gpu else "cpu"
    default = "1,4,16,64,256,1024,4096,16384" if on_gpu else "1,5"
    batches = [int(b) for b in option("--batches", default).split(",")]
    models = option("--models", "qwen3-30b-a3b,mixtral-8x7b,deepseek-v3,kimi-k2,gpt-oss-120b")
    tiles = [int(c) for c in filter(None, option("--tiles", "").split(","))]
    variants = list(filter(None, option("--variants", "").split(";")))
    logits_dtype = getattr(torch, option("--logits-dtype", "bfloat16"))
    count_variants = list(filter(None, option("--count-variants", "").split(";")))
    rows = []
    for name in models.split(","):
        cfg = PRESETS[name]
        E, K = cfg.num_experts, cfg.top_k
        bias = torch.randn(E, device=dev) * 0.01 if cfg.use_correction_bias else None
        kw = _kwargs(cfg, bias)
        for T in batches:
            logits = torch.randn(T, E, device=dev, dtype=logits_dtype)
            ref = select_experts(logits, K, **kw)
            out = select_experts_fused(logits, K, **kw)
            differ = int((ref.ids.sort(-1).values != out.ids.sort(-1).values).any(-1).sum())
            fns = {"torch": lambda lg=logits, k=K, kw=kw: select_experts(lg, k, **kw),
                   "fused": lambda lg=logits, k=K, kw=kw: select_experts_fused(lg, k, **kw)}
            if "--record" in sys.argv:  # the kernel also counting, on these logits and on
                # logits where every token picks expert 0 (its counter takes all T atomics)
                counts = torch.zeros(E + cfg.num_shared_experts, dtype=torch.int64, device=dev)
                hot = logits.clone()
                hot[:, 0] += 30
                for n, lg in (("fused_count", logits), ("fused_count_hot", hot)):
                    fns[n] = lambda lg=lg, c=counts, cfg=cfg, b=bias: router.route(
                        lg, cfg, b, fused="on", counts_N=c)
            other = {f"fused_tile{n}": _tiled(n, fns["fused"]) for n in tiles}
            other.update({f"fused_v_{spec}": _variant(spec, fns["fused"]) for spec in variants})
            if "fused_count" in fns:  # the counting kernel changed so ('count=1')
                fns.update({f"fused_count_v_{spec}": _variant(spec, fns["fused_count"])
                            for spec in count_variants})  # fmt: skip
            for n, fn in other.items():  # each routes as the kernel does
                got = fn()
                if not (torch.equal(got.ids, out.ids)
                        and torch.allclose(got.weights, out.weights, rtol=1e-5, atol=1e-6)):
                    raise AssertionError(f"{name} T={T}: {n[6:]} changed the routing")
            fns.update(other)
            ms = time_ms_interleaved(fns, dev, cuda_graph=on_gpu, rounds=8, samples=32)
            row = {"model": name, "T": T, "torch_us": round(ms["torch"] * 1e3, 2),
                   "fused_us": round(ms["fused"] * 1e3, 2),
                   "torch_over_fused": round(ms["torch"] / ms["fused"], 3),
                   "tokens_differing": differ}  # fmt: skip
            extra = [n for n in fns if n.startswith(("fused_tile", "fused_count", "fused_v_"))]
            row.update({f"{n}_us": round(ms[n] * 1e3, 2) for n in extra})
            rows.append(row)
            shown = "".join(f"  {n[6:]} {row[f'{n}_us']:8.2f}" for n in extra)
            print(f"{name:16s} T={T:6d}  torch {row['torch_us']:8.2f} us  fused "
                  f"{row['fused_us']:8.2f} us  x{row['torch_over_fused']:.2f}  differ {differ}"
                  f"{shown}")
    layer_rows = []
    layers = option("--layers", "")
    layer_batches = option("--layer-batches", "1,16,256,4096" if on_gpu else "1,5")
    for job in filter(None, layers.split(",")):
        layer_rows += _time_layer(job, [int(b) for b in layer_batches.split(",")], dev, on_gpu,
                                  compiled="--compiled" in sys.argv,
                                  record="--record" in sys.argv, gdc="--gdc" in sys.argv,
                                  variants=variants)
    dtype_name = str(logits_dtype).removeprefix("torch.")
    name = option("--out-name", "router.json" if logits_dtype == torch.bfloat16
                  else f"router_{dtype_name}.json")  # fmt: skip
    write_probe(name, {"logits_dtype": str(logits_dtype), "rows": rows, "layers": layer_rows})


def _patched(fn, *changes):
    """fn() with each (object, attribute, value) of `changes` set while it runs."""

    def run():
        with contextlib.ExitStack() as stack:
            for obj, attr, value in changes:
                stack.enter_context(mock.patch.object(obj, attr, value))
            return fn()

    return run


def _tiled(n: int, fused):
    """`fused` with the kernel taking n tokens a program (fewer where T is smaller)."""
    return _patched(fused, (router, "tokens_per_program",
                            lambda T, EP, score_bytes=2: max(1, min(next_pow2(T), n))))


def _time_layer(job: str, batches: list[int], dev: str, on_gpu: bool,
                compiled: bool, record: bool, gdc: bool, variants: list[str]) -> list[dict]:
    """MoE.forward with the routing in PyTorch ops, then fused, in turns, per batch size; with
    `compiled`, also the layer under torch.compile (Inductor, no CUDA graphs of its own: the
    timing captures them) with each routing: Inductor's code for the PyTorch ops against the op
    moekit::route."""
    model, tp, ep = job.split(":")
    spec = sweep_spec(model, tp_size=int(tp), ep_size=int(ep), batch_sizes=tuple(batches))
    module = build_layer(spec)
    # one graph per batch size, routing and recorder (the probe flips the layer's mode between
    # calls); the graphs of the job before are dropped, since both layers run one `forward`
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               8 * len(batches))
    step = torch.compile(module, fullgraph=True, dynamic=False) if compiled else None
    cfg = module.config
    rows = []
    for T in batches:
        x = torch.randn(T, cfg.hidden_size, device=dev, dtype=cfg.torch_dtype)
        logits = torch.randn(T, cfg.num_experts, device=dev, dtype=cfg.torch_dtype)

        def call(fused: str, layer=module, x=x, logits=logits):
            module.fused_router = fused  # the layer's MOEKIT_FUSED_ROUTER mode
            return layer(x, logits)

        ref, out = call("off"), call("on")
        ref, out = ref.float(), out.float()
        err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-9))
        fns = {"torch": lambda: call("off"), "fused": lambda: call("on")}
        if gdc:  # the routing kernel without letting the runner's first kernel start early
            fns["fused_no_gdc"] = _without_gdc(lambda: call("on"))
        for spec in variants:
            fns[f"fused_v_{spec}"] = _variant(spec, lambda: call("on"))
        if step is not None:
            fns["compiled_torch"] = lambda: call("off", step)
            fns["compiled_fused"] = lambda: call("on", step)
        if record:
            rec = ExpertLoadRecorder(cfg.total_experts, dev)

            def counting(rec=rec):
                return _recorded(module, rec, lambda: call("on"))

            def then_count(rec=rec, x=x, logits=logits):
                module.fused_router = "on"
                return _recorded(module, rec, lambda: module.forward_topk(x, module.route(logits)))

            fns["fused_counting"], fns["fused_then_count"] = counting, then_count
            if step is not None:  # compiled, counting inside moekit::route
                fns["compiled_counting"] = lambda rec=rec: _recorded(
                    module, rec, lambda: call("on", step))
        ms = time_ms_interleaved(fns, dev, cuda_graph=on_gpu, rounds=8, samples=32)
        us = {name: round(t * 1e3, 2) for name, t in ms.items()}
        row = {"job": f"{model} tp{tp} ep{ep}", "T": T, "torch_us": us["torch"],
               "fused_us": us["fused"], "torch_over_fused": round(ms["torch"] / ms["fused"], 3),
               "max_rel_diff": err}  # fmt: skip
        line = (f"layer {row['job']:22s} T={T:6d}  torch-routed {us['torch']:8.2f} us  fused "
                f"{us['fused']:8.2f} us  x{row['torch_over_fused']:.3f}  diff {err:.2e}")
        if step is not None:
            ratio = round(ms["compiled_torch"] / ms["compiled_fused"], 3)
            row.update(compiled_torch_us=us["compiled_torch"],
                       compiled_fused_us=us["compiled_fused"], compiled_torch_over_fused=ratio)
            line += (f"  | compiled: torch-routed {us['compiled_torch']:8.2f} fused "
                     f"{us['compiled_fused']:8.2f} x{row['compiled_torch_over_fused']:.3f}")
        if gdc:
            row.update(fused_no_gdc_us=us["fused_no_gdc"],
                       no_gdc_over_fused=round(ms["fused_no_gdc"] / ms["fused"], 3))
            line += f"  | no gdc {us['fused_no_gdc']:8.2f} x{row['no_gdc_over_fused']:.3f}"
        for spec in variants:
            ratio = round(ms[f"fused_v_{spec}"] / ms["fused"], 3)
            row[f"v_{spec}_over_fused"] = ratio
            line += f"  | {spec} {us[f'fused_v_{spec}']:8.2f} x{ratio:.3f}"
        if record:
            row.update(fused_counting_us=us["fused_counting"],
                       fused_then_count_us=us["fused_then_count"])
            line += (f"  | recorded: in-kernel {us['fused_counting']:8.2f} after "
                     f"{us['fused_then_count']:8.2f}")
            if step is not None:
                row.update(compiled_counting_us=us["compiled_counting"])
                line += f" compiled {us['compiled_counting']:8.2f}"
        rows.append(row)
        print(line)
    return rows


def _variant(spec: str, fn):
    """fn() with `router.ROUTE_KERNEL` changed as spec says ('group_tile=1,num_warps=0'); a
    field tokens=n also sets n tokens a program (fewer where T is smaller), as `_tiled`."""
    from dataclasses import replace

    fields = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
    n = fields.pop("tokens", None)
    fn = fn if n is None else _tiled(n, fn)
    return _patched(fn, (router, "ROUTE_KERNEL", replace(router.ROUTE_KERNEL, **fields)))


def _without_gdc(fn):
    """fn() with the routing kernel (and an EP rank's local-ids kernel) not letting the next
    kernel start early: the chain of programmatic dependent launches from the runner on only."""
    from moekit.dispatch import _kernels as dispatch_kernels

    def off(device):
        return False

    return _patched(fn, (router, "pdl_capable", off), (dispatch_kernels, "pdl_capable", off))


def _recorded(layer, recorder, fn):
    """fn() with the layer's expert load recorded by `recorder` (made once, outside captures)."""
    layer.expert_load = recorder
    try:
        return fn()
    finally:
        layer.expert_load = None


if __name__ == "__main__":
    main()
