#!/usr/bin/env bash
# Expert parallelism on the GPU machine, in one call: the multi-GPU and GPU tests of the EP code
# (NCCL, CUDA graphs), the EP benchmark (python -m moekit.bench_ep under torchrun: normal,
# layer, low_latency, low_latency fp8) and, when a DeepEP sdist was carried, the DeepEP build
# attempt (scripts/gpu_deepep_build.sh).
# Meant for nvidia-h200-x4 (works on any machine with 2+ GPUs; the bench uses all of them).
#
# Usage (repo root):  OUT=/tmp/out bash scripts/gpu_ep.sh
# Writes under $OUT (at most 8 files come back from the device tool):
#   summary.txt            pass/FAIL per step, then the benchmark summaries
#   gpu_ep.log             everything the steps printed
#   ep_tests.xml           junit of pytest -m "gpu or multigpu" on the EP test files
#   ep_bench.json          parts normal + layer (T = 4096 and 128 per rank, deepseek-v3 shape)
#   ep_bench_ll.json       part low_latency (CUDA graphs), bf16 dispatch
#   ep_bench_ll_fp8.json   part low_latency with fp8 dispatch
#   deepep_build.log       the DeepEP build attempt (its one-line result goes in summary.txt)
#   ep_traces.tar.gz       with GPU_EP_PROFILE=1: torch.profiler traces of the normal part
# Knobs (environment): GPU_EP_DEADLINE=560 (seconds for the whole script), GPU_EP_TESTS=1,
#   GPU_EP_DEEPEP=auto (1: always try the DeepEP build, 0: never, auto: when .whl_deepep/ holds
#   the sdist), GPU_EP_DEEPEP_LIMIT=120 (seconds for that build),
#   GPU_EP_BENCH=normal,layer,ll,ll_fp8 (which benchmark parts run),
#   GPU_EP_BENCH_ARGS (extra arguments for every bench run), GPU_EP_NPROC (default: all GPUs),
#   GPU_EP_TESTS_K (a pytest -k expression for the test step),
#   GPU_EP_NORMAL_CHUNKS=default,2,3,auto,1/pack,1/none (the normal part's --normal-chunks
#   settings, side by side; nccl / p2p name the transport),
#   GPU_EP_PROFILE=0 (1: torch.profiler traces of the normal part -> ep_traces.tar.gz).
# Exit status: 0 when every step passed, 1 otherwise.
set -u -o pipefail
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on these machines (see the device notes); NCCL, torch and NVSHMEM.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/moekit_gpu_ep}
mkdir -p "$OUT"
LOG="$OUT/gpu_ep.log"
: >"$LOG"
DEADLINE=${GPU_EP_DEADLINE:-560}
START=$(date +%s)
declare -a STEPS=()

log() { echo "$@" | tee -a "$LOG"; }
left() { echo $((DEADLINE - ($(date +%s) - START) - ${1:-0})); }
# step NAME SECONDS CMD...: run CMD under `timeout SECONDS` (capped by the deadline), logged.
step() {
    local name=$1 secs=$2
    shift 2
    local avail
    avail=$(left 5)
    [ "$secs" -gt "$avail" ] && secs=$avail
    if [ "$secs" -lt 15 ]; then
        STEPS+=("FAIL  $name (not run: no time left of GPU_EP_DEADLINE=$DEADLINE s)")
        return 0
    fi
    log ""
    log "=== $name (limit ${secs}s, $(($(date +%s) - START))s in): $*"
    timeout --kill-after=10 "$secs" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then STEPS+=("pass  $name"); else STEPS+=("FAIL  $name (exit $rc)"); fi
    return 0
}

step "device" 60 "$PY" -c '
import torch, triton
n = torch.cuda.device_count()
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "nccl", torch.cuda.nccl.version(), "gpus", n)
for i in range(n):
    print(i, torch.cuda.get_device_name(i))
assert n >= 2, "the EP checks need 2+ GPUs"
'
NPROC=${GPU_EP_NPROC:-$("$PY" -c 'import torch; print(torch.cuda.device_count())')}
nvidia-smi topo -m >>"$LOG" 2>&1 || true

DEEPEP=${GPU_EP_DEEPEP:-auto}
if [ "$DEEPEP" = "auto" ]; then
    ls .whl_deepep/deep_ep-*.tar.gz >/dev/null 2>&1 && DEEPEP=1 || DEEPEP=0
fi
if [ "$DEEPEP" = "1" ]; then
    # a failed build is the expected evidence (see the log), not a failed step of this script
    DEEPEP_BUILD_TIMEOUT=${GPU_EP_DEEPEP_LIMIT:-120} OUT="$OUT" PYTHON="$PY" \
        timeout --kill-after=10 $((${GPU_EP_DEEPEP_LIMIT:-120} + 60)) \
        bash scripts/gpu_deepep_build.sh >/dev/null 2>&1
    log "deepep build: $(cat "$OUT/deepep_build.txt" 2>/dev/null || echo 'no result (timed out?)')"
fi

if [ "${GPU_EP_TESTS:-1}" = "1" ]; then
    step "pytest gpu+multigpu (EP)" 240 "$PY" -m pytest -q -rfEs -p no:cacheprovider \
        --timeout=200 -m "gpu or multigpu" -k "${GPU_EP_TESTS_K:-}" \
        --junitxml="$OUT/ep_tests.xml" \
        tests/test_dispatch_alltoall.py tests/test_dispatch_p2p.py tests/test_parallel.py
fi

BENCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m moekit.bench_ep)
EXTRA=${GPU_EP_BENCH_ARGS:-}
WANT=",${GPU_EP_BENCH:-normal,layer,ll,ll_fp8},"
EAGER=""
for p in normal layer; do
    case $WANT in *",$p,"*) EAGER="$EAGER${EAGER:+,}$p" ;; esac
done
# eager parts first (normal mode, the layers); the CUDA-graph part runs on its own so that a
# problem there cannot take the other numbers with it
NORMAL_ARGS=(--normal-chunks "${GPU_EP_NORMAL_CHUNKS:-default,2,3,auto,1/pack,1/none}")
[ "${GPU_EP_PROFILE:-0}" = "1" ] && NORMAL_ARGS+=(--profile "$OUT/traces")
if [ -n "$EAGER" ]; then
    # shellcheck disable=SC2086
    step "bench $EAGER" 200 "${BENCH[@]}" --parts "$EAGER" --out "$OUT/ep_bench.json" \
        "${NORMAL_ARGS[@]}" $EXTRA
fi
if [ -d "$OUT/traces" ]; then  # one file back instead of one per rank
    tar -czf "$OUT/ep_traces.tar.gz" -C "$OUT" traces && rm -rf "$OUT/traces"
fi
case $WANT in *",ll,"*)
    # shellcheck disable=SC2086
    step "bench low_latency" 90 "${BENCH[@]}" --parts low_latency --out "$OUT/ep_bench_ll.json" $EXTRA ;;
esac
case $WANT in *",ll_fp8,"*)
    # shellcheck disable=SC2086
    step "bench low_latency fp8" 90 "${BENCH[@]}" --parts low_latency --fp8 \
        --out "$OUT/ep_bench_ll_fp8.json" $EXTRA ;;
esac

{
    echo "gpu_ep.sh: $(($(date +%s) - START)) s, $NPROC GPUs"
    printf '%s\n' "${STEPS[@]}"
    [ -f "$OUT/deepep_build.txt" ] && echo "deepep build: $(cat "$OUT/deepep_build.txt")"
    for f in "$OUT"/ep_bench*.json; do
        [ -f "$f" ] || continue
        echo ""
        echo "--- $(basename "$f")"
        "$PY" - "$f" <<'PYEOF' || true
import json, sys
from moekit.bench_ep import summary
doc = json.load(open(sys.argv[1]))
print(summary(doc))
PYEOF
    done
} | tee "$OUT/summary.txt" | tee -a "$LOG"

rm -f "$OUT/deepep_build.txt"  # folded into summary.txt (at most 8 files come back)
for s in "${STEPS[@]}"; do
    case $s in FAIL*) exit 1 ;; esac
done
exit 0
