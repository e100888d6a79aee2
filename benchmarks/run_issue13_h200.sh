#!/usr/bin/env bash
# Issue 13's receipts on one H200, from the repo root (wheels installed, see ../shared/docs/gpu.md):
#   bash benchmarks/run_issue13_h200.sh "$OUT" [N_TRIALS]
# 1. study_h200.json: one run of studies/wukong_h200.toml (compiled, batch 8192; N_TRIALS trials,
#    default the study's 40 under its 25-minute timeout), its export, one benchmarks/e2e.py run of
#    the export (bf16, bf16 + its Mods, the export; seeds 0,1; compiled, batch 8192).
# 2. probe_overhead_h200.json: benchmarks/train_step.py on large Wukong with the probe at every=100
#    (hook-free steps between collections); the field is probe_overhead_mean (target <= 0.01).
# A device call is capped at 10 minutes: run the parts separately with PART=tune|e2e|probe
# (tune: pass N_TRIALS ~ 6-8 to fit; e2e and probe: a few minutes each).
set -o pipefail
out=${1:?usage: run_issue13_h200.sh OUT [N_TRIALS]}
n=${2:-}
part=${PART:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$out" benchmarks/results
nt=(); [ -n "$n" ] && nt=(--n-trials "$n")
if [ "$part" = all ] || [ "$part" = tune ]; then
  python3 benchmarks/study_h200.py --work "$out/study_h200" --out "$out/study_h200.json" "${nt[@]}" --skip-e2e \
    2>&1 | tail -n 40   # exits 2 (no e2e results yet): the e2e part follows
fi
if [ "$part" = all ] || [ "$part" = e2e ]; then
  python3 benchmarks/study_h200.py --work "$out/study_h200" --out "$out/study_h200.json" --skip-tune 2>&1 | tail -n 40
  cp "$out/study_h200.json" benchmarks/results/study_h200.json
fi
if [ "$part" = all ] || [ "$part" = probe ]; then
  python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 --steps 200 --num-sparse 40 \
    --cardinality 100000 --probe-every 100 --probe-steps 400 --out "$out/probe_overhead_h200.json" 2>&1 | tail -n 20
  cp "$out/probe_overhead_h200.json" benchmarks/results/probe_overhead_h200.json
fi
