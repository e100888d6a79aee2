#!/usr/bin/env bash
# One runner for the GPU receipts, by what they measure (run from the repo root on the device,
# carrying ".whl": ../shared/tools/fetch-gpu-wheels plus pytest-xdist, execnet, pytest-timeout):
#   bash benchmarks/device.sh "$OUT" smoke    # the GPU smoke suite (benchmarks/gpu_smoke_h200.sh)
#   bash benchmarks/device.sh "$OUT" prices   # compiled per-site prices of studies/wukong_h200.toml
#                                             # (benchmarks/site_prices.py: the cache the study reads),
#                                             # then e2e.py of the greedy config beside torchao's filter
#   bash benchmarks/device.sh "$OUT" study    # benchmarks/study_h200.py --skip-e2e: tune + export (< 10 min);
#                                             # $OUT/w/{best.json,tune_s.json,optuna.db,study_h200.log},
#                                             # $OUT/study_report.txt
#   bash benchmarks/device.sh "$OUT" study-e2e  # the same with --skip-tune, from that folder carried back
#                                             # in .carry/w (copy $OUT/w there, carry ".carry"):
#                                             # $OUT/study_h200.json, $OUT/e2e_results.json
#   bash benchmarks/device.sh "$OUT" serve    # benchmarks/serve.py: bf16 + Mods vs the served config vs
#                                             # torchao's float8 inference under CUDA graphs -> serve_h200.json
# Settings (environment): STUDY (studies/wukong_h200.toml), PRICE_BUDGET (270 s), E2E_BUDGET
# (250 s), E2E_STEPS (80), BATCH (the study's regime batch); for serve: CONFIG
# (benchmarks/results/wukong_large_modeled_plan.json), PLAN_BUDGET (120 s of per-site timing),
# SERVE_BUDGET (400 s: no row starts after it), SERVE_BATCHES (8192,2048,512).
set -uo pipefail
out=${1:?usage: device.sh OUT smoke|prices|study|study-e2e|serve}
part=${2:?usage: device.sh OUT smoke|prices|study|study-e2e|serve}
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$part" = smoke ]; then exec bash benchmarks/gpu_smoke_h200.sh "$out" "$@"; fi
if [ "$part" = serve ]; then  # one model at three serving batches: no study batch needed
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="$site:$PWD"
  timeout -k 10 $(( ${SERVE_BUDGET:-400} + 80 )) python3 benchmarks/serve.py --study "${STUDY:-studies/wukong_h200.toml}" \
    --config "${CONFIG:-benchmarks/results/wukong_large_modeled_plan.json}" --batches "${SERVE_BATCHES:-8192,2048,512}" \
    --plan measured --plan-budget "${PLAN_BUDGET:-120}" --budget "${SERVE_BUDGET:-400}" \
    --out "$out/serve_h200.json" "$@" 2>&1 | tee "$out/serve.log" | tail -45
  exit "${PIPESTATUS[0]}"
fi
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="$site:$PWD"
study=${STUDY:-studies/wukong_h200.toml}
# the batch the study's trials train at (its [regime] batch_size, else [training]'s): e2e.py must use it
batch=${BATCH:-$(python3 -c "import sys; from loka_tune.tuner.build import train_config; from loka_tune.tuner.study import load_study; print(train_config(load_study(sys.argv[1]), device='cuda').batch_size)" "$study")}
[ -n "$batch" ] || { echo "could not read the batch of $study" >&2; exit 2; }
batch_arg=(--batch "$batch")
case "$part" in
  prices)
    timeout -k 10 $(( ${PRICE_BUDGET:-270} + 60 )) python3 benchmarks/site_prices.py --study "$study" "${batch_arg[@]}" \
      --cache "$out/site_prices.json" --out "$out/site_prices_receipt.json" --greedy-config "$out/greedy.json" \
      --budget "${PRICE_BUDGET:-270}" "$@" 2>&1 | tee "$out/site_prices.log"
    [ -f "$out/greedy.json" ] || exit 1
    timeout -k 10 $(( ${E2E_BUDGET:-250} + 60 )) python3 benchmarks/e2e.py --study "$study" "${batch_arg[@]}" --seeds 0 \
      --compile --warmup 25 --steps "${E2E_STEPS:-80}" --config "$out/greedy.json" \
      --variants bf16_mods,config,torchao_tensorwise_filter,scaled_mm_tensorwise_filter \
      --budget "${E2E_BUDGET:-250}" --out "$out/e2e" 2>&1 | tail -30
    ;;
  study)
    # first the site prices of the study's own recipe values that the shipped H200 file lacks, into the
    # user's cache the study reads (what an earlier study on this machine would have left there)
    mkdir -p "$out/w"
    timeout -k 10 "${PRICE_BUDGET:-90}" python3 benchmarks/site_prices.py --study "$study" \
      --cache "${LOKA_TUNE_CACHE_DIR:-$HOME/.cache/loka-tune}/site_prices.json" --out "$out/w/site_prices_receipt.json" \
      --budget "$(( ${PRICE_BUDGET:-90} - 15 ))" 2>&1 | tail -12
    cp "${LOKA_TUNE_CACHE_DIR:-$HOME/.cache/loka-tune}/site_prices.json" "$out/w/site_prices_new.json" 2>/dev/null
    timeout -s INT -k 45 "${STUDY_TIMEOUT:-470}" python3 benchmarks/study_h200.py --study "$study" --work "$out/w" \
      --skip-e2e --out "$out/study_h200.json" "$@"
    echo "== study_h200 exit $?"; tail -45 "$out/w/study_h200.log"
    cp "$out/w/study/optuna.db" "$out/w/optuna.db" 2>/dev/null
    timeout 60 python3 -m loka_tune report "$study" --storage "sqlite:///$out/w/study/optuna.db" --no-plots \
      > "$out/study_report.txt" 2>&1; tail -30 "$out/study_report.txt"
    rm -rf "$out/w/study" "$out/w/e2e" ;;
  study-e2e)
    mkdir -p "$out/w/study"; cp .carry/w/best.json .carry/w/tune_s.json "$out/w/" || exit 2
    cp .carry/w/optuna.db "$out/w/study/optuna.db" || exit 2
    python3 benchmarks/study_h200.py --study "$study" --work "$out/w" --skip-tune --out "$out/study_h200.json" "$@"
    rc=$?; cp "$out/w/e2e/results.json" "$out/e2e_results.json" 2>/dev/null; cp "$out/w/e2e/table.md" "$out/e2e_table.md"
    cat "$out/e2e_table.md"; cp "$out/w/study_h200.log" "$out/study_h200_e2e.log"; rm -rf "$out/w"; exit $rc ;;
  *) echo "unknown part $part: smoke, prices, study, study-e2e or serve" >&2; exit 2 ;;
esac
