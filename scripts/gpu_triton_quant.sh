#!/usr/bin/env bash
# Packed 4-bit weight formats (int4_w4a16, mxfp4, nvfp4) of the triton runner on the GPU
# machine, in one call: GPU tests of the PTX dequantization, time with the shipped tables (PTX
# against the portable path, same run), tuning into $OUT/cfg, time with those tables.
# Under $OUT (at most 8 files): log.txt pytest.txt quant_shipped.json quant_tuned.json cfg.tgz
# ncu.txt
#
# Usage: scripts/gpu_triton_quant.sh [STAGES]   STAGES: comma list of tests,shipped,tune,tuned
#   (default tests,shipped,tune,tuned; also ncu: a profile of NCU_TARGET). Environment:
#   MODELS   measured / tuned shapes (default qwen3-30b-a3b,deepseek-v3)
#   FORMATS  packed formats (default int4-g128,mxfp4,nvfp4)
#   TUNE_MODELS  tuned shapes (default MODELS); TUNE_PLAN  explicit plan, see the tune stage
#   TUNED_ARGS   extra arguments of the tuned stage's measurement (e.g. --portable --maxnreg 96)
#   BATCHES  batch sizes (default 1,4,16)
#   TEST_K   pytest -k expression of the tests stage (default: all PTX tests, presets 4-bit)
#   TEST_TIMEOUT_S / SHIPPED_TIMEOUT_S / TUNE_TIMEOUT_S / TUNED_TIMEOUT_S   per-stage limits
#   MOEKIT_TUNE_BUDGET_S   tuning stops starting new (shape, format) pairs after this
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src}
OUT=${OUT:-/tmp/gpu_quant_out}
mkdir -p "$OUT"
STAGES=${1:-tests,shipped,tune,tuned}
MODELS=${MODELS:-qwen3-30b-a3b,deepseek-v3}
BATCHES=${BATCHES:-1,4,16}
FORMATS=${FORMATS:-int4-g128,mxfp4,nvfp4}
exec > >(tee -a "$OUT/log.txt") 2>&1
has() { [[ ",$STAGES," == *",$1,"* ]]; }

# pytest may be missing there: install carried wheels (call with carry [".whl_triton"])
if ! python3 -c "import pytest" 2>/dev/null && ls .whl_triton/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_triton/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi -L || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

tests_ok=1
if has tests; then
  echo "== GPU tests (PTX dequantization, packed formats on the preset shapes)"
  timeout "${TEST_TIMEOUT_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore \
    tests/test_triton_dequant_asm.py "tests/test_triton_quant.py::test_presets_bf16_gpu" \
    -k "${TEST_K:-asm or portable or ((qwen3 or deepseek or gpt) and (int4-g128 or mxfp4 or nvfp4))}" \
    2>&1 | tee "$OUT/pytest.txt" | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || tests_ok=0
  echo "tests_ok=$tests_ok"
fi

if has shipped; then
  echo "== shipped tables: PTX vs portable dequantization"
  timeout "${SHIPPED_TIMEOUT_S:-90}" python3 scripts/gpu_triton_quant.py --formats "$FORMATS" \
    --batches "$BATCHES" --models "$MODELS" --portable --noswap --out quant_shipped.json
fi

if has ncu; then
  NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)
  echo "== ncu ($NCU): ${NCU_TARGET:=deepseek-v3:int4-g128:16}"
  if [ -n "$NCU" ]; then
    timeout "${NCU_TIMEOUT_S:-90}" "$NCU" --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats \
      -k regex:"_gate_up_kernel|_down_kernel" --launch-skip 2 --launch-count 2 \
      python3 scripts/gpu_triton_quant.py --once "$NCU_TARGET" > "$OUT/ncu.txt" 2>&1
    tail -5 "$OUT/ncu.txt"
  fi
fi
if has tune && [ $tests_ok = 1 ]; then
  echo "== tuning into $OUT/cfg"
  plan=""
  for f in ${FORMATS//,/ }; do plan+="$f:$BATCHES;"; done
  # TUNE_PLAN: space-separated MODELS=FMT:T1,T2;FMT:... items (default: FORMATS x TUNE_MODELS)
  for item in ${TUNE_PLAN:-"${TUNE_MODELS:-$MODELS}=${plan%;}"}; do
    MOEKIT_CONFIG_DIR=$OUT/cfg MOEKIT_TUNE_BUDGET_S=${MOEKIT_TUNE_BUDGET_S:-120} \
      timeout "${TUNE_TIMEOUT_S:-150}" python3 scripts/gpu_triton_quant.py --models "${item%%=*}" \
      --tune "${item#*=}" --no-measure
  done
  (cd "$OUT" && rm -f cfg/triton/*.tmp && tar czf cfg.tgz cfg) || true
fi

if has tuned; then
  echo "== tuned tables"
  MOEKIT_CONFIG_DIR=$OUT/cfg timeout "${TUNED_TIMEOUT_S:-90}" python3 scripts/gpu_triton_quant.py \
    --formats "$FORMATS" --batches "$BATCHES" --models "$MODELS" --out quant_tuned.json \
    ${TUNED_ARGS:-}
fi
# only the listed files come back: the tuned tables in one archive
if [ -d "$OUT/cfg" ]; then
  (cd "$OUT" && rm -f cfg/triton/*.tmp && tar czf cfg.tgz cfg) || true
fi
rm -rf "$OUT/cfg"
ls -la "$OUT"
