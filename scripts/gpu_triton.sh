#!/usr/bin/env bash
# The triton runner on the GPU machine, in one call: its GPU tests, a time/floor table with the
# configs the runner looks up, and tuning (which resumes from the tables already in
# src/moekit/configs/triton). Everything lands under $OUT (at most 8 files come back):
#   log.txt  pytest.txt  results.json  configs.tgz (the tuned tables)
#
# Usage: scripts/gpu_triton.sh [STAGES]   STAGES: comma list of env,tests,bench,tune,align,final,zipf
#   (default env,tests,bench,tune,final; also: align). Environment:
#   TUNE_MODELS  space-separated model@tp@ep (default: the four issue shapes)
#   DEADLINE_S   seconds after start when tuning stops taking new batch sizes (default 480)
#   TUNE_FORCE   comma list of batch sizes to re-tune even if already in the tables
#   TEST_TIMEOUT_S  limit of the pytest stage (default 240)
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/gpu_triton_out}
mkdir -p "$OUT"
STAGES=${1:-env,tests,bench,tune,final}
export STAGES START_S=$(date +%s)
export TUNE_MODELS=${TUNE_MODELS:-"qwen3-30b-a3b@1@1 mixtral-8x7b@2@1 deepseek-v3@8@8 gpt-oss-120b@1@1"}
export DEADLINE_S=${DEADLINE_S:-480}
exec > >(tee -a "$OUT/log.txt") 2>&1

has() { [[ ",$STAGES," == *",$1,"* ]]; }

# pytest may be missing there: install carried wheels (call with carry [".whl_triton"])
if ! python3 -c "import pytest" 2>/dev/null && ls .whl_triton/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_triton/*.whl
  export PYTHONPATH=src:/tmp/site
fi

if has env; then
  nvidia-smi -L || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
fi

if has tests; then
  echo "== GPU tests"
  timeout "${TEST_TIMEOUT_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -W ignore \
    tests/test_triton_align.py tests/test_triton_runner.py tests/test_triton_configs.py \
    2>&1 | tee "$OUT/pytest.txt" | tail -25
fi

python3 - <<'EOF'
import json, os, tarfile, time, traceback
from pathlib import Path

import torch

from moekit.bench import measure_ceilings
from moekit.report import git_commit
from moekit.runners.triton import configs as tcfg
from moekit.tune import BATCH_SIZES, measure, shape_for, tune

stages = os.environ["STAGES"].split(",")
start = float(os.environ["START_S"])
deadline = start + float(os.environ["DEADLINE_S"])
out = Path(os.environ.get("OUT", "/tmp/gpu_triton_out"))
models = [m.split("@") for m in os.environ["TUNE_MODELS"].split()]
force = {int(t) for t in os.environ.get("TUNE_FORCE", "").split(",") if t.strip()}
shapes = [shape_for(m, int(tp), int(ep)) for m, tp, ep in models]
results_path = out / "results.json"
results = json.loads(results_path.read_text()) if results_path.exists() else {}
# ceilings: the best of three measurements after a warm-up (the highest rates give the lowest,
# most demanding floor; single measurements varied by ~5% between calls)
tries = [measure_ceilings("cuda", torch.bfloat16) for _ in range(4)][1:]
ceil = max(tries, key=lambda c: c.matmul_flops_per_s)
ceil = type(ceil)(max(c.copy_bytes_per_s for c in tries), ceil.matmul_flops_per_s, ceil.dtype)
results["device"] = torch.cuda.get_device_name()
results["commit"] = git_commit()[0]
results["ceilings"] = {"copy_TBps": ceil.copy_bytes_per_s / 1e12, "mm_TFLOPs": ceil.matmul_flops_per_s / 1e12,
                       "tries": [(c.copy_bytes_per_s / 1e12, c.matmul_flops_per_s / 1e12) for c in tries]}
print(f"ceilings: copy {ceil.copy_bytes_per_s/1e12:.2f} TB/s, bf16 mm {ceil.matmul_flops_per_s/1e12:.0f} TFLOP/s")


def save():
    results_path.write_text(json.dumps(results, indent=1))


def bench(tag, routing="uniform", sizes=BATCH_SIZES, breakdown=False):
    tcfg.clear_cache()
    for s in shapes:
        t0 = time.time()
        try:
            rows = measure(s, sizes, routing=routing, ceilings=ceil, breakdown=breakdown)
        except Exception:
            traceback.print_exc()
            continue
        results.setdefault(tag, {})[s.label] = rows
        save()
        print(f"[{tag}] {s.describe()} ({time.time() - t0:.0f}s)")
        for r in rows:
            extra = " ".join(f"{k}={r[k]:.1f}" for k in ("align_us", "gate_up_us", "down_us") if k in r)
            print(f"  T={r['T']:>6} {r['layer_us']:10.1f} us  floor {r['floor_us']:9.1f}  {r['ratio']:5.2f}x  {r['gate_up']} {r['down']} {extra}")


if "bench" in stages:
    bench("heuristic" if "tune" in stages else "bench", breakdown=True)

if "tune" in stages:
    cfg_dir = Path("src/moekit/configs/triton")
    for s in shapes:
        for T in BATCH_SIZES:
            if time.time() > deadline:
                print(f"deadline: stop tuning before {s.label} T={T}")
                break
            try:
                rep = tune(s, [T], out_dir=cfg_dir, progress=False, ceilings=ceil, force=T in force,
                           note=f"scripts/gpu_triton.sh {s.label}")
            except Exception:
                traceback.print_exc()
                continue
            for r in rep.results:
                print(f"tuned {s.label} T={T}: {r.ratio:.2f}x floor ({r.layer_us:.1f} us)")
        with tarfile.open(out / "configs.tgz", "w:gz") as tar:
            for p in sorted(cfg_dir.glob("*.json")):
                tar.add(p, arcname=p.name)

if "align" in stages:
    from moekit.bench import time_ms
    from moekit.runners._align import align_block_size
    from moekit.tune import uniform_topk
    for s in shapes:
        line = []
        for T in BATCH_SIZES:
            ids = uniform_topk(T, s.num_experts, s.top_k, "cuda").ids
            us = time_ms(lambda: align_block_size(ids, s.num_experts, 64), "cuda") * 1e3
            line.append(f"{T}:{us:.1f}")
            results.setdefault("align_us", {}).setdefault(s.label, {})[T] = us
        print(f"align (BM=64) {s.label}: " + " ".join(line))
    save()

if "final" in stages:
    bench("final")
if "final2" in stages:  # a second sample of the same table (run-to-run spread)
    bench("final2")
if "zipf" in stages:
    bench("zipf", routing="zipf", sizes=(16, 256, 4096))

# summary table
print("\n== time / floor (CUDA-graph replay, uniform routing unless noted)")
for tag in ("heuristic", "bench", "final", "final2", "zipf"):
    for label, rows in results.get(tag, {}).items():
        print(f"{tag:9} {label:24} " + " ".join(f"{r['T']}:{r['ratio']:.2f}" for r in rows))
print(f"total {time.time() - start:.0f}s")
EOF
