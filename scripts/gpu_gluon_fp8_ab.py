"""fp8 block-wise in the triton_kernel runner's Gluon engine: config variants against each
other and against the bf16 `triton` runner, timed in turns (`moekit.bench.time_ms_interleaved`).

    PYTHONPATH=<triton 3.9>:src python3 scripts/gpu_gluon_fp8_ab.py   # $OUT/gluon_fp8_ab.json

Per preset shape (uniform random routing, deepseek-v3 EP8 with every pair local) and T in
BATCHES: bf16 `triton` on the unquantized weights, and the engine on the same weights quantized
to fp8 (128 x 128 blocks) with `gluon_ops.FP8` and its VARIANTS (consumer partitions, stage
counts), and the engine in bf16 (`config_for`, and with consumers=2), each checked against the
torch runner on the same weights first (fp8: its dequantized math). AB_VARIANTS names them
(comma-separated); a name may end in `+field=value` edits over its config, as in
scripts/gpu_gluon_fold_ab.py (`fp8 c2+down_stages=6`).

AB_PREV_KERNELS=<path of another `_gluon_kernels.py`> (e.g. `git show REV:src/moekit/runners/
triton_kernel/_gluon_kernels.py > scripts/_prev_gluon_kernels.py`) adds each variant's twin
"<name> prev" running those kernels: a kernel change timed in turns against its parent.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_out import config_edits, write_probe

from moekit.bench import time_ms_interleaved
from moekit.quant import quantize_experts
from moekit.runners.torch import TorchRunner
from moekit.runners.triton import ops as triton_ops
from moekit.runners.triton.ops import kernel_inputs
from moekit.runners.triton_kernel import gluon_ops
from moekit.stages import StandardDispatchOutput
from moekit.tune import random_weights, seeded_batch, shape_for

PRESETS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
           "gpt-oss-120b": (1, 1)}  # fmt: skip
BATCHES = tuple(int(t) for t in os.environ.get("AB_BATCHES", "4096,16384").split(","))
ROUNDS = int(os.environ.get("AB_ROUNDS", "5"))
# name: (fp8 weights, config edits over FP8 / the bf16 layer's config_for)
VARIANTS = {
    "fp8": (True, {}),
    "fp8 c1": (True, {"consumers": 1}),
    "fp8 c2": (True, {"consumers": 2}),
    "fp8 c2 s6": (True, {"consumers": 2, "gate_up_stages": 6, "down_stages": 6}),
    "fp8 atomic": (True, {"reduce": "atomic"}),
    "fp8 g4": (True, {"group_m": 4}),
    "fp8 g16": (True, {"group_m": 16}),
    "fp8 s4": (True, {"gate_up_stages": 4, "down_stages": 4}),
    "fp8 s5": (True, {"gate_up_stages": 5, "down_stages": 5}),
    "fp8 s3": (True, {"gate_up_stages": 3, "down_stages": 3}),
    "fp8 s4 g4": (True, {"gate_up_stages": 4, "down_stages": 4, "group_m": 4}),
    "fp8 s4 g16": (True, {"gate_up_stages": 4, "down_stages": 4, "group_m": 16}),
    "bf16": (False, {}),
    "bf16 c2": (False, {"consumers": 2}),
    "bf16 dn128": (False, {"down_block_n": 128}),
    "bf16 g16": (False, {"group_m": 16}),
    "bf16 g4": (False, {"group_m": 4}),
    "bf16 s3": (False, {"gate_up_stages": 3, "down_stages": 3}),
}
AB = [n for n in os.environ.get("AB_VARIANTS", ",".join(VARIANTS)).split(",") if n]
PREV = os.environ.get("AB_PREV_KERNELS")


def _variant(name: str) -> tuple[bool, dict]:
    """A variant name (`VARIANTS`, maybe with `+field=value` edits) -> (fp8 weights, edits)."""
    base, extra = config_edits(name.removesuffix(" prev"))
    fp8, edits = VARIANTS[base]
    return fp8, {**edits, **extra}


def _prev_kernels():
    """The kernels module at AB_PREV_KERNELS, or None."""
    if not PREV:
        return None
    spec = importlib.util.spec_from_file_location("moekit_prev_gluon_kernels", PREV)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _running(kernels, fn):
    """fn with `gluon_ops` reaching `kernels` as its `_gluon_kernels` (it imports the module
    from the package at each call) while it runs."""
    import moekit.runners.triton_kernel as pkg
    from moekit.runners.triton_kernel import _gluon_kernels  # noqa: F401 - the attribute swapped

    def run():
        own = pkg._gluon_kernels
        pkg._gluon_kernels = kernels
        try:
            return fn()
        finally:
            pkg._gluon_kernels = own

    return run


def main() -> None:
    dev = torch.device("cuda")
    prev = _prev_kernels()
    names = AB + [f"{n} prev" for n in AB] * (prev is not None)
    recs = []
    for model, (tp, ep) in PRESETS.items():
        shape = shape_for(model, tp, ep)
        w = random_weights(shape, dev)
        wq = quantize_experts(w, "fp8_w8a8")
        act = shape.act
        for T in BATCHES:
            x, topk = seeded_batch(shape, T, dev)
            x_TH, ids, weights = kernel_inputs(x, topk)
            fns = {"bf16 triton": lambda: triton_ops.fused_moe(x, topk, w, act)}
            refs = {fp8: TorchRunner().run(StandardDispatchOutput(x, topk), wq if fp8 else w,
                                           act).out.float()
                    for fp8 in {_variant(n)[0] for n in AB}}  # fmt: skip
            errs = {}
            for name in AB:
                fp8, edits = _variant(name)
                wn = wq if fp8 else w
                cfg = replace(gluon_ops.config_for(wn), **edits)
                fns[name] = (lambda c=cfg, wn=wn: gluon_ops.fused_moe(x_TH, ids, weights, wn, act,
                                                                      c))  # fmt: skip
                if prev is not None:
                    fns[f"{name} prev"] = _running(prev, fns[name])
            for name in names:
                ref = refs[_variant(name)[0]]
                errs[name] = ((fns[name]().float() - ref).norm() / ref.norm()).item()
            refs = None
            ms = time_ms_interleaved(fns, dev, rounds=ROUNDS)
            rec = {"model": model, "T": T, "ms": ms, "rel_err_vs_torch": errs,
                   "bf16_triton_over": {n: ms["bf16 triton"] / ms[n] for n in names}}  # fmt: skip
            print(f"{model:<15}{T:>6}  bf16 triton {ms['bf16 triton']:.3f}  " + "  ".join(
                f"{n} {ms[n]:.3f} ({rec['bf16_triton_over'][n]:.2f}x, err {errs[n]:.4f})"
                for n in names), flush=True)  # fmt: skip
            recs.append(rec)
        w = wq = None
        torch.cuda.empty_cache()
    write_probe("gluon_fp8_ab.json", {"rounds": ROUNDS, "fp8_config": vars(gluon_ops.FP8),
                                      "variants": {n: _variant(n) for n in AB},
                                      "prev_kernels": PREV,
                                      "results": recs})  # fmt: skip


if __name__ == "__main__":
    main()
