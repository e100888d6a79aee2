#!/usr/bin/env bash
# Issue 15 receipt: benchmarks/e2e.py on large Interformer with behaviour sequences
# (studies/interformer_h200.toml: 40 sparse features, 64-event sequences, B = 4096) on one H200,
# against the modeled dispatch plan benchmarks/results/interformer_large_modeled_plan.json
# (made on a CPU by benchmarks/modeled_plan.py; its command is in that file's provenance).
#   bash benchmarks/run_issue15_h200.sh "$OUT"
# writes $OUT/env.txt, $OUT/e2e.log, $OUT/e2e_interformer/{results.json,table.md} and
# $OUT/e2e_h200_interformer.json (copy it to benchmarks/results/).
set -euo pipefail
out=${1:?usage: run_issue15_h200.sh OUT}
mkdir -p "$out"
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/env.txt"
timeout "${E2E_CAP:-560}" python3 benchmarks/e2e.py --study studies/interformer_h200.toml --batch 4096 \
  --steps "${E2E_STEPS:-80}" --warmup "${E2E_WARMUP:-25}" --seeds 0 --compile --profile-steps 10 \
  --config benchmarks/results/interformer_large_modeled_plan.json \
  --variants "${E2E_VARIANTS:-bf16,bf16_mods,config,scaled_mm_rowwise,torchao_rowwise}" \
  --infer-batches 512,4096 --infer-variants bf16_mods,config --budget "${E2E_BUDGET:-470}" \
  --out "$out/e2e_interformer" 2>&1 | tee "$out/e2e.log"
cp "$out/e2e_interformer/results.json" "$out/e2e_h200_interformer.json"
