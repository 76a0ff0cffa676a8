#!/usr/bin/env bash
# A checkpoint's declared format end to end on the GPU: the quantized-loading GPU tests, then
# `moekit bench --model DIR` on a DeepSeek-V3 config.json whose quantization_config declares
# block fp8 (no --quantization: the bench must run fp8_w8a8), beside the preset with
# --quantization fp8_w8a8 on the same shape. Under $OUT: checkpoint/*.json, preset/*.json.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src:tests}
OUT=${OUT:-/tmp/gpu_checkpoint_format_out}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu tests/test_loading_quant.py 2>&1 | tail -3
MODEL=$OUT/DeepSeek-V3
mkdir -p "$MODEL"
cat > "$MODEL/config.json" <<'JSON'
{"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
 "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
 "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
 "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5,
 "hidden_act": "silu",
 "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                         "fmt": "e4m3", "weight_block_size": [128, 128]}}
JSON
for run in "checkpoint --model $MODEL" "preset --model deepseek-v3 --quantization fp8_w8a8"; do
  set -- $run
  dir=$1; shift
  timeout "${BENCH_TIMEOUT_S:-150}" python3 -m moekit.cli.main bench "$@" --tp-size 8 \
    --ep-size 8 --batch-sizes "${BATCHES:-1,256}" --backends triton,auto --no-plot \
    --out-dir "$OUT/$dir" 2>&1 | grep -v "Warning"
done
