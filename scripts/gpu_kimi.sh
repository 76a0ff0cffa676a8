#!/usr/bin/env bash
# Kimi-K2's experts at EP8 on one GPU, in one call, in the checkpoint's own format (FORMAT):
#   int4  Kimi-K2-Thinking: compressed-tensors pack-quantized int4, groups of 32 (`triton`, `w4a16`)
#   fp8   Kimi-K2-Instruct: fp8 block-wise [128, 128], dynamic activations (`triton`, `deep_gemm`
#         when .whl/ is carried: bash scripts/make_carry.sh)
# Steps: the quantized-loading and checkpoint-directory GPU tests; `moekit bench` on a config.json
# that declares the format (no --quantization) on the untuned tables (the package's tables of the
# shape, format and GPU moved aside for it); the `w4a16` plan table (int4)
# and the `triton` configs tuned for the shape; the bench again on the tuned tables, beside the
# bf16 layer of the same shape on its own tuned configs. Under $OUT: log.txt, untuned/ tuned/
# bf16/ (bench JSON), w4a16.tgz (the plan table) and cfg.tgz (the triton tables).
#
# Usage: OUT=... [FORMAT=int4|fp8] scripts/gpu_kimi.sh   (BATCHES: batch sizes; STEPS: a subset
#   of "tests untuned plans configs tuned bf16configs bf16"; BENCH_TIMEOUT_S / TUNE_TIMEOUT_S:
#   each command's limit)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-src:tests}
OUT=${OUT:-/tmp/gpu_kimi_out}
CFG=$OUT/cfg
FORMAT=${FORMAT:-int4}
BATCHES=${BATCHES:-1,4,16,64}
STEPS=${STEPS:-tests untuned plans configs tuned bf16configs bf16}
mkdir -p "$CFG/triton"
source scripts/gpu_common.sh  # log.txt, carried wheels, versions, has

case $FORMAT in
int4)
  Q=int4_w4a16:group_size=32 TAG=int4_w4a16-g32-sym BACKENDS=triton,w4a16,auto
  MODEL=$OUT/Kimi-K2-Thinking
  QCONFIG='{"quant_method": "compressed-tensors", "format": "pack-quantized",
   "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
     "format": "pack-quantized",
     "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                 "symmetric": true, "dynamic": false, "actorder": null}}},
   "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*"]}' ;;
fp8)
  Q=fp8_w8a8 TAG=fp8_w8a8-block128x128-token_group BACKENDS=triton,deep_gemm,auto
  MODEL=$OUT/Kimi-K2-Instruct
  QCONFIG='{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
   "weight_block_size": [128, 128]}' ;;
*) echo "FORMAT must be int4 or fp8, got $FORMAT"; exit 2 ;;
esac
mkdir -p "$MODEL"
cat > "$MODEL/config.json" <<JSON
{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
 "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
 "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
 "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": true,
 "routed_scaling_factor": 2.827, "hidden_act": "silu", "quantization_config": $QCONFIG}
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
if has untuned; then  # without the package's tables of this shape, format and GPU
  DEV=$(python3 -c "import torch; from moekit.runners._tables import device_slug as s
print(s(torch.cuda.get_device_name()))")
  HIDE=$(mktemp -d)
  mv src/moekit/configs/triton/*,E=48,*quant=${TAG}*,device=${DEV},* "$HIDE"/ 2>/dev/null
  echo "== hidden: $(ls "$HIDE" | tr '\n' ' ')"
  bench untuned --model "$MODEL" --backends $BACKENDS
  mv "$HIDE"/* src/moekit/configs/triton/ 2>/dev/null
fi
# the plans are written into the package's tables, where the tuned bench finds them
if has plans && [ "$FORMAT" = int4 ]; then
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
has tuned && bench tuned --model "$MODEL" --backends $BACKENDS
has bf16configs && configs unquantized
has bf16 && bench bf16 --model kimi-k2 --quantization unquantized --backends triton,auto
