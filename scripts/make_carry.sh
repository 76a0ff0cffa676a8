#!/usr/bin/env bash
# Build the wheels the GPU scripts carry to the device machines (both folders are git-ignored;
# a new checkout has neither):
#
#   bash scripts/make_carry.sh      # on a machine that reaches PyPI; about 2 minutes
#
# .whl/      sgl-deep-gemm 0.2.2 and apache-tvm-ffi 0.1.11 (8 MB): the deep_gemm backend; the
#            machines' torch 2.11 loads 0.2.2, not 0.2.3+ (README, deep_gemm).
# .whl_t39/  triton39.tar.xz (45 MB): the Triton 3.9.0 wheel's package and dist-info unpacked,
#            without the AMD backend, CUPTI, Proton and both ptxas, libtriton.so stripped. The
#            machines have Triton 3.6; scripts unpack this under /tmp/t39 with
#            TRITON_BACKENDS_IN_TREE=1 and TRITON_PTXAS_BLACKWELL_PATH=$(command -v ptxas)
#            (scripts/gpu_triton_versions.sh). Together with the tree it fits the 64 MiB a call
#            carries once benchmarks/results/ is moved out of the tree for the call.
# The device machines run CPython 3.12 on x86_64 Linux, whatever this machine runs.
set -eu
cd "$(dirname "$0")/.."
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 $PLATFORMS \
    -d "$TMP" sgl-deep-gemm==0.2.2 apache-tvm-ffi==0.1.11 triton==3.9.0
mkdir -p .whl .whl_t39
cp "$TMP"/sgl_deep_gemm-*.whl "$TMP"/apache_tvm_ffi-*.whl .whl/
mkdir "$TMP/t39" && (cd "$TMP/t39" && python3 -m zipfile -e "$TMP"/triton-3.9.0-*.whl .)
T="$TMP/t39/triton"
rm -rf "$T/backends/amd" "$T/backends/nvidia/lib/cupti" "$T/backends/nvidia/lib/cupti-blackwell" \
    "$T/backends/nvidia/bin/ptxas" "$T/backends/nvidia/bin/ptxas-blackwell" "$T/_C/libproton.so" \
    "$T/instrumentation/libGPUInstrumentationTestLib.so"
strip --strip-unneeded "$T/_C/libtriton.so"
tar cf - -C "$TMP/t39" triton triton-3.9.0.dist-info | xz -9 -T2 > .whl_t39/triton39.tar.xz
ls -l .whl .whl_t39
