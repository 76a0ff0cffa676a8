#!/usr/bin/env bash
# The `triton` runner's tables for one preset at one parallelism, in one device call, for each
# weight format in FORMATS: `moekit bench` on the tables the package ships (for a shape without
# its own, the nearest tuned shape's: what any new model gets), `moekit tune` into $OUT/cfg, and
# the bench again on the tuned tables. Carry `.whl` (deep_gemm) so that `auto` has its fp8 GEMMs.
# Under $OUT: log.txt, shipped_<format>/ tuned_<format>/ (bench JSON), cfg.tgz (the new tables:
# unpack into src/moekit/configs to ship them).
#
# Usage: OUT=... MODEL=qwen3-235b-a22b PAR="--tp-size 8 --ep-size 8" \
#          FORMATS="unquantized fp8_w8a8" scripts/gpu_tables.sh
#   BATCHES (default 1,4,16,64,256,1024,4096,16384), BACKENDS (default triton,auto),
#   STEPS (subset of "shipped tune tuned"), BENCH_TIMEOUT_S / TUNE_TIMEOUT_S (each command's limit)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src:tests}
OUT=${OUT:-/tmp/gpu_tables_out}
CFG=$OUT/cfg
MODEL=${MODEL:?MODEL: a preset}
PAR=${PAR:-}
FORMATS=${FORMATS:-unquantized}
BATCHES=${BATCHES:-1,4,16,64,256,1024,4096,16384}
BACKENDS=${BACKENDS:-triton,auto}
STEPS=${STEPS:-shipped tune tuned}
mkdir -p "$CFG/triton"
source scripts/gpu_common.sh  # log.txt, carried wheels, versions, has
bench() {  # bench DIR CONFIG_DIR FORMAT
  echo "== bench $1 ($MODEL $PAR --quantization $3)"
  MOEKIT_CONFIG_DIR=$2 timeout "${BENCH_TIMEOUT_S:-120}" python3 -m moekit.cli.main bench \
    --model "$MODEL" $PAR --quantization "$3" --backends "$BACKENDS" --batch-sizes "$BATCHES" \
    --no-plot --out-dir "$OUT/$1" 2>&1 | grep -v "Warning"
}
for f in $FORMATS; do
  has shipped && bench "shipped_$f" "$(mktemp -d)" "$f"
  if has tune; then
    echo "== tune $MODEL $PAR --quantization $f"
    MOEKIT_CONFIG_DIR=$CFG timeout "${TUNE_TIMEOUT_S:-200}" python3 -m moekit.cli.main tune \
      --no-progress --model "$MODEL" $PAR --quantization "$f" --batch-sizes "$BATCHES" \
      2>&1 | grep -v "INFO\|Warning"
    tar czf "$OUT/cfg.tgz" -C "$CFG" triton
  fi
  has tuned && bench "tuned_$f" "$CFG" "$f"
done
