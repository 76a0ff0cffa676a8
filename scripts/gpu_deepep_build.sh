#!/usr/bin/env bash
# Try to build DeepEP (deep-ep on PyPI, an sdist only) into a wheel on the GPU machine, and log
# everything: the toolchain, where NVSHMEM is (the nvidia-nvshmem-cu* pip package that torch
# brings, if any) and what its lib/ holds, and the build itself, time-boxed.
#
# Usage (repo root):  OUT=/tmp/out DEEPEP_SDIST=.whl_deepep/deep_ep-1.0.0.tar.gz \
#                     bash scripts/gpu_deepep_build.sh
# Fetch the sdist on a machine with PyPI first (it cannot be fetched on the GPU machine):
#   pip download --no-deps --no-binary :all: deep-ep==1.0.0 -d .whl_deepep
#   (its setup.py runs even for a download: on a CPU-only torch it needs NVSHMEM_DIR and
#    CUDA_HOME set to existing folders, and torch.utils.cpp_extension.CUDA_HOME patched)
# Writes under $OUT: deepep_build.log (everything), deepep_build.txt (one line: built / failed
# and why), and the wheel when one was built and is under 16 MB.
# Knobs: DEEPEP_BUILD_TIMEOUT=360 (seconds for the build), PYTHON (default python3).
# Exit status: 0 when a wheel was built and imports, 1 otherwise.
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/moekit_deepep}
mkdir -p "$OUT"
LOG="$OUT/deepep_build.log"
: >"$LOG"
SDIST=${DEEPEP_SDIST:-$(ls .whl_deepep/deep_ep-*.tar.gz 2>/dev/null | head -1)}
LIMIT=${DEEPEP_BUILD_TIMEOUT:-360}
log() { echo "$@" | tee -a "$LOG"; }
result() { echo "$@" | tee "$OUT/deepep_build.txt" | tee -a "$LOG"; }

log "=== toolchain"
{
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__,
              "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
    "$PY" -c 'import torch.utils.cpp_extension as c; print("CUDA_HOME", c.CUDA_HOME)'
    command -v nvcc && nvcc --version | tail -2
    gcc --version | head -1
    command -v ninja || "$PY" -c 'import ninja; print("ninja (python)", ninja.__version__)'
} >>"$LOG" 2>&1
CUDA_HOME=${CUDA_HOME:-$("$PY" -c 'import torch.utils.cpp_extension as c; print(c.CUDA_HOME or "")' 2>/dev/null)}
if [ -z "$CUDA_HOME" ]; then
    for d in /usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12*; do
        [ -x "$d/bin/nvcc" ] && CUDA_HOME=$d && break
    done
fi
log "CUDA_HOME=${CUDA_HOME:-<none>}"

log "=== NVSHMEM"
NVSHMEM_DIR=${NVSHMEM_DIR:-$("$PY" - <<'PYEOF' 2>>"$LOG"
import importlib.util, os
for name in ("nvidia.nvshmem", "nvidia.cu13.nvshmem", "nvidia.cu12.nvshmem"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        continue
    if spec and spec.submodule_search_locations:
        print(list(spec.submodule_search_locations)[0])
        break
PYEOF
)}
{
    "$PY" -m pip list 2>/dev/null | grep -i -E 'nvshmem|deep|nvidia-nccl' || echo "no nvshmem pip package listed"
    echo "NVSHMEM_DIR=${NVSHMEM_DIR:-<none>}"
    if [ -n "${NVSHMEM_DIR:-}" ]; then
        ls -la "$NVSHMEM_DIR" "$NVSHMEM_DIR/lib" 2>&1 | head -40
        ls "$NVSHMEM_DIR/include" 2>&1 | head -10
    fi
} >>"$LOG" 2>&1

if [ -z "$SDIST" ] || [ ! -f "$SDIST" ]; then
    result "failed: no DeepEP sdist (set DEEPEP_SDIST; fetch it with pip download on a machine with PyPI)"
    exit 1
fi
log "=== sdist $SDIST"
WORK=$(mktemp -d)
tar -xzf "$SDIST" -C "$WORK"
SRC=$(ls -d "$WORK"/deep_ep-* | head -1)
{
    echo "files:"; (cd "$SRC" && find . -type f | sort)
    echo "includes the sources need:"
    grep -h '#include "' "$SRC"/csrc/*.cpp "$SRC"/csrc/kernels/*.cu | sort -u
    echo "of those, missing from the sdist:"
    for h in $(grep -h '#include "' "$SRC"/csrc/*.cpp "$SRC"/csrc/kernels/*.cu | sed 's/.*"\(.*\)".*/\1/' | sort -u); do
        [ -f "$SRC/csrc/$h" ] || [ -f "$SRC/csrc/kernels/$h" ] || echo "  MISSING $h"
    done
    echo "link needs: $(grep -o "'-l[^']*'" "$SRC/setup.py" | tr '\n' ' ')"
    if [ -n "${NVSHMEM_DIR:-}" ]; then
        for f in libnvshmem.a nvshmem_bootstrap_uid.so; do
            [ -e "$NVSHMEM_DIR/lib/$f" ] && echo "  $f: present" || echo "  $f: MISSING in $NVSHMEM_DIR/lib"
        done
    fi
} >>"$LOG" 2>&1

if [ -z "${NVSHMEM_DIR:-}" ] || [ -z "$CUDA_HOME" ]; then
    result "failed: needs NVSHMEM (NVSHMEM_DIR=${NVSHMEM_DIR:-none}) and nvcc (CUDA_HOME=${CUDA_HOME:-none})"
    exit 1
fi
log "=== build (limit ${LIMIT}s): pip wheel --no-deps --no-build-isolation"
START=$(date +%s)
(cd "$SRC" && NVSHMEM_DIR="$NVSHMEM_DIR" CUDA_HOME="$CUDA_HOME" MAX_JOBS=${MAX_JOBS:-16} \
    timeout --kill-after=10 "$LIMIT" "$PY" -m pip wheel --no-deps --no-build-isolation -v \
    -w "$WORK/dist" . ) >>"$LOG" 2>&1
RC=$?
log "build exit $RC after $(($(date +%s) - START)) s"
WHEEL=$(ls "$WORK"/dist/deep_ep-*.whl 2>/dev/null | head -1)
if [ "$RC" -ne 0 ] || [ -z "$WHEEL" ]; then
    WHY=$(grep -m1 -E 'fatal error|error:|Error' "$LOG" | sed 's/^ *//' | cut -c1-200)
    [ "$RC" -eq 124 ] && WHY="timed out after ${LIMIT}s"
    result "failed: exit $RC: ${WHY:-see deepep_build.log}"
    exit 1
fi
SIZE=$(stat -c %s "$WHEEL")
[ "$SIZE" -lt 16000000 ] && cp "$WHEEL" "$OUT/"
"$PY" -m pip install --no-deps "$WHEEL" >>"$LOG" 2>&1
if "$PY" -c 'import deep_ep; print("deep_ep", deep_ep.__file__)' >>"$LOG" 2>&1; then
    result "built: $(basename "$WHEEL") ($SIZE bytes), imports"
    exit 0
fi
result "failed: built $(basename "$WHEEL") but import deep_ep fails (see deepep_build.log)"
exit 1
