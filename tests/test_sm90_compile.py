"""The `triton` runner's kernels built for sm_90 (Hopper) on the CPU, with no GPU
(scripts/kernel_digest.py): the code paths the interpreter never takes (TMA descriptors,
wgmma, fp8 tensor-core MMAs, the inline-asm 4-bit dequantization, programmatic dependent
launch) must compile with the shipped H100 tables' configs, and the large-batch GEMMs must
come out as Hopper's warpgroup MMAs."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PTXAS = os.environ.get("TRITON_PTXAS_PATH") or shutil.which("ptxas")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PTXAS, reason="needs ptxas (the CUDA toolkit) to build sm_90 code"),
]

MODEL = "qwen3-30b-a3b"
OPERANDS = {"unquantized": "bf16.bf16", "fp8_w8a8": "e4m3.e4m3", "int4_w4a16": "bf16.bf16",
            "mxfp4": "bf16.bf16"}  # wgmma's operand types: 4-bit formats dequantize to bf16


def test_kernels_build_for_sm90_as_hopper_code(tmp_path):
    """One test (one build, whatever the xdist split): every call at T = 1 and 4096 launches
    both GEMMs, built; at T = 4096 both run on wgmma with the format's operand types, and
    the bf16 configs load tiles through TMA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "kernel_digest.py"), str(tmp_path / "d.json"),
           "--models", MODEL, "--formats", *OPERANDS, "--batches", "1", "4096",
           "--devices", "h100", "--ptx", str(tmp_path / "ptx")]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    d = json.loads((tmp_path / "d.json").read_text())
    wrong = []
    for fmt, operands in OPERANDS.items():
        for T in (1, 4096):
            keys = d["calls"][f"{MODEL} {fmt} T={T} NVIDIA H100 80GB HBM3"]
            gemms = {}
            for key in keys:
                name = key.split()[0]
                if name in ("_gate_up_kernel", "_down_kernel"):
                    gemms[name] = (tmp_path / "ptx" / f"{d['kernels'][key]}.ptx").read_text()
            if set(gemms) != {"_gate_up_kernel", "_down_kernel"}:
                wrong.append(f"{fmt} T={T}: launched {sorted(k.split()[0] for k in keys)}")
            for name, code in gemms.items():
                if not re.search(rf"^\.visible \.entry {name}\(", code, re.M):
                    wrong.append(f"{fmt} T={T} {name}: no entry point in the PTX")
                if T == 4096 and not re.search(
                    rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32\.{operands}", code
                ):
                    wrong.append(f"{fmt} T={T} {name}: no wgmma on {operands}")
                if T == 4096 and fmt == "unquantized" and "cp.async.bulk.tensor" not in code:
                    wrong.append(f"{fmt} T={T} {name}: no TMA load")
    assert not wrong, "\n".join(wrong)


# Built in a child process: kernel_digest points Triton at an sm_90 target for the process.
_CHAIN = """
import json, re, sys, torch
sys.path.insert(0, sys.argv[1])
from kernel_digest import _compile_only
seen = _compile_only()
from moekit import router
from moekit.dispatch import _kernels as dispatch_kernels
from moekit.dispatch.slots import SlotMap
from moekit.placement import ExpertPlacement
router.pdl_capable = dispatch_kernels.pdl_capable = lambda device: True  # as on sm_90
# qwen3's routing of 16 tokens: counting an add per pair, per expert a program (a sum, a
# histogram of the ids), not counting
for seen.now, count in (("route", 1), ("route_per_expert", 2), ("route_histogram", 3),
                        ("route_uncounted", 0)):
    router.ROUTE_KERNEL = router.RouteKernelConfig(count=count)
    router._select_fused(torch.empty(16, 128, dtype=torch.bfloat16), 8, "softmax", True, None,
                         None, None, 1.0, 0,
                         counts=torch.zeros(128, dtype=torch.int64) if count else None)
router.ROUTE_KERNEL = router.RouteKernelConfig()
seen.now = "local_ids"
table, copies = SlotMap(ExpertPlacement(torch.arange(8), ep_size=2), 8)._on(torch.device("cpu"))
ids = torch.zeros(16, 2, dtype=torch.int32)
dispatch_kernels.launch_local_ids(ids, table, copies, False, torch.empty_like(ids), 4, 4)
seen.now = "grouped_one_warp"  # deepseek-v3's routing of one token, by the defaults
router._select_fused(torch.empty(1, 256, dtype=torch.bfloat16), 8, "sigmoid", True, 8, 4,
                     torch.empty(256), 2.5, 0)
print(json.dumps({call: seen.kernels[keys[0]].asm["ptx"] for call, keys in seen.calls.items()}))
"""


def test_routing_and_local_ids_build_for_sm90():
    """The routing kernel (counting an add per pair, 8 tokens a program) lets the next kernel
    start before it reads anything and adds its counts without a returned value (`red`), a
    program's pairs at once: at most one more layout change (two barriers) than not counting,
    where adding them a pick at a time took 16 more; counting per expert sums the program's
    picks in int32 (10 more barriers; an int64 sum took 20), or counts them with a histogram
    of the ids (3 more). The EP local-ids kernel lets the next start, then waits for the
    routing's writes before its first load. By the defaults (one warp for one token, the
    grouped view), one token's grouped routing builds with no barrier: every row reduction
    stays inside the warp."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _CHAIN, str(ROOT / "scripts")], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    ptx = json.loads(run.stdout.strip().splitlines()[-1])
    route, local = ptx["route"], ptx["local_ids"]
    assert route.index("griddepcontrol.launch_dependents") < route.index("ld.global")
    assert "griddepcontrol.wait" not in route
    assert set(re.findall(r"\b(?:atom|red)\.[\w.]+", route)) == {"red.global.gpu.relaxed.add.u64"}
    bars = {call: len(re.findall(r"\bbar(?:rier)?\.sync", ptx[call]))
            for call in ("route", "route_per_expert", "route_histogram", "route_uncounted",
                         "grouped_one_warp")}  # fmt: skip
    assert bars["route"] <= bars["route_uncounted"] + 2, bars
    assert bars["route_per_expert"] <= bars["route_uncounted"] + 10, bars
    assert bars["route_histogram"] <= bars["route_uncounted"] + 3, bars
    first_load = local.index("ld.global")
    assert local.index("griddepcontrol.launch_dependents") < local.index("griddepcontrol.wait")
    assert local.index("griddepcontrol.wait") < first_load
    assert bars["grouped_one_warp"] == 0
