#!/usr/bin/env bash
# Try FlashInfer's CUTLASS fused MoE (`flashinfer_cutlass`) on the GPU machine, which has no
# package registry: install the carried wheels (flashinfer-python in .whl_fi/, apache-tvm-ffi
# in .whl_tvm/ (0.1.15: 0.1.11 lacks tvm_ffi.libinfo, which the JIT uses), without their other dependencies) into .fisite/, import it, then run the layer's
# GPU test for that runner (its first call JIT-compiles the MoE kernels with nvcc).
# The flashinfer wheel (62 MB) and the tree leave no room in one transfer for anything else, so
# it takes two calls on one warm machine: `FI_STEP=install-deps` with .whl_tvm carried, then the
# default step with .whl_fi carried (.fisite/ stays there between the calls).
# Usage (repo root):  OUT=/tmp/out bash scripts/gpu_flashinfer_try.sh
# Writes $OUT/flashinfer_try.log; exit status 0 only when the runner's GPU test passed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moekit_fi}
mkdir -p "$OUT"
LOG="$OUT/flashinfer_try.log"
SITE=$PWD/.fisite  # one --target directory per wheel (pip --target replaces what it finds)
if [ "${FI_STEP:-}" = "install-deps" ]; then
    rm -rf "$SITE" && python3 -m pip install --no-deps --no-index --target "$SITE/tvm" \
        .whl_tvm/apache_tvm_ffi-*.whl 2>&1 | tail -2
    exit $?
fi
export PYTHONPATH="$SITE/fi:$SITE/tvm:$PWD/src:$PWD" PYTHONUNBUFFERED=1
{
    echo "=== install (no deps): $(ls .whl_fi)"
    rm -rf "$SITE/fi" && python3 -m pip install --no-deps --no-index --target "$SITE/fi" \
        .whl_fi/*.whl 2>&1 | tail -3
    ls "$SITE"/*
    echo "=== import"
    timeout 120 python3 -c '
import time; t = time.time()
import tvm_ffi
print("tvm_ffi", getattr(tvm_ffi, "__version__", "?"), tvm_ffi.__file__,
      "libinfo loaded:", hasattr(tvm_ffi, "libinfo"))
import tvm_ffi.libinfo
import flashinfer
print("flashinfer", flashinfer.__version__, "imported in %.1f s" % (time.time() - t))
from flashinfer.fused_moe import cutlass_fused_moe
print("cutlass_fused_moe imported")
from moekit.hardware import detect
from moekit.runners.registry import runner_class
print("availability:", runner_class("flashinfer_cutlass").availability(detect()))
'
    echo "import exit $?"
    echo "=== layer GPU test of flashinfer_cutlass (JIT on first call), limit ${FI_TEST_LIMIT:-420} s"
    timeout "${FI_TEST_LIMIT:-420}" python3 -m pytest -q --maxfail=5 -rfE -p no:cacheprovider -m gpu \
        tests/test_layer.py -k flashinfer_cutlass 2>&1 | tail -40
    echo "test exit ${PIPESTATUS[0]}"
} 2>&1 | tee "$LOG"
grep -q "^test exit 0" "$LOG"
