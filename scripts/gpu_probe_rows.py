"""Time the glue kernels of the `deep_gemm` / `cutlass` runners on the preset shapes (GPU):
`gemm_rows` (gather + fp8 quantization before gate_up, activation + quantization before down)
over a grid of `RowsTiling`s, `group_rows` (triton alignment path against the torch ops) and
`weighted_reduce`; and the token-group quantization of x (`quantize_act`'s kernel) at
several tile sizes. Bandwidth = bytes read + written / time (L2 hits count as reads).

Usage (repo root, device machine): python scripts/gpu_probe_rows.py [--quick] [--only NAME]
  (NAME: a shape name below, e.g. gpt-oss)
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from moekit.experts import ActivationSpec
from moekit.report import metadata
from moekit.runners import _cutlass_kernels as kernels
from moekit.runners._grouped import group_rows

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_profile_deep_gemm import time_us as profile_time_us  # noqa: E402

SHAPES = [  # name, T, K, E local, E global, H, I
    ("qwen3", 4096, 8, 128, 128, 2048, 768),
    ("qwen3", 16384, 8, 128, 128, 2048, 768),
    ("deepseek-ep8", 16384, 8, 32, 256, 7168, 2048),
    ("gpt-oss", 4096, 4, 128, 128, 2880, 2880),
    ("gpt-oss", 16384, 4, 128, 128, 2880, 2880),
]
# the activation before down, and whether gate_up has biases (default: silu, none)
ACTS = {"gpt-oss": (ActivationSpec("swiglu_oai", interleaved=True), True)}
QUANT_TILES = (1024, 2048, 4096)  # ActQuantTiles.max_elems of the x quantization


def time_us(fn) -> float:
    """Best of three timings of `fn` (gpu_profile_deep_gemm.time_us), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    return min(profile_time_us(fn) for _ in range(3))


def quant_tiles(x: torch.Tensor) -> dict:
    """x [T, H] quantized per token and group of 128 (fp8) with each `QUANT_TILES` max_elems:
    us, GB/s (x read, q and scales written), and whether q and the scales equal the default's."""
    from moekit.quant import act_quant
    from moekit.quant._act_kernels import launch_quant_rows

    T, H = x.shape
    n = -(-H // 128)
    ref_q, ref_s = act_quant.quantize_act(x, "token_group", torch.float8_e4m3fn, group_size=128)
    out = {}
    for max_elems in QUANT_TILES:
        tile = act_quant.ActQuantTiles(max_elems=max_elems)
        q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
        s = torch.empty(T, n, device=x.device)

        def call(q=q, s=s, tile=tile):
            launch_quant_rows(x, q, s, s, 128, n, act_quant.FP8_MAX, act_quant.EPS, False,
                              False, tile)  # fmt: skip

        us = time_us(call)
        same = torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)
        out[max_elems] = {"us": round(us, 1), "GB/s": round(T * H * 3 / us / 1e3),
                          "equal_default": same}  # fmt: skip
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    out = {"meta": metadata(command=" ".join(["python", *sys.argv]))}
    tilings = [kernels.RowsTiling(r, g, w) for r, g, w in itertools.product(
        (8, 16, 32) if not quick else (8,), (2, 4, 8), (4, 8))]  # fmt: skip
    for t in (kernels.ROWS_TILING, kernels.ROWS_TILING_ACT):
        if t not in tilings:
            tilings.append(t)
    for name, T, K, E, Eg, H, I in SHAPES:
        if only is not None and name != only:
            continue
        ids = torch.rand(T, Eg, device="cuda").argsort(dim=1)[:, :K].int()
        ids = torch.where(ids < E, ids, -1)
        x = torch.randn(T, H, device="cuda").bfloat16()
        key = f"{name} T={T}"
        res = out[key] = {}
        tri = group_rows(ids, E, 128, use_triton=True)
        ref = group_rows(ids, E, 128)
        same = all(torch.equal(getattr(tri, f), getattr(ref, f))
                   for f in ("token_M", "expert_M", "row_TK", "ends_E", "counts_E"))  # fmt: skip
        res["group_rows_us"] = {
            "triton": time_us(lambda: group_rows(ids, E, 128, use_triton=True)),
            "torch": time_us(lambda: group_rows(ids, E, 128)),
            "equal": same,
        }
        rows = tri
        used = rows.ends_E[-1:]
        n_rows = int(used.item())
        pairs = int((rows.expert_M >= 0).sum().item())
        M = rows.num_rows
        h = torch.randn(M, 2 * I, device="cuda").bfloat16()
        act, bias = ACTS.get(name, (ActivationSpec("silu"), False))
        b13 = torch.randn(E, 2 * I, device="cuda").bfloat16() if bias else None
        jobs = {
            "gather": (x, dict(token_M=rows.token_M), pairs * H * (2 + 1)),
            "act": (h, dict(act=act, b13_EN=b13), pairs * (4 * I + I)),
        }
        for job, (src, kw, nbytes) in jobs.items():
            for quant in (True, False):
                q_bytes = nbytes if quant else nbytes + pairs * (H if job == "gather" else I)
                ref_q, ref_s = kernels.gemm_rows_torch(src, rows.expert_M, quant=quant,
                                                       rows_per_group=M, **kw)  # fmt: skip
                times = {}
                for t in tilings:
                    def call(t=t):
                        return kernels.gemm_rows_triton(src, rows.expert_M, quant=quant,
                                                        rows_per_group=M, used=used, tiling=t,
                                                        **kw)  # fmt: skip
                    q, s = call()
                    keep = rows.expert_M >= 0
                    ok = torch.equal(q[keep].float(), ref_q[keep].float())
                    if quant:
                        ok = ok and torch.equal(s[0][:, keep], ref_s[0][:, keep])
                    times[str(t)] = (time_us(call), ok)
                best = min(times, key=lambda k: times[k][0])
                dflt = str(kernels.ROWS_TILING if job == "gather" else kernels.ROWS_TILING_ACT)
                res[f"{job} quant={quant}"] = {
                    "default": times[dflt], "best": (best, times[best]),
                    "GB/s default": q_bytes / times[dflt][0] / 1e3,
                    "GB/s best": q_bytes / times[best][0] / 1e3,
                    "all_equal_twin": all(v[1] for v in times.values()),
                }  # fmt: skip
                print(f"{key} {job} quant={quant}: default {times[dflt][0]:.1f} us "
                      f"({q_bytes / times[dflt][0] / 1e3:.0f} GB/s), best {best} "
                      f"{times[best][0]:.1f} us ({q_bytes / times[best][0] / 1e3:.0f} GB/s); "
                      f"all equal twin {res[f'{job} quant={quant}']['all_equal_twin']}",
                      flush=True)  # fmt: skip
        y = torch.randn(M, H, device="cuda").bfloat16()
        w = torch.rand(T, K, device="cuda")
        red = kernels.weighted_reduce_triton(y, rows.row_TK, w, ids, None, H, torch.bfloat16)
        red_ref = kernels.weighted_reduce_torch(y, rows.row_TK, w, ids, None, H, torch.bfloat16)
        red_us = time_us(lambda: kernels.weighted_reduce_triton(y, rows.row_TK, w, ids, None, H,
                                                                torch.bfloat16))  # fmt: skip
        red_bytes = (pairs + T) * H * 2
        diff = (red.float() - red_ref.float()).abs().max().item()
        res["weighted_reduce"] = {"us": red_us, "GB/s": red_bytes / red_us / 1e3,
                                  "max_abs_diff": diff}  # fmt: skip
        print(f"{key} group_rows {res['group_rows_us']}; weighted_reduce {red_us:.1f} us "
              f"({red_bytes / red_us / 1e3:.0f} GB/s); used rows {n_rows} of {M}", flush=True)
        res["quantize_x"] = quant_tiles(x)
        print(f"{key} quantize x: {res['quantize_x']}", flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "rows_probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
