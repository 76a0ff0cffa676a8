#!/usr/bin/env bash
# fp8 block-wise in triton_kernel's Gluon engine on the H100, with the carried Triton 3.9
# (.whl_t39/triton39.tar.xz; the machines run 3.6): its GPU tests, then fp8 (triton,
# triton_kernel) against bf16 triton timed in turns (scripts/gpu_fp8_vs_bf16.py).
#   bash scripts/gpu_fp8_gluon.sh [tests] [time] [ab]   # results under $OUT (ab: config variants,
#                                                     scripts/gpu_gluon_fp8_ab.py)
set -u
steps=${*:-tests time}
mkdir -p /tmp/t39 && tar xJf .whl_t39/triton39.tar.xz -C /tmp/t39
export TRITON_BACKENDS_IN_TREE=1 TRITON_DEFAULT_FP_FUSION=1
export TRITON_PTXAS_BLACKWELL_PATH=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
export PYTHONPATH=/tmp/t39:src
python3 -c "import triton; print('triton', triton.__version__)"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
if [[ " $steps " == *" tests "* ]]; then
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    --timeout 200 -rs tests/test_triton_kernel_gluon.py 2>&1 | tail -40 | tee "$OUT/tests.txt"
fi
if [[ " $steps " == *" time "* ]]; then
  timeout ${TIME_TIMEOUT:-330} python3 scripts/gpu_fp8_vs_bf16.py --fp8 triton,triton_kernel \
    --batches ${BATCHES:-1024,4096,16384} 2>&1 | grep -v Warning | tail -30
fi
if [[ " $steps " == *" ab "* ]]; then
  timeout ${AB_TIMEOUT:-300} python3 scripts/gpu_gluon_fp8_ab.py 2>&1 | grep -v Warning | tail -20
fi
