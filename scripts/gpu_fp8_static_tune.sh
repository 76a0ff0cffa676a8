#!/usr/bin/env bash
# Tune the triton runner for fp8 per-tensor weights with static activation scales, on the GPU
# machine in one call: `moekit bench` on the untuned tables (the bf16 configs adapted to the
# format), `moekit tune --quantization`, then `moekit bench` again on the tuned tables.
# Under $OUT: untuned/*.json tuned/*.json (bench results) and cfg.tgz (the tuned tables).
#
# Usage: MODELS="qwen3-30b-a3b:1:1" scripts/gpu_fp8_static_tune.sh
#   MODELS: preset:tp:ep ...; BATCHES: batch sizes; Q: the --quantization string;
#   BENCH_TIMEOUT_S / TUNE_TIMEOUT_S: each command's limit
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src}
OUT=${OUT:-/tmp/gpu_fp8_static_tune_out}
CFG=$OUT/cfg
mkdir -p "$CFG/triton"
Q=${Q:-fp8_w8a8:weight_scale=tensor,activation_scheme=static_tensor}
BATCHES=${BATCHES:-1,16,256,4096}
MODELS=${MODELS:-qwen3-30b-a3b:1:1}
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

each() {  # each WHAT COMMAND...: COMMAND for every model of MODELS, its flags appended
  local what=$1; shift
  for m in $MODELS; do
    IFS=: read -r name tp ep <<< "$m"
    echo "== $what $name tp $tp ep $ep"
    MOEKIT_CONFIG_DIR=$CFG "$@" --model "$name" --tp-size "$tp" --ep-size "$ep" \
      --quantization "$Q" --batch-sizes "$BATCHES" 2>&1 | grep -v "INFO\|Warning"
  done
}
bench() {
  each "bench ($1 tables)" timeout "${BENCH_TIMEOUT_S:-120}" python3 -m moekit.cli.main bench \
    --backends triton,cutlass,auto --no-plot --out-dir "$OUT/$1"
}
bench untuned
each tune timeout "${TUNE_TIMEOUT_S:-240}" python3 -m moekit.cli.main tune --no-progress
bench tuned
tar czf "$OUT/cfg.tgz" -C "$CFG" triton
