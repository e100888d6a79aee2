#!/usr/bin/env bash
# Issue 16 receipt: data-parallel training on two H200s of one host (kind nvidia-h200-x2).
# benchmarks/e2e.py trains bf16+Mods and the config at --nproc 1 and at --nproc 2 (the same
# global batch, steps and seeds), then benchmarks/scaling.py merges the two into
# $OUT/e2e_h200x2.json (copy it to benchmarks/results/).
#   bash benchmarks/run_issue16_h200x2.sh "$OUT"
# Settings (environment): STUDY (studies/wukong_h200.toml), BATCH (16384), CONFIG (the modeled
# H200 plan of large Wukong; a study's export when there is one), STEPS (60), WARMUP (20),
# COMPILE (1; 0 for an eager run, e.g. on a CPU), NPROC (2), CAP (250 s per e2e run).
set -euo pipefail
out=${1:?usage: run_issue16_h200x2.sh OUT}
mkdir -p "$out"
study=${STUDY:-studies/wukong_h200.toml}
config=${CONFIG:-benchmarks/results/wukong_large_modeled_plan.json}
nproc=${NPROC:-2}
compile=(); [ "${COMPILE:-1}" = 1 ] && compile=(--compile --profile-steps 10)
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader || echo "no nvidia-smi"
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/env.txt"
for n in 1 "$nproc"; do
  timeout "${CAP:-250}" python3 benchmarks/e2e.py --study "$study" --batch "${BATCH:-16384}" \
    --steps "${STEPS:-60}" --warmup "${WARMUP:-20}" --seeds 0 "${compile[@]}" --config "$config" \
    --variants bf16_mods,config --nproc "$n" --budget "$(( ${CAP:-250} - 30 ))" \
    --out "$out/e2e_${n}gpu" 2>&1 | tee "$out/e2e_${n}gpu.log"
done
python3 benchmarks/scaling.py "$out/e2e_1gpu/results.json" "$out/e2e_${nproc}gpu/results.json" \
  --out "$out/e2e_h200x2.json"
