#!/usr/bin/env bash
# session 57 scratch: int4 scale applied after the MMAs (compile-time probe)
set -u
mkdir -p $OUT
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
T=""
for m in "mixtral-8x7b:ep1" "deepseek-v3:ep8" "qwen3-30b-a3b:ep1"; do for b in 1 4 16; do T="$T,$m:int4_w4a16:$b"; done; done
timeout 400 python3 scripts/gpu_w4a16_profile.py variants --targets ${T#,} \
  --variants "base=;post=-DMK_INT4_POST=1;base2=;post2=-DMK_INT4_POST=1;nomath=-DMK_PROBE_NO_MATH=1" 2>&1 | grep -v INFO | tee -a $OUT/run.log
