#!/usr/bin/env bash
# GPU check of in-place EPLB moves under CUDA graphs (one device call, repo root):
#   1. the GPU tests of the touched modules (EPLB, cutlass, w4a16, alltoall, layer; or
#      GPU_EPLB_TESTS="<files>");
#   2. two mutations that must make the graph test fail: the slot map replaced instead of
#      rewritten (the old behaviour), and weight copies always rebuilt anew.
# Usage: OUT=/tmp/out bash scripts/gpu_eplb_graphs.sh   (writes $OUT/eplb_graphs.log)
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moekit_eplb_graphs}
mkdir -p "$OUT"
{
echo "=== GPU tests"
python3 -m pytest -q -rfEs -p no:cacheprovider -n 2 -m gpu ${GPU_EPLB_TESTS:-tests/test_eplb.py \
    tests/test_cutlass_runner.py tests/test_w4a16.py tests/test_dispatch_alltoall.py \
    tests/test_layer.py tests/test_derived_copies.py} 2>&1 | tail -60
echo "tests exit ${PIPESTATUS[0]}"
for mutation in stale_slot_map new_weight_copies; do
    echo "=== mutation $mutation (the graph test must fail)"
    MUTATION=$mutation python3 - <<'PY' 2>&1 | grep -E "^E  |passed|failed|exit" | head -20
import os, sys
import pytest
import moekit.dispatch.slots as slots
import moekit.runners._shared as shared

if os.environ["MUTATION"] == "stale_slot_map":
    def update_(self, placement):  # new tensors: graphs keep reading the old ones
        t, c = self._tables(placement.physical_to_logical.cpu())
        self._table, self._copies = t.to(self._table.device), c.to(self._copies.device)
        self._shares = self._rank_shares(t, c)
    slots.SlotMap.update_ = update_
else:
    def copy_into_(dst, src):
        raise ValueError("mutation: never in place")
    shared.copy_into_ = copy_into_
rc = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_eplb.py",
                  "-k", "captured_before"])
print("mutation pytest exit", int(rc))
PY
done
} 2>&1 | tee "$OUT/eplb_graphs.log"
