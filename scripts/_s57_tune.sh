#!/usr/bin/env bash
# session 57 scratch: int4 plan tables re-tuned for the post-scaled build, then shipped vs tuned in turns
set -u
mkdir -p $OUT/tables
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
timeout 330 python3 scripts/gpu_w4a16_profile.py tune --jobs mixtral-8x7b:ep1,deepseek-v3:ep8,qwen3-30b-a3b:ep1 \
  --formats int4_w4a16 --batches 1,4,16,64 --out-dir $OUT/tables 2>&1 | grep -v INFO | cut -c1-300 | tee $OUT/run.log
T=""
for m in "mixtral-8x7b:ep1" "deepseek-v3:ep8" "qwen3-30b-a3b:ep1"; do for b in 1 4 16; do T="$T,$m:int4_w4a16:$b"; done; done
timeout 150 python3 scripts/gpu_w4a16_profile.py variants --targets ${T#,} \
  --variants "shipped=;tuned=TABLES=$OUT/tables;shipped2=;tuned2=TABLES=$OUT/tables" 2>&1 | grep -v INFO | tee -a $OUT/run.log
