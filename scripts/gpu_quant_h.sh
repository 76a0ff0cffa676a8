#!/bin/bash
# h quantized in gate_up's epilogue (fp8 block-wise, `PIPELINE.quant_h_in_gate_up`): GPU tests
# and the layer in turns with and without it (session 46). Native Triton on the device.
#   QH_STEPS="tests ab ratio" bash scripts/gpu_quant_h.sh      # results under $OUT
#   steps: tests (the new GPU tests), ab (decode A/B), ratio (issue 4's bf16 / fp8 at decode),
#          abT (A/B at T = 256-4096), wide (decode tables' gate_up made 128 wide, so that it
#          quantizes h; wideT the same at T = 256-4096), more (the fp8 / triton runner GPU tests)
export PYTHONPATH=src:tests OUT=${OUT:-.}
# pass MOEKIT_GIT_COMMIT: the device copy's .git can name an older commit ("-dirty": the tree
# differs from the commit named)
export MOEKIT_GIT_COMMIT=${MOEKIT_GIT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
FP8_JOBS="qwen3-30b-a3b 1 1 fp8_w8a8;deepseek-v3 8 8 fp8_w8a8;gpt-oss-120b 1 1 fp8_w8a8;mixtral-8x7b 2 1 fp8_w8a8"
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
for step in ${QH_STEPS:-tests ab ratio}; do
  case $step in
    tests) python3 -m pytest -q -m gpu tests/test_triton_quant_h.py 2>&1 | tail -15 \
             | tee "$OUT/gpu_tests_quant_h.txt" ;;
    ab) python3 scripts/gpu_probe_decode_pdl.py --variants quant_h_in_gate_up=0,1 \
          --jobs "$FP8_JOBS" --batches 1,4,16,64 --out quant_h_decode ;;
    ratio) python3 scripts/gpu_fp8_vs_bf16.py --batches 1,4,16,64 --out fp8_vs_bf16_decode ;;
    abT) python3 scripts/gpu_probe_decode_pdl.py --variants quant_h_in_gate_up=0,1 \
           --jobs "$FP8_JOBS" --batches 256,1024,4096 --out quant_h_large ;;
    wide) python3 scripts/gpu_decode_variants.py --variants wide --jobs "$FP8_JOBS" \
            --batches 1,4,16,64 --min-gain 1.02 --out quant_h_wide ;;
    wideT) python3 scripts/gpu_decode_variants.py --variants wide --jobs "$FP8_JOBS" \
             --batches 256,1024,4096 --min-gain 1.02 --out quant_h_wide_large ;;
    more) python3 -m pytest -q -m gpu tests/test_triton_quant.py tests/test_triton_runner.py \
            2>&1 | tail -15 | tee "$OUT/gpu_tests_triton.txt" ;;
  esac
done
