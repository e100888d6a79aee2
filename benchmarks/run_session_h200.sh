#!/usr/bin/env bash
# One device call for the foundation/probe/mods/tuner GPU evidence (see BENCHMARKS.md).
# Usage on the H200, from the repo root, after installing the carried wheels:
#   bash benchmarks/run_session_h200.sh "$OUT"
set -uo pipefail
out=${1:?usage: run_session_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"

echo "== GPU tests (foundation, probe, fused epilogue)"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_data.py tests/test_trainer.py tests/test_fused_epilogue.py 2>&1 | tail -25 | tee "$out/gpu_tests.log"

echo "== train step, breakdown, probe overhead (large Wukong, B=8192)"
timeout "${STEP_TIMEOUT:-170}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
  --steps 200 --num-sparse 40 --cardinality 100000 --probe-every 100 --out "$out/train_step.json" 2>&1 \
  | tail -20 | tee "$out/train_step.log"

if [ -f benchmarks/fused_epilogue.py ]; then
  echo "== fused epilogue"
  timeout "${FUSED_TIMEOUT:-100}" python3 benchmarks/fused_epilogue.py --out "$out/fused.json" 2>&1 | tail -30 | tee "$out/fused.log"
fi

echo "== wukong_h200 study (capped)"
timeout "${STUDY_TIMEOUT:-200}" python3 -m loka_tune tune studies/wukong_h200.toml --device cuda \
  --n-trials "${STUDY_TRIALS:-10}" --timeout "${STUDY_TRIAL_S:-150}" --no-tracking --force 2>&1 \
  | tail -40 | tee "$out/study.log"
python3 -m loka_tune report studies/wukong_h200.toml 2>&1 | tail -30 | tee -a "$out/study.log"
python3 -m loka_tune export studies/wukong_h200.toml --out "$out/wukong_best.json" 2>&1 | tail -5 | tee -a "$out/study.log"
