#!/usr/bin/env bash
# session 57 scratch: final check of the w4a16 change (tests, A/B in turns, the 4-bit sweep)
set -u
mkdir -p $OUT /tmp/t39 && tar -xJf .whl_t39/triton39.tar.xz -C /tmp/t39
export TRITON_BACKENDS_IN_TREE=1 TRITON_DEFAULT_FP_FUSION=1 TRITON_PTXAS_BLACKWELL_PATH=$(command -v ptxas)
export PYTHONPATH=/tmp/t39:$PWD/src:$PWD/tests:$PWD/scripts PYTHONUNBUFFERED=1
export MOEKIT_GIT_COMMIT=${COMMIT:-unknown}
(timeout 140 python3 -m pytest -q -m gpu tests/test_w4a16.py -p no:cacheprovider 2>&1 | tail -4) | tee $OUT/run.log
T=""
for f in mxfp4 nvfp4; do for t in mixtral-8x7b:ep1:$f:1 mixtral-8x7b:ep1:$f:4 deepseek-v3:ep8:$f:16 gpt-oss-120b:ep1:$f:4 qwen3-30b-a3b:ep1:$f:16; do T="$T,$t"; done; done
timeout 110 python3 scripts/gpu_w4a16_profile.py variants --targets ${T#,} \
  --variants "new=;old=@scripts/_w4_old.cu;new2=;old2=@scripts/_w4_old.cu" 2>&1 | grep -v INFO | tee -a $OUT/run.log
mv $OUT/w4a16_variants.json $OUT/w4a16_variants_fp4.json
T=""
for m in "mixtral-8x7b:ep1" "deepseek-v3:ep8" "qwen3-30b-a3b:ep1"; do for b in 1 4 16; do T="$T,$m:int4_w4a16:$b"; done; done
timeout 80 python3 scripts/gpu_w4a16_profile.py variants --targets ${T#,} \
  --variants "new=;old=DUPSCALES=1,-DMK_INT4_POST=0" 2>&1 | grep -v INFO | tee -a $OUT/run.log
mv $OUT/w4a16_variants.json $OUT/w4a16_variants_int4.json
timeout 200 python3 scripts/gpu_w4a16.py \
  --jobs "mixtral-8x7b --tp-size 2;deepseek-v3 --tp-size 8 --ep-size 8;gpt-oss-120b;qwen3-30b-a3b" 2>&1 | grep -v INFO | grep -v "^job=" | tee -a $OUT/run.log
tar -czf $OUT/results.tgz -C $OUT results 2>/dev/null; rm -rf $OUT/results
