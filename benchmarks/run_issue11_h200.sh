#!/usr/bin/env bash
# Issue 11 ("FP8 that pays end to end") on the H200: one device call per part, two GPUs of one
# host (nvidia-h200-x2) used as two independent lanes, each run alone on its own GPU.
# From the repo root, with the wheels of ../shared/tools/fetch-gpu-wheels carried in .whl:
#   bash benchmarks/run_issue11_h200.sh "$OUT" 1   # lane 0: GPU tests, then benchmarks/linear_block.py
#                                                   # lane 1: benchmarks/e2e.py, large Wukong, B=8192
#   bash benchmarks/run_issue11_h200.sh "$OUT" e2e    # lane 0: e2e.py at B=32768; lane 1: e2e.py at B=8192
#   bash benchmarks/run_issue11_h200.sh "$OUT" block  # linear_block.py alone, then the GPU tests
#   bash benchmarks/run_issue11_h200.sh "$OUT" final  # linear_block.py alone; then the GPU tests (GPU 0) beside
#                                                      # e2e.py --cuda-graphs at B=8192 (GPU 1)
# The "config" variant runs $CONFIG (default: the H200 cost model's Dispatch plan for the batch,
# benchmarks/results/wukong_large_modeled_plan*.json). Results: $OUT/*.json, $OUT/e2e_*/, logs.
set -uo pipefail
out=${1:?usage: run_issue11_h200.sh OUTDIR PART}
part=${2:?usage: run_issue11_h200.sh OUTDIR PART}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
t=$(mktemp -d) && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$t" .whl/*.whl \
  && export PYTHONPATH="$t:$PWD" || exit 3
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton, sys, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'torchao', torchao.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$out/env.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
lane1_gpu=$(( ngpu > 1 ? 1 : 0 ))
E2E_COMMON=(--study studies/wukong_h200.toml --seeds 0 --compile --warmup "${E2E_WARMUP:-25}" --profile-steps 10)
plan8192=${CONFIG:-benchmarks/results/wukong_large_modeled_plan.json}
plan32768=${CONFIG:-benchmarks/results/wukong_large_modeled_plan_b32768.json}

lane() {  # lane GPU LOG COMMAND...: run alone on one GPU, output to a log
  local gpu=$1 log=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$gpu; "$@" ) > "$log" 2>&1
}

if [ "$part" = 1 ]; then
  lane 0 "$out/lane0.log" bash -c "
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_trainer.py \
      tests/test_linear_direct.py tests/test_gpu_backends.py 2>&1 | tail -30
    echo '== linear block'
    timeout ${BLOCK_CAP:-400} python3 benchmarks/linear_block.py --out $out/linear_block.json --budget ${BLOCK_BUDGET:-330} \
      2>&1 | grep -v 'UserWarning\|warn_once'" &
  p0=$!
  [ "$ngpu" -gt 1 ] || wait $p0
  lane "$lane1_gpu" "$out/lane1.log" timeout "${E2E_CAP:-560}" python3 benchmarks/e2e.py "${E2E_COMMON[@]}" \
    --batch 8192 --steps "${E2E_STEPS:-80}" --config "$plan8192" --infer-batches 512,2048,8192 \
    --infer-variants bf16_mods,config --budget "${E2E_BUDGET:-470}" --out "$out/e2e_b8192" &
  p1=$!
  wait $p0 $p1
fi
if [ "$part" = e2e ]; then  # the two receipts, one GPU each (steps GPU-bound: the lanes share only CPU cores)
  lane 0 "$out/lane0.log" timeout "${E2E_CAP:-550}" python3 benchmarks/e2e.py "${E2E_COMMON[@]}" \
    --batch 32768 --steps "${E2E_STEPS32:-60}" --warmup 20 --config "$plan32768" --infer-batches 512,2048,8192 \
    --infer-variants bf16_mods,config --budget "${E2E_BUDGET:-470}" --out "$out/e2e_b32768" &
  p0=$!
  [ "$ngpu" -gt 1 ] || wait $p0
  lane "$lane1_gpu" "$out/lane1.log" timeout "${E2E_CAP:-550}" python3 benchmarks/e2e.py "${E2E_COMMON[@]}" \
    --batch 8192 --steps "${E2E_STEPS:-80}" --config "$plan8192" --infer-batches 512,2048,8192 \
    --infer-variants bf16_mods,config --budget "${E2E_BUDGET:-470}" --out "$out/e2e_b8192" &
  p1=$!
  wait $p0 $p1
fi
if [ "$part" = final ]; then  # linear_block alone, then (GPU 1) whole-step CUDA graphs in-model while GPU 0 runs the tests
  lane 0 "$out/lane0.log" bash -c "
    timeout ${BLOCK_CAP:-340} python3 benchmarks/linear_block.py --out $out/linear_block.json --budget ${BLOCK_BUDGET:-290} \
      2>&1 | grep -v 'UserWarning\|warn_once'
    touch $out/.block_done
    echo '== GPU tests'
    timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_backends.py \
      tests/test_backend_conformance.py tests/test_linear_direct.py tests/test_linear_share.py \
      tests/test_probe_cheap.py 2>&1 | tail -15" &
  p0=$!
  ( while [ ! -f "$out/.block_done" ] && kill -0 $p0 2>/dev/null; do sleep 2; done
    lane "$lane1_gpu" "$out/lane1.log" timeout "${E2E_CAP:-230}" python3 benchmarks/e2e.py "${E2E_COMMON[@]}" \
      --batch 8192 --steps "${E2E_STEPS:-80}" --config "$plan8192" --cuda-graphs \
      --variants bf16_mods,config,torchao_tensorwise_filter,scaled_mm_tensorwise_filter --budget "${E2E_BUDGET:-170}" --out "$out/e2e_b8192_graphs" ) &
  p1=$!
  wait $p0 $p1
  rm -f "$out/.block_done"
fi
if [ "$part" = block ]; then  # alone on the machine: small shapes are host-bound, other work would skew them
  lane 0 "$out/lane0.log" bash -c "
    timeout ${BLOCK_CAP:-420} python3 benchmarks/linear_block.py --out $out/linear_block.json --budget ${BLOCK_BUDGET:-380} \
      2>&1 | grep -v 'UserWarning\|warn_once'
    echo '== GPU tests'
    timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gpu_backends.py \
      tests/test_trainer.py tests/test_backend_conformance.py 2>&1 | tail -15"
fi
for f in "$out"/lane*.log; do echo "== $f"; grep -v "UserWarning\|warn_once" "$f" | tail -n 40; done
