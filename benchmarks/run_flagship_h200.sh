#!/usr/bin/env bash
# The flagship study's GPU checks on one H200, in two device calls of < 10 minutes each.
# Carry ".whl" (../shared/tools/fetch-gpu-wheels, plus pytest-xdist/execnet/pytest-timeout) and run
# from the repo root:
#   bash benchmarks/run_flagship_h200.sh "$OUT" smoke   # GPU smoke suite + the probe's / trainer's /
#                                                      # custom ops' GPU tests, beside Interformer's
#                                                      # bf16 baselines (benchmarks/baseline_learning.py)
#   bash benchmarks/run_flagship_h200.sh "$OUT" study   # loka-tune tune studies/wukong_h200.toml
#                                                      # --device cuda --n-trials 4, then report + export
# Files in $OUT: smoke: env.txt gpu_smoke.{log,xml,jsonl} gpu_smoke_summary.txt baseline_learning.{json,log};
# study: study_prepare_h200.log (tune's output, timestamped), study_prepare_h200.json (the probe
# report), study_report.txt, study_best.json.
set -uo pipefail
out=${1:?usage: run_flagship_h200.sh OUT smoke|study}
part=${2:?usage: run_flagship_h200.sh OUT smoke|study}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="$site:$PWD"
stamp() { python3 -u -c 'import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"[{time.time() - t0:7.1f}s] {line}")'; }

if [ "$part" = smoke ]; then
  # Interformer's baselines in the background (one process; the smoke's workers share the GPU)
  timeout -k 10 "${BL_TIMEOUT:-330}" python3 benchmarks/baseline_learning.py --studies studies/interformer_h200.toml \
    --variants study --budget-s 240 --out "$out/baseline_learning.json" > "$out/baseline_learning.log" 2>&1 &
  bl=$!
  SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-360} bash benchmarks/gpu_smoke_h200.sh "$out" \
    tests/test_probe_robust.py tests/test_probe_cheap.py tests/test_probe_stats.py tests/test_trainer.py
  rc=$?
  wait "$bl"; blrc=$?
  echo "== baseline_learning exit $blrc"; tail -15 "$out/baseline_learning.log"
  echo "== smoke exit $rc"
  exit $(( rc != 0 || blrc != 0 ))
fi

if [ "$part" = study ]; then
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  # SIGINT at the limit: tune stops cleanly (exit 130) and keeps what it finished
  timeout -s INT -k 20 "${STUDY_TIMEOUT:-420}" python3 -m loka_tune tune studies/wukong_h200.toml --device cuda \
    --n-trials "${N_TRIALS:-4}" 2>&1 | stamp | tee "$out/study_prepare_h200.log"
  echo "== tune exit ${PIPESTATUS[0]}"
  cp runs/wukong_h200/probe_report.json "$out/study_prepare_h200.json" 2>/dev/null || echo "no probe_report.json"
  timeout 60 python3 -m loka_tune report studies/wukong_h200.toml --no-plots > "$out/study_report.txt" 2>&1
  tail -40 "$out/study_report.txt"
  timeout 60 python3 -m loka_tune export studies/wukong_h200.toml --out "$out/study_best.json" 2>&1 | tail -5
fi
