"""The fp8 activation quantizers of this tree against a baseline tree's, in turns, on the GPU.

    git archive REV src/moekit | tar x -C BASE      # the baseline's sources, e.g. into ab_base/
    PYTHONPATH=src python3 scripts/gpu_probe_quant_ab.py --baseline BASE/src [--batches 16384]
        [--out NAME]    # writes $OUT/NAME.json (default quant_ab.json)

Times, per preset's per-rank fp8 shape (`gpu_probe_glue.PRESETS`) and batch size, this tree's
and the baseline's kernels that quantize activations to fp8 per 128 columns, outputs compared
bit for bit on the rows in use:
- act: the activation rows before down (`_cutlass_kernels.gemm_rows_triton`, act + quant);
- rows: the gather that quantizes each gathered row (`tokens_first=False`);
- x: `quantize_act(x, 'token_group')` of the layer's input x [T, H].
Then a check of the division alone (`_act_kernels.div_by_scale` against `tl.div_rn`) over
random groups: values whose quotient differs, among all and among those with |x| >= 2^-100
and x / s a normal float32 number, and fp8 values that differ.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from moekit.bench import time_ms_interleaved
from moekit.quant import _act_kernels as act_new
from moekit.quant.act_quant import TILES
from moekit.runners import _cutlass_kernels as kern_new
from moekit.runners._grouped import group_rows
from moekit.sweep import make_routing

sys.path.insert(0, os.path.dirname(__file__))
from gpu_probe_glue import ALIGN, PRESETS, same  # noqa: E402
from probe_out import option, write_probe  # noqa: E402


def load(path: Path, name: str):
    """The module at `path` (a baseline's file) under `name`; its own imports resolve to this
    tree's package."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def quant_x(mod, x):
    """quantize_act(x, 'token_group') through module `mod`'s kernel."""
    T, H = x.shape
    n = triton.cdiv(H, 128)
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(T, n, dtype=torch.float32, device=x.device)
    mod.launch_quant_rows(x, q, s, s, 128, n, 448.0, 1e-10, False, False, TILES)
    return q, s


def point(name: str, T: int, base, gen: torch.Generator) -> dict:
    experts, E, K, H, I, act, bias = PRESETS[name]
    topk = make_routing(T, experts, K, generator=gen, device="cuda")
    ids = torch.where(topk.ids < E, topk.ids, -1).to(torch.int32)
    rows = group_rows(ids, E, align=ALIGN, use_triton=True)
    M, used = rows.num_rows, rows.ends_E[-1:]
    in_use = (rows.expert_M >= 0) & (torch.arange(M, device="cuda") < used)

    def rows_of(out):
        q, s = out
        return [q[in_use], s.permute(0, 2, 1).reshape(M, -1)[in_use]]

    h = (torch.randn(M, 2 * I, generator=gen) * 3).to("cuda", torch.bfloat16)
    b13 = torch.randn(E, 2 * I, generator=gen).to("cuda", torch.bfloat16) if bias else None
    x = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    kinds = {
        "act": (lambda k: lambda: k.gemm_rows_triton(h, rows.expert_M, act=act, b13_EN=b13,
                                                     quant=True, rows_per_group=ALIGN, used=used),
                rows_of),
        "rows": (lambda k: lambda: k.gemm_rows_triton(x, rows.expert_M, token_M=rows.token_M,
                                                      quant=True, rows_per_group=ALIGN, used=used,
                                                      tokens_first=False), rows_of),
        "x": (lambda m: lambda: quant_x(m, x), lambda out: list(out)),
    }  # fmt: skip
    res = {}
    for kind, (make, keep) in kinds.items():
        mods = (act_new, base["act"]) if kind == "x" else (kern_new, base["kern"])
        fns = {"new": make(mods[0]), "baseline": make(mods[1])}
        equal = same(keep(fns["new"]()), keep(fns["baseline"]()))
        ms = time_ms_interleaved(fns, "cuda", rounds=5, samples=25)
        new_us, base_us = ms["new"] * 1e3, ms["baseline"] * 1e3
        res[kind] = {"new_us": round(new_us, 1), "baseline_us": round(base_us, 1),
                     "baseline/new": round(base_us / new_us, 3), "equal": equal}  # fmt: skip
        print(f"{name} T={T} {kind}: {res[kind]}", flush=True)
    return res


@triton.jit
def _both_divisions(x_ptr, a_ptr, b_ptr, GROUP: tl.constexpr):
    """Row-group g: s = max(amax, 1e-10) / 448; a = div_rn(x, s), b = div_by_scale(x, s)."""
    offs = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + offs)
    s = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), 448.0)
    tl.store(a_ptr + offs, tl.div_rn(x, s))
    tl.store(b_ptr + offs, act_new.div_by_scale(x, s))


def division_check(groups: int, rounds: int, gen: torch.Generator) -> dict:
    """div_by_scale against div_rn on bf16 values of random magnitudes (2^-100 .. 2^100 a group,
    some groups holding subnormals)."""
    out = {"values": 0, "differ": 0, "differ_normal": 0, "fp8_differ": 0}
    tiny = torch.finfo(torch.float32).tiny
    for _ in range(rounds):
        mag = torch.exp2(torch.randint(-100, 100, (groups, 1), generator=gen).float())
        x = (torch.randn(groups, 128, generator=gen) * mag).bfloat16().float().cuda()
        a, b = torch.empty_like(x), torch.empty_like(x)
        _both_divisions[(groups,)](x, a, b, GROUP=128)
        differ = a != b
        normal = (x.abs() >= 2.0**-100) & (a.abs() >= tiny)
        out["values"] += x.numel()
        out["differ"] += int(differ.sum())
        out["differ_normal"] += int((differ & normal).sum())
        out["fp8_differ"] += int((a.to(torch.float8_e4m3fn).float() !=
                                  b.to(torch.float8_e4m3fn).float()).sum())  # fmt: skip
    return out


def main() -> None:
    base_src = Path(option("--baseline", "ab_base/src"))
    base = {"kern": load(base_src / "moekit/runners/_cutlass_kernels.py", "base_cutlass_kernels"),
            "act": load(base_src / "moekit/quant/_act_kernels.py", "base_act_kernels")}  # fmt: skip
    batches = [int(b) for b in option("--batches", "16384").split(",")]
    gen = torch.Generator().manual_seed(0)
    res: dict = {"command": " ".join(["python", *sys.argv]), "points": {}}
    for name in PRESETS:
        for T in batches:
            res["points"][f"{name} T={T}"] = point(name, T, base, gen)
    res["division"] = division_check(1 << 16, 64, gen)
    print("division:", res["division"], flush=True)
    write_probe(option("--out", "quant_ab") + ".json", res)


if __name__ == "__main__":
    main()
