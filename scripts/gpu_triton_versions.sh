#!/usr/bin/env bash
# Compare the machine's Triton with a carried newer one on the triton runner, run by run.
#
#   bash scripts/gpu_triton_versions.sh [STEPS]     # carry [".whl_t39"]
#
# .whl_t39/triton39.tar.xz: Triton 3.9 stripped to fit the device tool's 64 MiB carry beside
# the deep_gemm wheels (.whl); `bash scripts/make_carry.sh` builds both and says what is left
# out (Triton >= 3.7 runs only `ptxas-blackwell`, pointed below at the machine's own ptxas).
# STEPS (default "versions"):
#   versions  scripts/gpu_triton_versions.py under each version in turn, VERSIONS_PASSES times
#   ws        scripts/gpu_probe_fp8_ws.py under the carried version (warp specialization)
#   tests     the GPU tests under the carried version (TESTS, default the triton runner's)
#   ttgir     scripts/gpu_ttgir_summary.py under each version (wgmma waits of the fp8 GEMMs)
#   ptxas     the machine's Triton with its bundled ptxas, then with the machine's CUDA ptxas
#             (TRITON_PTXAS_PATH), scripts/gpu_triton_versions.py, VERSIONS_PASSES times
# Results under $OUT. VERSIONS_DEADLINE (s, default 540) stops starting new steps.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=${VERSIONS_DEADLINE:-540}
left() { echo $((DEADLINE - ($(date +%s) - START))); }
T39=/tmp/t39
export TRITON_BACKENDS_IN_TREE=1  # the carried package has only the nvidia backend; no entry-point discovery
# Triton >= 3.7 compiles sm_90 with its "ptxas-blackwell" (CUDA 13.4), left out of the carry:
# the machine's own CUDA 13 ptxas matches its driver.
export TRITON_PTXAS_BLACKWELL_PATH=${TRITON_PTXAS_BLACKWELL_PATH:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
export TRITON_DEFAULT_FP_FUSION=1  # 3.9 warns when unset; 1 is 3.6's behaviour
if [ ! -d $T39/triton ]; then
  mkdir -p $T39 && tar xJf .whl_t39/triton39.tar.xz -C $T39 || exit 1
fi
echo "machine triton: $(python3 -c 'import triton; print(triton.__version__)')"
echo "carried triton: $(PYTHONPATH=$T39 python3 -c 'import triton; print(triton.__version__)')"
for step in ${1:-versions}; do
  case $step in
    versions)
      for pass in $(seq 1 "${VERSIONS_PASSES:-2}"); do
        [ "$(left)" -gt 150 ] || break
        PYTHONPATH=src timeout "$(left)" python3 scripts/gpu_triton_versions.py "old$pass" 2>&1 | tail -40
        [ "$(left)" -gt 100 ] || break
        PYTHONPATH=$T39:src timeout "$(left)" python3 scripts/gpu_triton_versions.py "new$pass" 2>&1 | tail -40
      done ;;
    ws)
      PYTHONPATH=$T39:src PROBE_TIMEOUT_S=${PROBE_TIMEOUT_S:-40} timeout "$(left)" \
        python3 scripts/gpu_probe_fp8_ws.py 2>&1 | tail -40 ;;
    ptxas)
      SYS_PTXAS=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
      echo "system ptxas: $($SYS_PTXAS --version | tail -1)"
      for pass in $(seq 1 "${VERSIONS_PASSES:-2}"); do
        [ "$(left)" -gt 150 ] || break
        PYTHONPATH=src timeout "$(left)" python3 scripts/gpu_triton_versions.py "bundled$pass" 2>&1 | grep -v "moekit INFO" | tail -40
        [ "$(left)" -gt 100 ] || break
        TRITON_PTXAS_PATH=$SYS_PTXAS PYTHONPATH=src timeout "$(left)" python3 scripts/gpu_triton_versions.py "system$pass" 2>&1 | grep -v "moekit INFO" | tail -40
      done ;;
    ttgir)
      PYTHONPATH=src timeout "$(left)" python3 scripts/gpu_ttgir_summary.py old 2>&1 | grep -v "moekit INFO" | tail -12
      PYTHONPATH=$T39:src timeout "$(left)" python3 scripts/gpu_ttgir_summary.py new 2>&1 | grep -v "moekit INFO" | tail -12 ;;
    tests)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl_triton/*.whl 2>/dev/null
      PYTHONPATH=$T39:/tmp/site2:src timeout "$(left)" python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" -n 3 -m gpu ${TESTS:-tests/test_triton_runner.py} 2>&1 | tail -25 ;;
  esac
done
