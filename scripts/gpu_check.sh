#!/usr/bin/env bash
# GPU check: the GPU-marked tests and a short `moekit bench`, in one call on the device machine
# (no package registry there; its python3 has torch, triton, pytest, rich and matplotlib).
# Writes under $OUT (at most 8 files come back from there):
#   summary.txt          the summary printed at the end
#   gpu_check.log        everything the steps printed
#   junit_gpu.xml        pytest -m "gpu or multigpu" (every test file; the others deselected)
#   junit_rest.xml       with GPU_CHECK_REST_TESTS=1: the other tests, in CI's configuration
#   bench_results.tar.gz benchmarks/results/<run>.json + .png; unpack at the repo root, then
#                        `moekit bench --regenerate-md` refreshes BENCHMARKS.md
#   bench_*.png          the first plots, to look at directly
#
# Usage (repo root):  OUT=/tmp/out bash scripts/gpu_check.sh
# Knobs (environment):
#   GPU_CHECK_DEADLINE=560        seconds the whole script may take (the device tool stops a
#                                 command at 600); steps get what is left, bench runs last
#   GPU_CHECK_BENCH="m1 args;m2 args"   bench runs, ';'-separated `moekit bench` arguments
#                                 (set but empty: no bench runs)
#   GPU_CHECK_BATCH_SIZES=1,16,256,4096
#   GPU_CHECK_BENCH_TIMEOUT=120   seconds per bench run at most
#   GPU_CHECK_BENCH_RESERVE=200   seconds the tests leave for the bench runs
#   GPU_CHECK_WORKERS=2           pytest-xdist processes for the GPU tests (3 ran out of the H100's
#                                 80 GB in two gpt-oss preset tests of shard 0/2 at bedce99)
#   GPU_CHECK_SHARD=i/n           only test files i, i+n, i+2n, ... (0-based, sorted): the GPU
#                                 suite takes longer than one 600 s call on an H100 (about 85%
#                                 ran in 345 s at 5f0884b), so run it as 0/2 and 1/2
#   GPU_CHECK_REST_TESTS=1        also run the non-GPU tests, with the GPU hidden (as on CI: the
#                                 Triton kernels of those tests run interpreted on CPU tensors,
#                                 which needs numpy < 2.4). Off by default: CI runs them.
#   MOEKIT_GIT_COMMIT=<sha>       recorded in the bench JSON when the copy has no .git
# Exit status: 0 when every step passed, 1 otherwise (the summary says which).
set -u -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/moekit_gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
WORK=$(mktemp -d /tmp/moekit_gpu_check.XXXXXX)
RESULTS="$WORK/benchmarks/results"
mkdir -p "$RESULTS"

REST_TESTS=${GPU_CHECK_REST_TESTS:-0}
export GPU_CHECK_REST_TESTS=$REST_TESTS
BATCH_SIZES=${GPU_CHECK_BATCH_SIZES:-1,16,256,4096}
BENCH=${GPU_CHECK_BENCH-"--model qwen3-30b-a3b;--model mixtral-8x7b --tp-size 2;--model deepseek-v3 --tp-size 8 --ep-size 8"}
DEADLINE=${GPU_CHECK_DEADLINE:-560}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-120}
BENCH_RESERVE=${GPU_CHECK_BENCH_RESERVE:-200} # seconds the tests leave for the bench runs
# GPU tests in parallel processes on the one GPU (compiles are CPU-bound); 2 keeps the preset
# shapes (tens of GB each) within an 80 GB card.
GPU_WORKERS=${GPU_CHECK_WORKERS:-2}
START=$(date +%s)
declare -a STEPS=()

log() { echo "$@" | tee -a "$LOG"; }
# step NAME CMD...: run CMD with its output into the log, record pass/FAIL with the exit code.
step() {
    local name=$1
    shift
    log ""
    log "=== $name: $* ($(date -u +%H:%M:%S), $(($(date +%s) - START)) s in)"
    "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then STEPS+=("pass  $name"); else STEPS+=("FAIL  $name (exit $rc)"); fi
    return 0
}
# left [RESERVE]: seconds until the deadline, less RESERVE
left() { echo $((DEADLINE - ($(date +%s) - START) - ${1:-0})); }
step "nvidia-smi" nvidia-smi -L
step "device" "$PY" -c '
import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "triton", triton.__version__, "gpus", torch.cuda.device_count())
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())
'
step "moekit env" "$PY" -m moekit.cli.main env

PYTEST=("$PY" -m pytest -q -rfEs -p no:cacheprovider --timeout=300)
# try_step NAME SECONDS CMD...: step under `timeout SECONDS`, or FAIL when too little time is left.
try_step() {
    local name=$1 secs=$2
    shift 2
    if [ "$secs" -lt 20 ]; then
        STEPS+=("FAIL  $name (not run: no time left of GPU_CHECK_DEADLINE=$DEADLINE s)")
        log "=== $name: not run, no time left"
        return 0
    fi
    # SIGINT first: pytest then still prints its failures (-rfE) and writes the junit file
    step "$name" timeout --signal=INT --kill-after=20 "$secs" "$@"
}
TEST_FILES=(tests)
if [ -n "${GPU_CHECK_SHARD:-}" ]; then
    IFS=/ read -r SHARD_I SHARD_N <<<"$GPU_CHECK_SHARD"
    mapfile -t ALL_FILES < <(ls tests/test_*.py | sort)
    TEST_FILES=()
    for i in "${!ALL_FILES[@]}"; do
        [ $((i % SHARD_N)) -eq "$SHARD_I" ] && TEST_FILES+=("${ALL_FILES[$i]}")
    done
fi
try_step "tests: gpu-marked" "$(left "$BENCH_RESERVE")" "${PYTEST[@]}" -n "$GPU_WORKERS" \
    -m "gpu or multigpu" --junitxml="$OUT/junit_gpu.xml" "${TEST_FILES[@]}"
if [ "$REST_TESTS" = "1" ]; then
    NPROC=$(nproc 2>/dev/null || echo 4)
    WORKERS=$((NPROC > 8 ? 8 : NPROC))
    try_step "tests: the rest (GPU hidden, as on CI)" "$(left "$BENCH_RESERVE")" \
        env CUDA_VISIBLE_DEVICES= "${PYTEST[@]}" -n "$WORKERS" -m "not gpu and not multigpu" \
        --junitxml="$OUT/junit_rest.xml" tests
fi

IFS=';' read -r -a RUNS <<<"$BENCH"
for args in "${RUNS[@]}"; do
    [ -n "${args// /}" ] || continue
    secs=$(left 15)
    secs=$((secs > BENCH_TIMEOUT ? BENCH_TIMEOUT : secs))
    # shellcheck disable=SC2086  # the arguments are meant to split
    try_step "bench $args" "$secs" "$PY" -m moekit.cli.main bench $args \
        --batch-sizes "$BATCH_SIZES" --out-dir "$RESULTS"
done

# Results: one archive with paths relative to the repo root, plus the first plots.
if compgen -G "$RESULTS/*.json" >/dev/null; then
    tar -czf "$OUT/bench_results.tar.gz" -C "$WORK" benchmarks/results
    n=0
    for png in "$RESULTS"/*.png; do
        [ -e "$png" ] || break
        n=$((n + 1))
        [ "$n" -le 3 ] && cp "$png" "$OUT/bench_$n.png"
    done
fi

{
    echo ""
    echo "=== summary ($(($(date +%s) - START)) s)"
    for s in "${STEPS[@]}"; do echo "  $s"; done
    "$PY" - "$OUT" "$RESULTS" <<'EOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET

out, results = sys.argv[1], sys.argv[2]
for name in ("junit_gpu.xml", "junit_rest.xml"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        if name == "junit_gpu.xml" or os.environ.get("GPU_CHECK_REST_TESTS") == "1":
            print(f"  {name}: not written")
        continue
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    print(f"  {name}: {tot['tests']} tests, {tot['failures']} failed, {tot['errors']} errors, "
          f"{tot['skipped']} skipped")
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or "").splitlines()[0][:150] if bad.get("message") else ""
            print(f"    {case.get('classname')}::{case.get('name')}: {msg}")
try:
    from moekit.report import table_markdown, title
except Exception as err:  # noqa: BLE001
    print(f"  (cannot import moekit.report: {err})")
    sys.exit(0)
for path in sorted(glob.glob(os.path.join(results, "*.json"))):
    doc = json.load(open(path))
    c = doc["ceilings"]
    print(f"\n  {title(doc)} on {doc['device']['name']} (commit {doc['commit'][:10]})")
    print(f"  ceilings: copy {c['copy_bytes_per_s'] / 1e12:.3g} TB/s, matmul "
          f"{c['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s ({c['dtype']}); cells: ms (time / floor)")
    for line in table_markdown(doc):
        print("  " + line)
    failed = [r for r in doc["records"] if r["error"]]
    for r in failed:
        print(f"  ! {r['backend']} T={r['T']}: {r['error'][:150]}")
    if doc.get("skipped"):
        print("  not run: " + ", ".join(sorted(doc["skipped"])))
EOF
} 2>&1 | tee "$OUT/summary.txt" | tee -a "$LOG"

rm -rf "$WORK"
for s in "${STEPS[@]}"; do
    case "$s" in FAIL*) exit 1 ;; esac
done
exit 0
