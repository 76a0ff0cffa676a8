#!/usr/bin/env bash
# fp8 with static per-tensor activation scales in the triton runner, on the GPU machine in one
# call: its GPU tests (bit-identical row quantizer, preset shapes, CUDA graph) and the other
# quantized-format GPU tests of the files it touches, then scripts/gpu_fp8_static.py's timing.
# Under $OUT: log.txt pytest.txt fp8_static.json
#
# Usage: scripts/gpu_fp8_static.sh [STAGES]   STAGES: comma list of tests,time (default both)
#   MODELS / BATCHES: the timing's presets and batch sizes; TEST_K: pytest -k of the GPU tests;
#   TEST_TIMEOUT_S / TIME_TIMEOUT_S: the stages' limits
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src:tests}
OUT=${OUT:-/tmp/gpu_fp8_static_out}
mkdir -p "$OUT"
STAGES=${1:-tests,time}
exec > >(tee -a "$OUT/log.txt") 2>&1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
nvidia-smi -L || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
if has tests; then
  echo "== GPU tests"
  timeout "${TEST_TIMEOUT_S:-360}" python3 -m pytest -q -n 2 -m gpu tests/test_triton_quant.py \
    tests/test_quant_act.py -k "${TEST_K:-not tiny_tune}" \
    > "$OUT/pytest.txt" 2>&1
  rc=$?
  tail -5 "$OUT/pytest.txt"
  python3 -m pytest -q tests/test_quant_act.py -k expert_rows >> "$OUT/pytest.txt" 2>&1 \
    && echo "expert_rows kernel tests on the GPU: passed" || { echo "expert_rows: FAILED"; rc=1; }
fi
if has time; then
  echo "== timing"
  timeout "${TIME_TIMEOUT_S:-220}" python3 scripts/gpu_fp8_static.py \
    --models "${MODELS:-qwen3-30b-a3b,mixtral-8x7b,deepseek-v3}" \
    --batches "${BATCHES:-1,16,256,4096}" || rc=1
fi
exit $rc
