#!/usr/bin/env bash
# The Gluon engine's folded tiles on an H100 / H200 under the carried Triton 3.9 (carry
# [".whl_t39"], unpacked as in scripts/gpu_triton_versions.sh):
#
#   bash scripts/gpu_gluon_fold.sh [STEPS]     # default "tests ab"
#
#   tests  the engine's GPU tests (tests/test_triton_kernel_gluon.py) and the routing's
#   ab     scripts/gpu_gluon_fold_ab.py (FOLD_AB_ARGS) -> $OUT/gluon_fold.json
#   ncu    scripts/gpu_ncu_layer.py under Nsight Compute (SpeedOfLight per kernel) for each
#          run of NCU_RUNS ("preset tp ep|T|variant;variant" runs, separated by "/";
#          NCU_METRICS: more metrics, comma-separated)
#          -> $OUT/ncu_<n>.csv
# FOLD_DEADLINE (s, default 560) bounds the whole run.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$(date +%s)
left() { echo $((${FOLD_DEADLINE:-560} - ($(date +%s) - START))); }
T39=/tmp/t39
export TRITON_BACKENDS_IN_TREE=1
export TRITON_PTXAS_BLACKWELL_PATH=${TRITON_PTXAS_BLACKWELL_PATH:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
export TRITON_DEFAULT_FP_FUSION=1
if [ ! -d $T39/triton ]; then
  mkdir -p $T39 && tar xJf .whl_t39/triton39.tar.xz -C $T39 || exit 1
fi
for step in ${1:-tests ab}; do
  case $step in
    tests)
      PYTHONPATH=$T39:src:tests timeout "$(left)" python3 -m pytest -q -p no:cacheprovider \
        -o addopts="" -n 2 -m gpu tests/test_triton_kernel_gluon.py \
        tests/test_triton_kernel_runner.py 2>&1 | tail -25 | tee "$OUT/gluon_fold_tests.txt" ;;
    ab)
      OUT=$OUT PYTHONPATH=$T39:src timeout "$(left)" python3 scripts/gpu_gluon_fold_ab.py \
        ${FOLD_AB_ARGS:-} 2>&1 | grep -v "moekit INFO" | tail -40 ;;
    ncu)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
      n=0
      IFS=/ read -ra runs <<< "${NCU_RUNS:-deepseek-v3 8 8|4096|triton;auto}"
      for run in "${runs[@]}"; do
        IFS='|' read -r job batch variants <<< "$run"
        n=$((n + 1))
        PYTHONPATH=$T39:src timeout "$(left)" "$NCU" --profile-from-start off \
          --clock-control none --section SpeedOfLight ${NCU_METRICS:+--metrics $NCU_METRICS} --csv \
          python3 scripts/gpu_ncu_layer.py \
          --job "$job" --batch "$batch" --variants "$variants" > "$OUT/ncu_$n.csv" \
          2> "$OUT/ncu_$n.err"
        echo "ncu $n ($job T=$batch $variants): rc $?, $(wc -l < "$OUT/ncu_$n.csv") lines"
        tail -3 "$OUT/ncu_$n.err"
      done ;;
  esac
done
