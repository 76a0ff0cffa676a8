#!/usr/bin/env bash
# Decode batches of the triton runner on the GPU machine, in one call: GPU tests of the split-K
# down GEMM (and of the kernels around it), re-tuning of the decode batch sizes into a copy of
# this GPU's shipped tables (bf16 presets and quantized formats), the tables back as
# $OUT/cfg.tgz (unpack over src/moekit/configs to ship them). Measuring with the new tables:
# scripts/gpu_triton_quant.py --nosplit (same run, split against unsplit down).
#
# Usage: scripts/gpu_decode_tune.sh [STAGES]   STAGES: comma list of tests,tune,measure
#   (default all; measure: gpu_triton_quant.py --nosplit with the re-tuned tables, bf16 and the
#   formats of MEASURE_FORMATS on qwen3-30b-a3b, deepseek-v3, gpt-oss-120b)
#   BATCHES  batch sizes to re-tune (default 1,4,16)
#   QUANT_PLAN  --tune plan of gpu_triton_quant.py (default int4-g128, mxfp4, nvfp4 at BATCHES,
#               fp8-block at 1,16)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src}
OUT=${OUT:-/tmp/gpu_decode_out}
mkdir -p "$OUT"
STAGES=${1:-tests,tune,measure}
CFG=/tmp/moekit_cfg
BATCHES=${BATCHES:-1,4,16}
QUANT_PLAN=${QUANT_PLAN:-int4-g128:$BATCHES;mxfp4:$BATCHES;nvfp4:$BATCHES;fp8-block:1,16}
exec > >(tee -a "$OUT/log.txt") 2>&1
has() { [[ ",$STAGES," == *",$1,"* ]]; }

if ! python3 -c "import pytest" 2>/dev/null && ls .whl_triton/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_triton/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

if has tests; then
  echo "== GPU tests"
  pt() { timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore "${@:2}" 2>&1 | tail -4; }
  pt 240 tests/test_triton_runner.py -k "config_variants or cuda_graph"
  pt 200 tests/test_triton_quant.py -k "cuda_graph or fused_act_quant or (presets_bf16_gpu and qwen3 and (fp8 or int8 or int4 or mxfp4))"
  pt 120 tests/test_cutlass_runner.py
fi

if has tune; then
  slug=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
  mkdir -p "$CFG/triton"
  cp src/moekit/configs/triton/*"device=$slug,"* "$CFG/triton/" 2>/dev/null
  echo "== tune T=$BATCHES (bf16 presets) into a copy of the $slug tables"
  for spec in "qwen3-30b-a3b 1 1" "mixtral-8x7b 2 1" "deepseek-v3 8 8" "gpt-oss-120b 1 1"; do
    set -- $spec
    MOEKIT_CONFIG_DIR=$CFG timeout 150 python3 -m moekit.cli.main tune --model "$1" --tp-size "$2" \
      --ep-size "$3" --batch-sizes "$BATCHES" --force --no-progress 2>&1 | grep -v Warning | tail -6
  done
  echo "== tune quantized: $QUANT_PLAN"
  MOEKIT_CONFIG_DIR=$CFG MOEKIT_TUNE_BUDGET_S=${TUNE_BUDGET_S:-220} MOEKIT_QUANT_BUDGET_S=1 MOEKIT_TUNE_FORCE=1 \
    timeout 300 python3 scripts/gpu_triton_quant.py --tune "$QUANT_PLAN" --formats int4-g128 \
    --batches 1 --models qwen3-30b-a3b --out quant_after_tune.json 2>&1 | grep "^tune"
  tar czf "$OUT/cfg.tgz" -C "$CFG" triton
  ls -la "$OUT"
fi

if has measure; then
  echo "== measure with the re-tuned tables (split vs unsplit down in the same run)"
  MOEKIT_CONFIG_DIR=$CFG MOEKIT_QUANT_BUDGET_S=${MEASURE_BUDGET_S:-110} timeout 240 python3 \
    scripts/gpu_triton_quant.py --nosplit --formats "${MEASURE_FORMATS:-int4-g128,mxfp4,nvfp4,fp8-block}" \
    --batches "$BATCHES" --models qwen3-30b-a3b,deepseek-v3,gpt-oss-120b --out decode_nosplit.json \
    2>&1 | grep -v Warning | tail -60
fi
