#!/usr/bin/env bash
# One device call for the foundation/probe/mods/tuner GPU evidence (see BENCHMARKS.md).
# Usage on the H200, from the repo root, after installing the carried wheels:
#   bash benchmarks/run_session_h200.sh "$OUT" 1   # tests, train step, probe overhead, Mods, policies, fused
#   bash benchmarks/run_session_h200.sh "$OUT" 2   # the capped wukong_h200 study
#   bash benchmarks/run_session_h200.sh "$OUT" probe  # probe GPU test, probe overhead, fused epilogue (CUDA graphs too)
#   bash benchmarks/run_session_h200.sh "$OUT" study  # wukong_h200 study for STUDY_TIMEOUT s (resumes runs/ if carried), report, export
#   bash benchmarks/run_session_h200.sh "$OUT" e2e    # benchmarks/e2e.py with $CONFIG (default: the study's export if
#                                                      # present, else benchmarks/results/wukong_h200_best.json, else the modeled plan)
set -uo pipefail
out=${1:?usage: run_session_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"

part=${2:-1}
if [ "$part" = 1 ]; then
echo "== GPU tests (foundation, probe, fused epilogue)"
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_data.py tests/test_trainer.py tests/test_fused_epilogue.py 2>&1 | tail -25 | tee "$out/gpu_tests.log"

PLAN=benchmarks/results/wukong_large_modeled_plan.json
MODS=nobias,bn256,hswish
echo "== train step, breakdown, probe overhead (large Wukong, B=8192), then Mods and FP8 policies"
timeout "${STEP_TIMEOUT:-220}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
  --steps 200 --num-sparse 40 --cardinality 100000 --probe-every 100 --out "$out/train_step.json" \
  --variant-steps 60 \
  --variant "bf16|none|bf16" --variant "bf16 no-bias|nobias|bf16" --variant "bf16 blocknorm256|bn256|bf16" \
  --variant "bf16 hardswish|hswish|bf16" --variant "bf16 all mods|$MODS|bf16" \
  --variant "torchao tensorwise, no mods|none|torchao:tensorwise" \
  --variant "torchao tensorwise|$MODS|torchao:tensorwise" --variant "torchao rowwise|$MODS|torchao:rowwise" \
  --variant "scaled_mm rowwise|$MODS|uniform:e4m3.row.fa.torch_scaled_mm" \
  --variant "fbgemm rowwise|$MODS|uniform:e4m3.row.fa.fbgemm" \
  --variant "triton rowwise|$MODS|uniform:e4m3.row.fa.triton" \
  --variant "dispatch (modeled plan)|config|$PLAN" 2>&1 | tail -40 | tee "$out/train_step.log"

echo "== Mods on the paper preset (B=8192)"
timeout "${PAPER_TIMEOUT:-90}" python3 benchmarks/train_step.py --model wukong --preset paper --batch 8192 \
  --num-sparse 26 --cardinality 100000 --skip-main --variant-steps 60 --out "$out/train_step_paper.json" \
  --variant "bf16|none|bf16" --variant "no-bias|nobias|bf16" --variant "blocknorm256|bn256|bf16" \
  --variant "hardswish|hswish|bf16" --variant "all mods|$MODS|bf16" 2>&1 | tail -12 | tee "$out/train_step_paper.log"

if [ -f benchmarks/fused_epilogue.py ]; then
  echo "== fused epilogue"
  timeout "${FUSED_TIMEOUT:-100}" python3 benchmarks/fused_epilogue.py --out "$out/fused.json" 2>&1 | tail -30 | tee "$out/fused.log"
fi

fi
if [ "$part" = 2 ]; then
PLAN=benchmarks/results/wukong_large_modeled_plan.json
MODS=nobias,bn256,hswish
echo "== train step, breakdown, probe overhead (large Wukong, B=8192); FP8 policies with all Mods"
timeout "${STEP_TIMEOUT:-190}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
  --steps "${STEPS:-200}" --num-sparse 40 --cardinality 100000 --probe-every 100 --out "$out/train_step.json" \
  --variant-steps "${VSTEPS:-40}" --variant "bf16 all mods|$MODS|bf16" \
  --variant "torchao tensorwise|$MODS|torchao:tensorwise" --variant "torchao rowwise|$MODS|torchao:rowwise" \
  --variant "scaled_mm rowwise|$MODS|uniform:e4m3.row.fa.torch_scaled_mm" \
  --variant "fbgemm rowwise|$MODS|uniform:e4m3.row.fa.fbgemm" \
  --variant "triton rowwise|$MODS|uniform:e4m3.row.fa.triton" \
  --variant "dispatch (modeled plan)|config|$PLAN" 2>&1 | grep -v "UserWarning\|_warn_once" | tee "$out/train_step.log"
echo "== wukong_h200 study (capped)"
timeout "${STUDY_TIMEOUT:-190}" python3 -m loka_tune tune studies/wukong_h200.toml --device cuda \
  --n-trials "${STUDY_TRIALS:-6}" --timeout "${STUDY_TRIAL_S:-100}" --no-tracking --force 2>&1 \
  | tail -40 | tee "$out/study.log"
python3 -m loka_tune report studies/wukong_h200.toml 2>&1 | tail -30 | tee -a "$out/study.log"
python3 -m loka_tune export studies/wukong_h200.toml --out "$out/wukong_best.json" 2>&1 | tail -5 | tee -a "$out/study.log"
fi
if [ "$part" = probe ]; then
echo "== GPU tests: probe on CUDA, fused epilogue"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_probe_stats.py \
  tests/test_fused_epilogue.py 2>&1 | tail -15 | tee "$out/gpu_tests.log"
echo "== probe overhead (large Wukong, B=8192, every=100, 300 probed steps); Mods bf16 vs FP8 unfused vs fused"
MODS=nobias,bn256,hswish
timeout "${STEP_TIMEOUT:-270}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
  --steps 120 --num-sparse 40 --cardinality 100000 --probe-every 100 --probe-steps 300 --profile-steps 5 \
  --variant-steps 40 --variant "bf16 all mods|$MODS|bf16" \
  --variant "triton rowwise, all mods, unfused|$MODS|uniform:e4m3.row.fa.triton" \
  --variant "triton rowwise, all mods, fused epilogue|$MODS,fused|uniform:e4m3.row.fa.triton" \
  --out "$out/train_step_probe.json" 2>&1 | grep -v "UserWarning\|_warn_once" | tee "$out/train_step_probe.log"
echo "== fused epilogue (do_bench and CUDA graphs)"
timeout "${FUSED_TIMEOUT:-150}" python3 benchmarks/fused_epilogue.py --cudagraph --budget 110 \
  --out "$out/fused.json" 2>&1 | tail -30 | tee "$out/fused.log"
fi
if [ "$part" = study ]; then
echo "== wukong_h200 study (stops starting trials after STUDY_TIMEOUT; resumable)"
timeout "${STUDY_CAP:-540}" python3 -m loka_tune tune studies/wukong_h200.toml --device cuda \
  --timeout "${STUDY_TIMEOUT:-420}" --no-tracking --force 2>&1 | grep -v "UserWarning\|_warn_once" | tee "$out/study.log"
python3 -m loka_tune report studies/wukong_h200.toml --out-dir "$out" 2>&1 | tail -40 | tee -a "$out/study.log"
python3 -m loka_tune export studies/wukong_h200.toml --out "$out/wukong_best.json" 2>&1 | tail -5 | tee -a "$out/study.log"
cp "$out/wukong_best.json" runs/wukong_h200/best.json 2>/dev/null  # stays on a warm machine for the e2e part
mkdir -p "$out/runs" && cp -r runs/wukong_h200 "$out/runs/" 2>/dev/null
fi
if [ "$part" = e2e ]; then
# the exported config: $CONFIG, else the study's export on this (warm) machine, else one copied
# into the repo from an earlier call's $OUT, else the CPU-built Dispatch plan
for c in "${CONFIG:-}" runs/wukong_h200/best.json benchmarks/results/wukong_h200_best.json \
         benchmarks/results/wukong_large_modeled_plan.json; do
  if [ -n "$c" ] && [ -f "$c" ]; then CONFIG=$c; break; fi
done
echo "== end-to-end: large Wukong, B=8192, compiled, $CONFIG"
timeout "${E2E_CAP:-560}" python3 benchmarks/e2e.py --study studies/wukong_h200.toml --batch 8192 \
  --steps "${E2E_STEPS:-120}" --warmup 30 --seeds "${E2E_SEEDS:-0}" --config "$CONFIG" --compile \
  --infer-batches 512,2048,8192 --budget "${E2E_BUDGET:-480}" --out "$out/e2e" 2>&1 \
  | grep -v "UserWarning\|_warn_once" | tee "$out/e2e.log"
fi
