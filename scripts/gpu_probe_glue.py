"""The `deep_gemm` runner's row kernels on the presets' fp8 shapes, at several tilings, in turns.

    PYTHONPATH=src python3 scripts/gpu_probe_glue.py [--batches 4096,16384] [--only gpt-oss]
        [--out NAME]    # writes $OUT/NAME.json (default glue_probe.json)

Per preset (issue 3's per-rank shapes; deepseek-v3 EP8 as rank 0, which sees every token and
holds experts 0-31) and batch size T, on a uniform random routing and the runner's row layout
(`group_rows`, 128-row groups), each kernel of the layer that is not a GEMM, timed in turns
(CUDA-graph replay) over its variants:
- gather: the fp8 rows of x before gate_up, the tokens quantized first then copied
  (`tokens_first`) or each gathered row quantized, at several `RowsTiling`s;
- act: the activation of h [M, 2I] (random bf16; with gpt-oss's biases) into fp8 rows, at
  several `RowsTiling`s.
Every variant's output is compared bit for bit with the first variant of its kernel (the
shipped one) on the rows in use.

    PYTHONPATH=src python3 scripts/gpu_probe_glue.py --layer [--batches 4096,16384]

instead times the `deep_gemm` runner on deepseek-v3 EP8's fp8 layer (rank 0, `moekit bench`'s
input sets, dispatched once), in turns: as dispatched (local share 1/8: the gather quantizes
each row, the row kernels' grids sized for the local pairs) and with the local share forced to
1 (the tokens quantized first, grids sized for the static row bound), outputs compared.
"""

from __future__ import annotations

import os
import sys

import torch

from moekit.bench import l2_cache_bytes, time_ms_interleaved
from moekit.experts import ActivationSpec
from moekit.runners import _cutlass_kernels as kern
from moekit.runners._grouped import group_rows
from moekit.sweep import make_routing

sys.path.insert(0, os.path.dirname(__file__))
from probe_out import option, write_probe  # noqa: E402

# name: (experts routed over, local experts, K, H, I, activation, biases)
PRESETS = {
    "qwen3-30b-a3b": (128, 128, 8, 2048, 768, ActivationSpec("silu"), False),
    "mixtral-8x7b-tp2": (8, 8, 2, 4096, 7168, ActivationSpec("silu"), False),
    "deepseek-v3-ep8": (256, 32, 8, 7168, 2048, ActivationSpec("silu"), False),
    "gpt-oss-120b": (128, 128, 4, 2880, 2880, ActivationSpec("swiglu_oai", True), True),
}
ALIGN = 128
GATHER = [(16, 2, 4, 4096), (16, 2, 4, 2048), (16, 2, 4, 1024), (16, 2, 4, 512), (8, 4, 4, 4096),
          (8, 4, 4, 1024), (32, 4, 8, 4096), (32, 4, 8, 1024), (32, 2, 4, 1024)]  # fmt: skip
ACT = [(8, 2, 4, 4096), (8, 2, 4, 2048), (8, 2, 4, 1024), (8, 2, 4, 512), (4, 4, 4, 4096),
       (4, 4, 4, 1024)]  # fmt: skip
KINDS = ("gather", "act")


def same(a, b) -> bool:
    return all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))


def timed(fns: dict, outs: dict, keep) -> dict:
    ms = time_ms_interleaved(fns, "cuda", rounds=5, samples=25)
    first = next(iter(outs.values()))
    return {name: {"us": round(ms[name] * 1e3, 1), "equal": same(keep(outs[name]), keep(first))}
            for name in fns}  # fmt: skip


def point(name: str, T: int, gen: torch.Generator) -> dict:
    experts, E, K, H, I, act, bias = PRESETS[name]
    topk = make_routing(T, experts, K, generator=gen, device="cuda")
    ids = torch.where(topk.ids < E, topk.ids, -1).to(torch.int32)  # rank 0's experts 0 .. E-1
    rows = group_rows(ids, E, align=ALIGN, use_triton=True)
    M, used = rows.num_rows, rows.ends_E[-1:]
    in_use = (rows.expert_M >= 0) & (torch.arange(M, device="cuda") < used)
    local_pairs = int((ids >= 0).sum())
    res: dict = {"rows_in_use": int(in_use.sum()), "local_pairs_per_token": local_pairs / T}

    def rows_of(out):
        q, s = out
        return [q[in_use], s.permute(0, 2, 1).reshape(M, -1)[in_use]]

    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    fns, outs = {}, {}
    for first in (True, False):
        for br, bg, nw, progs in GATHER:
            til = kern.RowsTiling(br, bg, nw, progs)
            label = f"{'tokens' if first else 'rows'} r{br} g{bg} w{nw} p{progs}"

            def fn(til=til, first=first):
                return kern.gemm_rows_triton(x, rows.expert_M, token_M=rows.token_M, quant=True,
                                             rows_per_group=ALIGN, used=used, tiling=til,
                                             tokens_first=first)  # fmt: skip

            fns[label], outs[label] = fn, fn()
    res["gather"] = timed(fns, outs, rows_of)

    h = (torch.randn(M, 2 * I, generator=gen) * 3).to("cuda", torch.bfloat16)
    b13 = torch.randn(E, 2 * I, generator=gen).to("cuda", torch.bfloat16) if bias else None
    fns, outs = {}, {}
    for br, bg, nw, progs in ACT:
        til = kern.RowsTiling(br, bg, nw, progs)

        def fn(til=til):
            return kern.gemm_rows_triton(h, rows.expert_M, act=act, b13_EN=b13, quant=True,
                                         rows_per_group=ALIGN, used=used, tiling=til)  # fmt: skip

        label = f"r{br} g{bg} w{nw} p{progs}"
        fns[label], outs[label] = fn, fn()
    res["act"] = timed(fns, outs, rows_of)

    return res


def layer_ab(batches) -> dict:
    """deep_gemm on deepseek-v3 EP8 fp8, the dispatched local share against 1.0, in turns."""
    import dataclasses

    from moekit.config import RunnerConfig
    from moekit.layer import RunnerCache, run_experts
    from moekit.select_tune import sweep_spec
    from moekit.sweep import _input_sets, build_layer

    spec = sweep_spec("deepseek-v3", tp_size=8, ep_size=8, quantization="fp8_w8a8",
                      batch_sizes=tuple(batches), backends=("deep_gemm",))  # fmt: skip
    module = build_layer(spec)
    module.runners = RunnerCache(RunnerConfig("deep_gemm"))
    gen = torch.Generator().manual_seed(spec.seed)
    out = {}
    for T in batches:
        sets = _input_sets(spec, module, T, gen, l2_cache_bytes("cuda"))[0]
        with torch.no_grad():
            shares = [module.dispatcher.dispatch(x, topk) for x, topk in sets]
        forced = [dataclasses.replace(d, local_share=1.0) for d in shares]

        def over(ds):
            @torch.no_grad()
            def fn():
                return [run_experts(d, module.expert_weights, module.act, module.runners).out
                        for d in ds]  # fmt: skip

            return fn

        new, old = over(shares), over(forced)
        equal = all(torch.equal(a, b) for a, b in zip(new(), old()))
        ms = time_ms_interleaved({"share": new, "forced_1": old}, "cuda", rounds=6, samples=36)
        out[f"T={T}"] = {"share": shares[0].local_share, "equal": equal,
                         "us_per_set": {k: round(v * 1e3 / len(sets), 1) for k, v in ms.items()},
                         "forced_1/share": round(ms["forced_1"] / ms["share"], 3)}  # fmt: skip
        print(T, out[f"T={T}"], flush=True)
    return out


def main() -> None:
    batches = [int(b) for b in option("--batches", "4096,16384").split(",")]
    only = option("--only", "")
    gen = torch.Generator().manual_seed(0)
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    if "--layer" in sys.argv:
        res["layer"] = layer_ab(batches)
        write_probe(option("--out", "glue_layer") + ".json", res)
        return
    for name in PRESETS:
        if only and only not in name:
            continue
        for T in batches:
            key = f"{name} T={T}"
            res["points"][key] = p = point(name, T, gen)
            for kind in KINDS:
                best = min(p[kind].items(), key=lambda kv: kv[1]["us"])
                first = next(iter(p[kind].values()))
                print(f"{key} {kind}: shipped {first['us']} us, best {best[0]} {best[1]['us']} "
                      f"us, all equal {all(v['equal'] for v in p[kind].values())}", flush=True)
    write_probe(option("--out", "glue_probe") + ".json", res)


if __name__ == "__main__":
    main()
