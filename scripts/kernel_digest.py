"""Compile the `triton` runner's kernels for sm_90 on the CPU, with no GPU or driver, and
write one digest of each compiled kernel's PTX: a change to the kernels' source whose
digests all stay the same leaves the GPU code, and so its speed, as it was.

The calls are the runner's own (`ops.fused_moe` with the configs of the shipped tables of
--devices, for each preset shape, format and batch size; `ops.fused_moe_masked` on EP
shapes), made with every Triton launch turned into a compile-only warmup. Weights are
uninitialised tensors of the real shapes: nothing runs, so no value is read. OUT.json holds
{"kernels": {kernel key: PTX digest}, "calls": {call: [kernel keys it launched]},
"resources": {kernel key: {"REG": n, "STACK": bytes, ...}} (with --resources)}; --ptx DIR
also writes each kernel's PTX (source locations and comments dropped) as DIR/DIGEST.ptx.

  python scripts/kernel_digest.py OUT.json [--models M ..] [--formats F ..] [--batches T ..]
                                           [--devices h100 h200] [--ptx DIR] [--resources]
  python scripts/kernel_digest.py --compare BEFORE.json AFTER.json   (exit 1: a change)

ptxas: $TRITON_PTXAS_PATH, else the one on PATH.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

FORMATS = ("unquantized", "fp8_w8a8", "fp8_w8a8:weight_scale=channel",
           "fp8_w8a8:weight_scale=tensor",
           "fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor", "int8_w8a8",
           "int8_w8a16", "int4_w4a16", "int4_w4a16:group_size=32", "mxfp4", "nvfp4")  # fmt: skip
MODELS = {"qwen3-30b-a3b": (1, 1), "mixtral-8x7b": (2, 1), "deepseek-v3": (8, 8),
          "gpt-oss-120b": (1, 1), "kimi-k2": (8, 8), "qwen3-235b-a22b": (8, 8)}  # fmt: skip
BATCHES = (1, 4, 16, 64, 256, 1024, 4096, 16384)
MASKED_CAPACITIES = (8, 64, 512)
DEVICES = {"h100": ("NVIDIA H100 80GB HBM3", (9, 0)), "h200": ("NVIDIA H200", (9, 0))}


@dataclass
class Launches:
    """What the runner launched: each compiled kernel under its key (name and
    specialization), and per call (named by `now` while it runs) the keys it launched."""

    now: str = ""
    kernels: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)


def _compile_only() -> Launches:
    """Point Triton at an sm_90 target with no driver and make every launch a warmup (compile,
    no run), recorded in the Launches returned."""
    if not os.environ.get("TRITON_PTXAS_PATH") and shutil.which("ptxas"):
        os.environ["TRITON_PTXAS_PATH"] = shutil.which("ptxas")
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class Sm90NoDriver(DriverBase):
        def is_active(self):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(Sm90NoDriver())
    seen = Launches()
    run = JITFunction.run

    def warmup_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        cache = self.device_caches[0][0]
        key = f"{self.fn.__qualname__} {next(k for k, v in cache.items() if v is kernel)}"
        seen.kernels[key] = kernel
        seen.calls.setdefault(seen.now, []).append(key)
        return kernel

    JITFunction.run = warmup_only
    return seen


_NOISE = re.compile(r"^\s*(\.loc|\.file|//|\$L__tmp\d+:)")


def ptx_code(ptx: str) -> str:
    """The PTX without source locations, their labels, comments and debug sections."""
    ptx = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(ln for ln in ptx.splitlines() if not _NOISE.match(ln))


def resource_usage(cubin: bytes) -> dict:
    """{'REG': n, 'STACK': bytes, 'SHARED': bytes, ...} of a one-kernel cubin (cuobjdump)."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    tool = tool if os.path.exists(tool) else shutil.which("cuobjdump") or "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", line)}


def _weights(model: str, fmt: str):
    """Uninitialised ExpertWeights of `model`'s per-rank shape in format `fmt`: one expert
    quantized for real (the tensors' dtypes and shapes), then E experts' empty tensors."""
    from dataclasses import fields, replace

    from moekit.quant import make_spec, quantize_experts
    from moekit.tune import random_weights, shape_for

    tp, ep = MODELS[model]
    shape = shape_for(model, tp, ep)
    one = random_weights(replace(shape, num_experts=1), "cpu")
    if fmt != "unquantized":
        static = make_spec(fmt).act_scheme == "static_tensor"  # calibrated scales needed
        one = quantize_experts(one, fmt, **dict.fromkeys(("a13_scale", "a2_scale"),
                                                         1.0 if static else None))  # fmt: skip
    grown = {}
    for f in fields(one):
        t = getattr(one, f.name)
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == 1:
            grown[f.name] = torch.empty((shape.num_experts, *t.shape[1:]), dtype=t.dtype)
    return shape, replace(one, **grown)


def _calls(models, formats, batches, devices, seen: Launches) -> None:
    """The runner's calls, each named in seen.now while it runs: 'MODEL FORMAT T=n DEVICE' or
    'MODEL FORMAT masked C=n'."""
    from moekit.runners.triton import ops
    from moekit.runners.triton.configs import get_config
    from moekit.runners.triton.ops import quant_tag
    from moekit.tune import uniform_topk

    # as on an sm_90 GPU (the runner's own answer is no for CPU tensors)
    ops.decode_pdl = lambda x, pairs: pairs <= ops.PIPELINE.decode_max_pairs and ops.PIPELINE.pdl
    for model in models:
        for fmt in formats:
            try:
                shape, w = _weights(model, fmt)
            except ValueError as e:  # a format this shape cannot take (group size)
                print(f"skip {model} {fmt}: {e}", file=sys.stderr)
                continue
            E, K, H, I = shape.num_experts, shape.top_k, shape.hidden, shape.intermediate
            quant = quant_tag(w.spec)
            for (dev, cap), T in itertools.product(devices, batches):
                key = T * shape.local_share
                cfgs = tuple(get_config(g, key, K, E, H, I, "bfloat16", dev, quant, cap)
                             for g in ("gate_up", "down"))  # fmt: skip
                x = torch.empty(T, H, dtype=torch.bfloat16)
                topk = uniform_topk(T, E, K, "cpu")
                seen.now = f"{model} {fmt} T={T} {dev}"
                ops.fused_moe(x, topk, w, shape.act, cfgs, local_share=shape.local_share)
            if shape.local_share < 1:
                for C in MASKED_CAPACITIES:
                    x = torch.empty(E, C, H, dtype=torch.bfloat16)
                    seen.now = f"{model} {fmt} masked C={C}"
                    ops.fused_moe_masked(x, torch.zeros(E, dtype=torch.int32), w, shape.act)
            print(f"{model} {fmt}: done", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), help="--quantization specs")
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--devices", nargs="+", default=list(DEVICES), choices=list(DEVICES),
                   help="whose shipped tables give the configs")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--ptx", metavar="DIR", help="also write each kernel's PTX there, named by "
                   "its digest")
    p.add_argument("--resources", action="store_true", help="also record each kernel's "
                   "registers, stack (spills) and static (cuobjdump) and dynamic shared memory")
    a = p.parse_args(argv)
    if a.compare:
        before, after = (json.load(open(f))["kernels"] for f in a.compare)
        changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
        only = sorted(before.keys() ^ after.keys())
        for k in changed:
            print("changed:", k)
        for k in only:
            print("only in", "before:" if k in before else "after:", k)
        print(f"{len(before.keys() & after.keys()) - len(changed)} same, {len(changed)} changed, "
              f"{len(only)} in one file only")  # fmt: skip
        return 1 if changed or only else 0
    if not a.out:
        p.error("OUT.json: where to write the digests (or --compare BEFORE.json AFTER.json)")
    seen = _compile_only()
    t0 = time.time()
    _calls(a.models, a.formats, a.batches, [DEVICES[d] for d in a.devices], seen)
    digests, resources = {}, {}
    for name, kern in sorted(seen.kernels.items()):
        if a.resources:
            resources[name] = resource_usage(kern.asm["cubin"]) | {
                "SHARED_DYNAMIC": kern.metadata.shared}
        code = ptx_code(kern.asm["ptx"])
        digests[name] = hashlib.sha256(code.encode()).hexdigest()[:16]
        if a.ptx:
            os.makedirs(a.ptx, exist_ok=True)
            with open(os.path.join(a.ptx, digests[name] + ".ptx"), "w") as f:
                f.write(code)
    with open(a.out, "w") as f:
        json.dump({"kernels": digests, "calls": seen.calls, "resources": resources}, f,
                  indent=1, sort_keys=True)  # fmt: skip
    print(f"{len(seen.calls)} calls, {len(digests)} kernels compiled in {time.time() - t0:.0f} s "
          f"-> {a.out}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
