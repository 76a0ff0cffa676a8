#!/usr/bin/env bash
# Kimi-K2's int4 experts (compressed-tensors pack-quantized, groups of 32) on one GPU, in one
# call: the quantized-loading and checkpoint-directory GPU tests; `moekit bench` on a Kimi-K2
# config.json that declares the format (no --quantization) at EP8, on the untuned tables; the
# `w4a16` plan table and the `triton` configs tuned for the shape; the bench again on the tuned
# tables, beside the bf16 layer of the same shape on its own tuned configs. Under $OUT: log.txt,
# untuned/ tuned/ bf16/ (bench JSON), w4a16.tgz (the plan table) and cfg.tgz (the triton tables).
#
# Usage: OUT=... scripts/gpu_kimi_int4.sh   (BATCHES: batch sizes; STEPS: a subset of
#   "tests untuned plans configs tuned bf16configs bf16"; BENCH_TIMEOUT_S / TUNE_TIMEOUT_S:
#   each command's limit)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src:tests}
OUT=${OUT:-/tmp/gpu_kimi_int4_out}
CFG=$OUT/cfg
BATCHES=${BATCHES:-1,4,16,64}
STEPS=${STEPS:-tests untuned plans configs tuned bf16configs bf16}
Q=int4_w4a16:group_size=32
mkdir -p "$CFG/triton"
exec > >(tee -a "$OUT/log.txt") 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
has() { [[ " $STEPS " == *" $1 "* ]]; }

MODEL=$OUT/Kimi-K2-Thinking
mkdir -p "$MODEL"
cat > "$MODEL/config.json" <<'JSON'
{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
 "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
 "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
 "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
 "routed_scaling_factor": 2.827, "hidden_act": "silu",
 "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
     "format": "pack-quantized",
     "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                 "symmetric": true, "dynamic": false, "actorder": null}}},
   "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}}
JSON

bench() {  # bench DIR ARGS...: the layer at EP8 on this GPU's tables (and $CFG's)
  local dir=$1; shift
  echo "== bench $dir $*"
  MOEKIT_CONFIG_DIR=$CFG timeout "${BENCH_TIMEOUT_S:-150}" python3 -m moekit.cli.main bench \
    --tp-size 8 --ep-size 8 --batch-sizes "$BATCHES" --no-plot --out-dir "$OUT/$dir" "$@" \
    2>&1 | grep -v "INFO\|Warning"
}
if has tests; then
  python3 -m pytest -q -m gpu tests/test_loading_quant.py tests/test_pretrained.py 2>&1 | tail -3
fi
has untuned && bench untuned --model "$MODEL" --backends triton,w4a16,auto
if has plans; then  # written into the package's tables, where the tuned bench finds them
  echo "== w4a16 plans"
  timeout "${TUNE_TIMEOUT_S:-240}" python3 scripts/gpu_w4a16_profile.py tune --jobs kimi-k2:ep8 \
    --formats "$Q" --batches "$BATCHES" 2>&1 | grep -v "Warning" | cut -c1-400
  tar czf "$OUT/w4a16.tgz" -C src/moekit/configs w4a16
fi
configs() {  # configs QUANTIZATION: the triton tables of the shape in $CFG
  echo "== triton configs $1"
  MOEKIT_CONFIG_DIR=$CFG timeout "${TUNE_TIMEOUT_S:-240}" python3 -m moekit.cli.main tune \
    --no-progress --model kimi-k2 --tp-size 8 --ep-size 8 --quantization "$1" \
    --batch-sizes "$BATCHES" 2>&1 | grep -v "INFO\|Warning"
  tar czf "$OUT/cfg.tgz" -C "$CFG" triton
}
has configs && configs "$Q"
has tuned && bench tuned --model "$MODEL" --backends triton,w4a16,auto
has bf16configs && configs unquantized
has bf16 && bench bf16 --model kimi-k2 --quantization unquantized --backends triton,auto
