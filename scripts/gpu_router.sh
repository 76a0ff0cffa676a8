#!/bin/bash
# The fused routing on a GPU (sessions 72-76): its GPU tests and those of the layers that now
# route with it by default (and of the PDL chain it heads: the EP local ids, the runner's decode
# kernels), then the routing and the layer timed with either routing (eager, and compiled:
# moekit::route against Inductor's code for the PyTorch ops), the kernel with other tokens a
# program (--tiles) and other launch choices (--variants: router.RouteKernelConfig), the layer
# without the routing's PDL trigger (--gdc). Results under $OUT. All steps take about 10 min on
# an H100, more than one device call may run, so split them (tests about 3 min, probe 2-3,
# probe32 and counts 1-2 each):
#   ROUTER_STEPS="tests probe32 counts" bash scripts/gpu_router.sh; ROUTER_STEPS=probe ...
#   steps: tests (fused router on CUDA; GPU tests: router, compile, layer, eplb, local ids, the
#          runner's PDL), probe (scripts/gpu_probe_router.py), probe32 (the kernel on float32
#          logits, by tile), counts (the EPLB count modes by batch size: per pair, per expert by
#          a sum, by a histogram)
export PYTHONPATH=src:tests OUT=${OUT:-.}
# pass MOEKIT_GIT_COMMIT: the device copy's .git can name an older commit ("-dirty": the tree
# differs from the commit named)
export MOEKIT_GIT_COMMIT=${MOEKIT_GIT_COMMIT:-$(git describe --always --dirty 2>/dev/null)}
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for step in ${ROUTER_STEPS:-tests probe probe32 counts}; do
  case $step in
    tests) # all of test_router_fused on CUDA (its unmarked tests too), then the GPU tests
           timeout 90 python3 -m pytest -q -n 2 -p no:benchmark tests/test_router_fused.py \
             --junitxml="$OUT/junit_router_fused.xml" 2>&1 | tail -8
           timeout "${ROUTER_TEST_TIMEOUT:-300}" python3 -m pytest -q -n 2 -p no:benchmark -m gpu \
             tests/test_router.py tests/test_compile.py tests/test_layer.py tests/test_eplb.py \
             tests/test_dispatch_alltoall.py tests/test_triton_runner.py -k "not test_triton_runner or pdl" \
             --junitxml="$OUT/junit_router_default.xml" 2>&1 | tail -15 ;;
    probe) timeout "${ROUTER_PROBE_TIMEOUT:-380}" python3 scripts/gpu_probe_router.py \
             --batches 1,16,256,4096,16384 --tiles 4,8,16 \
             --variants "group_tile=0,num_warps=4;num_warps=4;num_warps=1;tokens=2,num_warps=4" \
             --layers qwen3-30b-a3b:1:1,deepseek-v3:8:8 --layer-batches 1,4,16,256,4096 \
             --count-variants "count=1;count=2;count=3" --compiled --record --gdc 2>&1 \
             | grep -v INFO ;;
    probe32) # the kernel alone on float32 logits (a warp's loads cover 128 scores there)
           timeout "${ROUTER_PROBE32_TIMEOUT:-90}" python3 scripts/gpu_probe_router.py \
             --batches 1,16,1024,4096,16384 --models deepseek-v3,qwen3-30b-a3b,gpt-oss-120b \
             --logits-dtype float32 --tiles 1,2,4,8 2>&1 | grep -v INFO ;;
    counts) # the EPLB count modes at every batch size (count_mode's choice against each)
           timeout "${ROUTER_COUNTS_TIMEOUT:-150}" python3 scripts/gpu_probe_router.py \
             --batches 1,4,16,64,256,1024,4096,16384 --record \
             --count-variants "count=1;count=2;count=3" --out-name router_counts.json 2>&1 \
             | grep -v INFO ;;
  esac
done
