# Sourced by the gpu_*.sh scripts that take $OUT and $STEPS: everything printed goes to
# $OUT/log.txt too, deep_gemm's wheels are installed where carried (`.whl`, see make_carry.sh),
# the library versions and GPU are printed, and `has STEP` tells whether STEP is in $STEPS.
exec > >(tee -a "$OUT/log.txt") 2>&1
if ls .whl/*.whl >/dev/null 2>&1 &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
has() { [[ " $STEPS " == *" $1 "* ]]; }
