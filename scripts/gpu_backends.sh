#!/usr/bin/env bash
# GPU run of the runner backends (cutlass, deep_gemm, flashinfer_*) and of `auto` selection, in
# one call on the device machine. Carry `.whl` (sgl-deep-gemm 0.2.2 + apache-tvm-ffi 0.1.11;
# `bash scripts/make_carry.sh` builds it).
#
# Steps (GPU_BACKENDS_STEPS, default all, in this order):
#   env      nvidia-smi, torch/CUDA, `moekit env` (every backend with its availability reason)
#   smoke    DeepGEMM's kernels alone, built by moekit (runners/deep_gemm_jit.py): the four
#            grouped GEMMs (bf16/fp8 x contiguous/masked) against torch, build time, TFLOP/s
#   tests    pytest of the deep_gemm / availability / selection tests, GPU-marked ones included
#            (GPU_BACKENDS_TESTS to name other files)
#   sweep    per job: every backend but `torch` timed over the batch sizes (CUDA-graph replay),
#            the selection table written (moekit tune --select), then `auto` timed with it
#   explain  what `auto` picks per job and batch size with the new tables, and why
# Writes under $OUT (4 files come back):
#   summary.txt            pass/FAIL per step, auto vs fastest per job and T
#   select_result.json     per job and T: every backend's ms and time/floor, fastest, auto's choice
#                          and auto/fastest; geomeans of auto and of every single backend
#   gpu_backends.log       everything the steps printed
#   gpu_backends.tar.gz    work/: junit_backends.xml, env.txt, explain.txt, auto_summary.txt,
#                          config/select/*.json (the selection tables: copy them to
#                          src/moekit/configs/select/ to ship), results/*.json|png (bench format:
#                          copy to benchmarks/results/, then `moekit bench --regenerate-md`)
#
# Usage (repo root, on the device machine):  OUT=/tmp/out bash scripts/gpu_backends.sh
# Knobs (environment):
#   GPU_BACKENDS_DEADLINE=470    seconds the whole script may take (the device tool stops a command
#                                at 600); the sweep gets what the other steps leave, split over jobs
#   GPU_BACKENDS_STEPS="env smoke tests sweep explain"
#   GPU_BACKENDS_JOBS="J1;J2"    ';'-separated jobs, default the four presets of the issue in bf16
#                                (mixtral at TP2, deepseek-v3 at EP8) then qwen3 and deepseek-v3
#                                in fp8 block-wise; a job is
#                                preset [--tp-size N] [--ep-size N] [--quantization F] [--dtype D]
#                                Jobs left without 45 s are reported NOT RUN.
#   GPU_BACKENDS_BATCH_SIZES=1,4,16,64,256,1024,4096,16384
#   GPU_BACKENDS_TEST_TIMEOUT=150  seconds for the tests step at most
# Exit status: 0 when every step passed, 1 otherwise.
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/moekit_gpu_backends}
mkdir -p "$OUT"
LOG="$OUT/gpu_backends.log"
: >"$LOG"
WORK=$(mktemp -d /tmp/moekit_gpu_backends.XXXXXX)/work
mkdir -p "$WORK"
export MOEKIT_CONFIG_DIR="$WORK/config" # the sweep's selection tables go here; auto reads them
START=$(date +%s)
DEADLINE=${GPU_BACKENDS_DEADLINE:-470}
END=$((START + DEADLINE))
STEPS_TO_RUN=${GPU_BACKENDS_STEPS:-"env smoke tests sweep explain"}
JOBS=${GPU_BACKENDS_JOBS:-"qwen3-30b-a3b;mixtral-8x7b --tp-size 2;deepseek-v3 --tp-size 8 --ep-size 8;gpt-oss-120b;qwen3-30b-a3b --quantization fp8_w8a8;deepseek-v3 --tp-size 8 --ep-size 8 --quantization fp8_w8a8"}
BATCH_SIZES=${GPU_BACKENDS_BATCH_SIZES:-1,4,16,64,256,1024,4096,16384}
TEST_TIMEOUT=${GPU_BACKENDS_TEST_TIMEOUT:-150}
EXPLAIN_RESERVE=25 # seconds kept for explain + packing after the sweep
declare -a STEPS=()

log() { echo "$@" | tee -a "$LOG"; }
left() { echo $((END - $(date +%s))); }
wants() { case " $STEPS_TO_RUN " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
pack() { tar -czf "$OUT/gpu_backends.tar.gz" -C "$(dirname "$WORK")" work 2>/dev/null || true; }
finish() {
    {
        echo "moekit scripts/gpu_backends.sh: $(($(date +%s) - START)) s"
        printf '%s\n' "${STEPS[@]}"
        echo
        cat "$WORK/auto_summary.txt" 2>/dev/null
    } >"$OUT/summary.txt"
    cp "$WORK/select_result.json" "$OUT/" 2>/dev/null || true
    pack
}
trap finish EXIT
# step NAME TIMEOUT CMD...: run CMD (killed after TIMEOUT s) with its output into the log.
step() {
    local name=$1 limit=$2
    shift 2
    if [ "$limit" -lt 5 ]; then
        log "=== $name: NOT RUN, no time left"
        STEPS+=("SKIP  $name (no time left)")
        return 0
    fi
    log ""
    log "=== $name ($(date -u +%H:%M:%S), $(($(date +%s) - START)) s in, limit $limit s): $*"
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then STEPS+=("pass  $name"); else STEPS+=("FAIL  $name (exit $rc)"); fi
    pack
    return 0
}

# Carried wheels (sgl-deep-gemm, apache-tvm-ffi) into /tmp/site; the repo's src/ on the path.
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
WHL=${GPU_BACKENDS_WHL_DIR:-.whl} # wheels carried to the device (the repo root's .whl/)
if ls "$WHL"/*.whl >/dev/null 2>&1; then
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHL"/*.whl >>"$LOG" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site" # this tree's src/ first
        STEPS+=("pass  install wheels: $(cd "$WHL" && ls *.whl | tr '\n' ' ')")
    else
        STEPS+=("FAIL  install wheels (see the log): deep_gemm will be unavailable")
    fi
else
    STEPS+=("note  no .whl/ carried: deep_gemm will be unavailable")
fi
log "PYTHONPATH=$PYTHONPATH"

if wants env; then
    envrun() {
        nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv ||
            echo "(nvidia-smi failed)"
        $PY -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
        $PY -m moekit.cli.main env | tee "$WORK/env.txt"
    }
    export -f envrun
    export PY WORK
    step env 60 bash -c envrun # `timeout` runs programs, not shell functions
fi

if wants smoke; then
    t=$(left)
    [ "$t" -gt 150 ] && t=150
    step smoke "$t" $PY scripts/gpu_backends.py smoke --work "$WORK"
fi

if wants tests; then
    t=$(($(left) - 60))
    [ "$t" -gt "$TEST_TIMEOUT" ] && t=$TEST_TIMEOUT
    step tests "$t" $PY -m pytest -q -p no:cacheprovider -o addopts="" -rs \
        --junitxml="$WORK/junit_backends.xml" \
        ${GPU_BACKENDS_TESTS:-tests/test_deep_gemm_runner.py tests/test_backends_availability.py tests/test_select.py}
fi

if wants sweep; then
    t=$(($(left) - EXPLAIN_RESERVE))
    step sweep "$t" $PY scripts/gpu_backends.py sweep --work "$WORK" --jobs "$JOBS" \
        --batch-sizes "$BATCH_SIZES" --deadline $((END - EXPLAIN_RESERVE))
fi

if wants explain; then
    t=$(($(left) - 5))
    [ "$t" -gt 60 ] && t=60
    step explain "$t" $PY scripts/gpu_backends.py explain --work "$WORK" --jobs "$JOBS" \
        --batch-sizes "$BATCH_SIZES"
fi

log ""
printf '%s\n' "${STEPS[@]}" | tee -a "$LOG"
case "${STEPS[*]}" in *FAIL*) exit 1 ;; *) exit 0 ;; esac
