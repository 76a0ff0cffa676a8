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
FORMATS = ("unquantized", "fp8_w8a8", "int4_w4a16", "mxfp4")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every kernel of the runner's calls at T = 1 and 4096 -> (calls, PTX text by key)."""
    out = tmp_path_factory.mktemp("sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(ROOT / "scripts" / "kernel_digest.py"), str(out / "d.json"),
           "--models", MODEL, "--formats", ",".join(FORMATS), "--batches", "1,4096",
           "--devices", "h100", "--ptx", str(out / "ptx")]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    d = json.loads((out / "d.json").read_text())
    ptx = {k: (out / "ptx" / f"{h}.ptx").read_text() for k, h in d["kernels"].items()}
    return d["calls"], ptx


def _gemms(built, fmt, T):
    calls, ptx = built
    keys = calls[f"{MODEL} {fmt} T={T} NVIDIA H100 80GB HBM3"]
    found = {k.split()[0]: ptx[k] for k in keys if k.split()[0] in ("_gate_up_kernel",
                                                                     "_down_kernel")}  # fmt: skip
    assert set(found) == {"_gate_up_kernel", "_down_kernel"}, keys
    return found


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_call_compiles_and_launches_both_gemms(built, fmt):
    for T in (1, 4096):
        for name, code in _gemms(built, fmt, T).items():
            assert re.search(r"^\.visible \.entry " + name, code, re.M), name


@pytest.mark.parametrize("fmt, operands", [("unquantized", "bf16.bf16"),
                                           ("fp8_w8a8", "e4m3.e4m3"),
                                           ("int4_w4a16", "bf16.bf16"),
                                           ("mxfp4", "bf16.bf16")])  # fmt: skip
def test_large_batch_gemms_are_warpgroup_mmas(built, fmt, operands):
    """T = 4096: both GEMMs on wgmma with the format's operand types (fp8 on the fp8 tensor
    cores; the 4-bit formats dequantized to bf16 in registers)."""
    for name, code in _gemms(built, fmt, 4096).items():
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.f32\.{operands}", code), (
            f"{fmt} {name}: no wgmma on {operands}")


def test_bf16_large_batch_loads_by_tma(built):
    """The shipped bf16 configs at T = 4096 load tiles through TMA descriptors."""
    for name, code in _gemms(built, "unquantized", 4096).items():
        assert "cp.async.bulk.tensor" in code, name
