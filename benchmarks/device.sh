#!/usr/bin/env bash
# One runner for the GPU receipts, by what they measure (run from the repo root on the device,
# carrying ".whl": ../shared/tools/fetch-gpu-wheels plus pytest-xdist, execnet, pytest-timeout).
# One part per device call (a call is 10 minutes); arguments after PART go to the part's script.
#   bash benchmarks/device.sh "$OUT" smoke    # the GPU smoke suite (benchmarks/gpu_smoke_h200.sh);
#                                             # further test paths run in the same pytest
#   bash benchmarks/device.sh "$OUT" prices   # compiled per-site prices of studies/wukong_h200.toml
#                                             # (benchmarks/site_prices.py: the cache the study reads),
#                                             # then e2e.py of the greedy config beside torchao's filter
#   bash benchmarks/device.sh "$OUT" study    # benchmarks/study_h200.py --skip-e2e: tune + export (< 10 min);
#                                             # $OUT/w/{best.json,tune_s.json,optuna.db,study_h200.log,
#                                             # site_prices_{new,after}.json: the price cache before and
#                                             # after the study, for cells to ship},
#                                             # $OUT/study_report.txt
#   bash benchmarks/device.sh "$OUT" study-e2e  # the same with --skip-tune, from that folder carried back
#                                             # in .carry/w (copy $OUT/w there, carry ".carry"):
#                                             # $OUT/study_h200.json, $OUT/e2e_results.json (the receipt
#                                             # is named after the study file: wukong_h200_b32768.toml
#                                             # -> study_h200_b32768.json)
#   bash benchmarks/device.sh "$OUT" serve    # benchmarks/serve.py: bf16 + Mods vs the served config vs
#                                             # torchao's float8 inference under CUDA graphs -> serve_h200.json
#   bash benchmarks/device.sh "$OUT" e2e      # benchmarks/e2e.py of $STUDY at its batch: CONFIG against
#                                             # bf16 and uniform FP8, compiled, with serving latency
#                                             # -> $OUT/e2e/{results.json,table.md}, $OUT/e2e.log; e.g. large
#                                             # Interformer with sequences: STUDY=studies/interformer_h200.toml
#                                             # INFER_BATCHES=512,4096 E2E_VARIANTS=bf16,bf16_mods,config,scaled_mm_rowwise,torchao_rowwise
#   bash benchmarks/device.sh "$OUT" scaling  # data parallel (kind nvidia-h200-x2): e2e.py of bf16 + Mods and
#                                             # CONFIG at --nproc 1 and NPROC, merged by benchmarks/scaling.py
#                                             # -> $OUT/e2e_scaling.json; NPROC=1 on one H200: the one-GPU
#                                             # half alone (torchrun, 1 process) -> $OUT/e2e_1gpu.json
#   bash benchmarks/device.sh "$OUT" probe    # the probe's overhead on the compiled large Wukong step
#                                             # (benchmarks/train_step.py --probe-every 100)
#                                             # -> $OUT/probe_overhead_h200.json, then the probe's GPU tests
#   bash benchmarks/device.sh "$OUT" train-step  # eager large Wukong step: breakdown, probe, bf16 + Mods vs
#                                             # FP8 policies vs the modeled plan -> $OUT/train_step.json
#   bash benchmarks/device.sh "$OUT" kernels  # GPU backend tests, quantization bandwidth
#                                             # (benchmarks/kernels_quant.py), GEMM suite (gemm_suite.py run)
#   bash benchmarks/device.sh "$OUT" linear-block  # benchmarks/linear_block.py alone on the machine
#                                             # (host-bound small shapes) -> $OUT/linear_block.json
#   bash benchmarks/device.sh "$OUT" tune     # the CLI as a user runs it: loka-tune tune $STUDY --device cuda
#                                             # --n-trials N_TRIALS, report, export -> $OUT/tune.log (timestamped),
#                                             # probe_report.json, tune_report.txt, tune_best.json,
#                                             # site_prices_after.json (the price cache after it)
#   bash benchmarks/device.sh "$OUT" baselines  # bf16 baselines of BASELINE_STUDIES (benchmarks/baseline_learning.py)
#                                             # -> $OUT/baseline_learning.{json,log}; extra arguments go to
#                                             # the script (--seeds 0,1 --twins 2: noise twins, floors vs budget)
#   bash benchmarks/device.sh "$OUT" train-export  # loka-tune train --config CONFIG (an export) beside plain bf16,
#                                             # at the study's schedule -> $OUT/train_export.json
#   bash benchmarks/device.sh "$OUT" prepare-ab  # the study's preparation alone (benchmarks/prepare_profile.py),
#                                             # as the device runs it (the probe beside the noise twin) and
#                                             # --sequential, each from a fresh process on cold inductor and
#                                             # triton caches of its own (none of the machine's compiled
#                                             # graphs read or left for a later part; each arm prices from its
#                                             # own copy of the user's price cache, so neither gets the other's
#                                             # new cells) -> $OUT/prepare_{beside,sequential}.{txt,log}
#   bash benchmarks/device.sh "$OUT" first-compile  # the study's bf16 baseline compiled from fresh processes on
#                                             # cold caches, plain vs inductor's compile workers started early
#                                             # vs the compiler imported in a thread (benchmarks/first_compile.py)
#                                             # -> $OUT/first_compile.{json,log}
#   bash benchmarks/device.sh "$OUT" gemm-autotune  # the flagship's largest sites timed compiled under inductor's
#                                             # default lowering (cuBLAS) and max_autotune_gemm (its Triton
#                                             # templates against cuBLAS), bf16 and tensorwise FP8, each cell's
#                                             # longest kernels named (benchmarks/gemm_autotune.py)
#                                             # -> $OUT/gemm_autotune.{json,log}
# Settings (environment): CALL_LIMIT (600 s: the device call's own limit; the study part SIGINTs the
# study early enough that its report and files still come back), STUDY (studies/wukong_h200.toml), PRICE_BUDGET (270 s), E2E_BUDGET
# (250 s for prices, 470 s for e2e), E2E_STEPS (80; 60 for scaling), BATCH (the study's regime batch;
# 16384 for scaling); for serve: CONFIG (benchmarks/results/wukong_large_modeled_plan.json), PLAN_BUDGET
# (120 s of per-site timing), SERVE_BUDGET (400 s: no row starts after it), SERVE_BATCHES (8192,2048,512),
# SERVE_CANDIDATES (extra fwd choices the plan prices at every site, comma list; default
# e4m3.tensor.fa.torch_scaled_mm,e4m3.row.fa.torch_scaled_mm: fast accumulation, as torchao's inference),
# SERVE_MODE (reduce-overhead; graph: one captured CUDA graph per row, see serve.py), SERVE_VERIFY
# (unset; 1: --verify, the plan checked against whole-model alternatives, ~15 s each at 8192);
# for e2e: CONFIG (benchmarks/results/<model>_large_modeled_plan[_b<BATCH>].json, <model> the study file's
# name up to its first "_"), E2E_WARMUP (25), E2E_VARIANTS (e2e.py's own list), INFER_BATCHES
# (512,2048,8192; empty: no serving rows), INFER_VARIANTS (bf16_mods,config), E2E_CAP (560 s), E2E_KERNEL_SRC
# (unset; 1: $out/cast_kernels.tgz, inductor's generated source of every FP8 cast and amax kernel, written
# with TORCHINDUCTOR_BENCHMARK_KERNEL=1 so each holds its bytes moved, and benchmarks/cast_kernels.py's
# reading of them against the profiles: $out/cast_kernels.{json,md});
# for scaling: CONFIG (as e2e), NPROC (2), E2E_WARMUP (20), COMPILE (1; 0 eager), E2E_CAP (250 s per run);
# for probe: STEPS (400), PROBE_STEPS (600), PROBE_TESTS (four probe test files; empty: none),
# TEST_TIMEOUT (200 s), STEP_TIMEOUT (420 s); for train-step: STEPS (200), VSTEPS (40), STEP_TIMEOUT (190 s); for kernels: QUICK (0; 1: --quick),
# SKIP_TESTS / SKIP_QUANT / SKIP_SUITE (0), TEST_TIMEOUT (200 s), QUANT_TIMEOUT (60 s), SUITE_TIMEOUT
# (300 s); for prepare-ab: ARMS ("beside sequential"), AB_TIMEOUT (170 s an arm); for linear-block: BLOCK_BUDGET (290 s); for tune: N_TRIALS (4), STUDY_TIMEOUT (420 s, then
# SIGINT: tune keeps what it finished; 470 s for study); for baselines: BASELINE_STUDIES
# (studies/interformer_h200.toml; a comma list), BL_BUDGET (240 s); for train-export: CONFIG
# (benchmarks/results/study_best_h200.json); for first-compile: FC_ARMS (plain,warm_pool,import_thread),
# FC_REPS (2), FC_BUDGET (240 s: no run starts after it); for gemm-autotune: GA_BUDGET (240 s: no cell
# starts after it; an FP8 cell under max_autotune_gemm takes 100-160 s on an H100, its 106 choices a GEMM).
set -uo pipefail
usage="usage: device.sh OUT smoke|prices|study|study-e2e|serve|e2e|scaling|probe|train-step|kernels|linear-block|tune|baselines|train-export|first-compile|prepare-ab|gemm-autotune"
out=${1:?$usage}
part=${2:?$usage}
shift 2
parts=${usage#usage: device.sh OUT }
[[ "|$parts|" == *"|$part|"* ]] || { echo "unknown part $part: one of $parts" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "$part" = smoke ]; then exec bash benchmarks/gpu_smoke_h200.sh "$out" "$@"; fi
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="$site:$PWD"
study=${STUDY:-studies/wukong_h200.toml}
env_txt() {  # the machine and versions of a receipt -> $out/env.txt
  { nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader || echo "no nvidia-smi"
    python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())"
    python3 -c "import triton, torchao; print('triton', triton.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1
  } 2>&1 | tee "$out/env.txt"
}
study_batch() {  # the batch the study's trials train at (its [regime] batch_size, else [training]'s)
  python3 -c "import sys; from loka_tune.tuner.build import train_config; from loka_tune.tuner.study import load_study; print(train_config(load_study(sys.argv[1]), device='cuda').batch_size)" "$study"
}
modeled_plan() {  # the CPU-built Dispatch plan of the study's model at a batch, where one is committed
  local model b=$1
  model=$(basename "$study" .toml); model=${model%%_*}
  for c in "benchmarks/results/${model}_large_modeled_plan_b$b.json" "benchmarks/results/${model}_large_modeled_plan.json"; do
    if [ -f "$c" ]; then echo "$c"; return; fi
  done
  echo "no modeled plan of $model in benchmarks/results/: set CONFIG" >&2; return 1
}
quiet() { grep -v "UserWarning\|warn_once"; }
within_call() {  # a part's timeout: $1 seconds, or less so that $2 seconds of the device call remain after it
  local left=$(( ${CALL_LIMIT:-600} - SECONDS - $2 ))  # SECONDS: since this script started
  (( left < $1 )) && echo "$left" || echo "$1"
}
case "$part" in
  serve)  # one model at three serving batches: no study batch needed
    timeout -k 10 $(( ${SERVE_BUDGET:-400} + 80 )) python3 benchmarks/serve.py --study "$study" \
      --config "${CONFIG:-benchmarks/results/wukong_large_modeled_plan.json}" --batches "${SERVE_BATCHES:-8192,2048,512}" \
      --plan measured --plan-budget "${PLAN_BUDGET:-120}" --budget "${SERVE_BUDGET:-400}" \
      --candidates "${SERVE_CANDIDATES-e4m3.tensor.fa.torch_scaled_mm,e4m3.row.fa.torch_scaled_mm}" \
      --compile-mode "${SERVE_MODE:-reduce-overhead}" ${SERVE_VERIFY:+--verify} --out "$out/serve_h200.json" "$@" 2>&1 | tee "$out/serve.log" | tail -45
    exit "${PIPESTATUS[0]}" ;;
  scaling)  # the same global batch, steps and seeds at 1 and NPROC GPUs (kind nvidia-h200-x2)
    env_txt
    nproc=${NPROC:-2}
    config=${CONFIG:-$(modeled_plan "${BATCH:-16384}")} || exit 2
    compile=(); [ "${COMPILE:-1}" = 1 ] && compile=(--compile --profile-steps 10)
    ns=(1); [ "$nproc" != 1 ] && ns+=("$nproc")  # NPROC=1: the receipt's one-GPU half alone (one H200)
    for n in "${ns[@]}"; do
      timeout -k 10 "${E2E_CAP:-250}" python3 benchmarks/e2e.py --study "$study" --batch "${BATCH:-16384}" \
        --steps "${E2E_STEPS:-60}" --warmup "${E2E_WARMUP:-20}" --seeds 0 "${compile[@]}" --config "$config" \
        --variants bf16_mods,config --nproc "$n" --budget "$(( ${E2E_CAP:-250} - 30 ))" \
        --out "$out/e2e_${n}gpu" "$@" 2>&1 | quiet | tee "$out/e2e_${n}gpu.log" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    done
    [ "$nproc" = 1 ] && { cp "$out/e2e_1gpu/results.json" "$out/e2e_1gpu.json"; exit 0; }
    python3 benchmarks/scaling.py "$out/e2e_1gpu/results.json" "$out/e2e_${nproc}gpu/results.json" \
      --out "$out/e2e_scaling.json"
    exit $? ;;
  probe)  # train_step.py fixes its model: large Wukong at B = 8192, 40 sparse features of 100,000 rows
    env_txt
    timeout -k 10 "${STEP_TIMEOUT:-420}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
      --steps "${STEPS:-400}" --num-sparse 40 --cardinality 100000 --probe-every 100 --probe-steps "${PROBE_STEPS:-600}" \
      --compile --out "$out/probe_overhead_h200.json" "$@" 2>&1 | quiet | tee "$out/probe_overhead.log" | tail -30
    rc=${PIPESTATUS[0]}
    read -r -a tests <<< "${PROBE_TESTS-tests/test_probe_graphs.py tests/test_probe_compiled.py tests/test_probe_cheap.py tests/test_probe_robust.py}"
    if [ "${#tests[@]}" -gt 0 ]; then
      timeout -k 10 "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider "${tests[@]}" 2>&1 \
        | tail -20 | tee "$out/probe_tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    fi
    exit "$rc" ;;
  train-step)  # the step's phases and top ops, the probe at every=100, then each policy with all Mods
    env_txt
    mods=nobias,bn256,hswish
    timeout -k 10 "${STEP_TIMEOUT:-190}" python3 benchmarks/train_step.py --model wukong --preset large --batch 8192 \
      --steps "${STEPS:-200}" --num-sparse 40 --cardinality 100000 --probe-every 100 --out "$out/train_step.json" \
      --variant-steps "${VSTEPS:-40}" --variant "bf16 all mods|$mods|bf16" \
      --variant "torchao tensorwise|$mods|torchao:tensorwise" --variant "torchao rowwise|$mods|torchao:rowwise" \
      --variant "scaled_mm rowwise|$mods|uniform:e4m3.row.fa.torch_scaled_mm" \
      --variant "fbgemm rowwise|$mods|uniform:e4m3.row.fa.fbgemm" \
      --variant "triton rowwise|$mods|uniform:e4m3.row.fa.triton" \
      --variant "dispatch (modeled plan)|config|benchmarks/results/wukong_large_modeled_plan.json" "$@" 2>&1 \
      | quiet | tee "$out/train_step.log"
    exit "${PIPESTATUS[0]}" ;;
  kernels)  # the GPU backends' tests, then quantization bandwidth and the GEMM suite the cost model is fit on
    { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
      python3 -c "import torch,triton,torchao,fbgemm_gpu; print('torch',torch.__version__,'triton',triton.__version__,'torchao',torchao.__version__,'fbgemm',fbgemm_gpu.__version__)"
    } 2>&1 | tee "$out/run.log"
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
      timeout "${TEST_TIMEOUT:-200}" python3 -m pytest tests/test_gpu_backends.py -q -p no:cacheprovider \
        --junitxml="$out/pytest.xml" -rfE --tb=line 2>&1 | tail -n 150 | tee -a "$out/run.log"
    fi
    if [ "${SKIP_QUANT:-0}" != 1 ]; then
      timeout "${QUANT_TIMEOUT:-60}" python3 benchmarks/kernels_quant.py --out "$out" 2>&1 | tail -n 60 >> "$out/run.log"
    fi
    quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)
    rc=0
    if [ "${SKIP_SUITE:-0}" != 1 ]; then
      timeout "${SUITE_TIMEOUT:-300}" python3 benchmarks/gemm_suite.py run --out "$out" --cache /tmp/timing_cache.json \
        "${quick[@]}" "$@" > "$out/gemm_suite.stdout" 2>&1
      rc=$?
      echo "== suite rc=$rc =="; tail -n 25 "$out/gemm_suite.stdout"
    fi
    echo "== quant =="; cat "$out/kernels_quant.md" 2>/dev/null || tail -n 20 "$out/run.log"
    echo "== tests =="; grep -E "passed|failed" "$out/run.log" | tail -n 3
    exit "$rc" ;;
  linear-block)  # alone on the machine: small shapes are host-bound, other work would skew them
    env_txt
    timeout -k 10 $(( ${BLOCK_BUDGET:-290} + 50 )) python3 benchmarks/linear_block.py --out "$out/linear_block.json" \
      --budget "${BLOCK_BUDGET:-290}" "$@" 2>&1 | quiet | tee "$out/linear_block.log"
    exit "${PIPESTATUS[0]}" ;;
  tune)
    env_txt
    stamp() { python3 -u -c 'import sys, time
t0 = time.time()
for line in sys.stdin:
    sys.stdout.write(f"[{time.time() - t0:7.1f}s] {line}")'; }
    # SIGINT at the limit: tune stops cleanly (exit 130) and keeps what it finished
    timeout -s INT -k 20 "${STUDY_TIMEOUT:-420}" python3 -m loka_tune tune "$study" --device cuda \
      --n-trials "${N_TRIALS:-4}" "$@" 2>&1 | stamp | tee "$out/tune.log"
    echo "== tune exit ${PIPESTATUS[0]}"
    dir=$(python3 -c "import sys; from loka_tune.tuner.study import load_study; print(load_study(sys.argv[1]).output_dir)" "$study")
    cp "$dir/probe_report.json" "$out/probe_report.json" 2>/dev/null || echo "no $dir/probe_report.json"
    # the price cache after the study: the cells it timed itself (its Dispatch values), to be shipped
    cp "${LOKA_TUNE_CACHE_DIR:-$HOME/.cache/loka-tune}/site_prices.json" "$out/site_prices_after.json" 2>/dev/null
    timeout 60 python3 -m loka_tune report "$study" --no-plots > "$out/tune_report.txt" 2>&1
    tail -40 "$out/tune_report.txt"
    timeout 60 python3 -m loka_tune export "$study" --out "$out/tune_best.json" 2>&1 | tail -5
    [ -f "$out/tune_best.json" ]; exit $? ;;
  baselines)
    env_txt
    timeout -k 10 $(( ${BL_BUDGET:-240} + 90 )) python3 benchmarks/baseline_learning.py \
      --studies "${BASELINE_STUDIES:-studies/interformer_h200.toml}" \
      --variants study --budget-s "${BL_BUDGET:-240}" --out "$out/baseline_learning.json" "$@" 2>&1 \
      | tee "$out/baseline_learning.log" | tail -15
    exit "${PIPESTATUS[0]}" ;;
  prepare-ab)  # the arms in ARMS' order, each under AB_TIMEOUT
    env_txt
    rc=0
    prices=${LOKA_TUNE_CACHE_DIR:-$HOME/.cache/loka-tune}/site_prices.json
    for arm in ${ARMS:-beside sequential}; do
      case "$arm" in
        beside) flag=() ;;
        sequential) flag=(--sequential) ;;
        *) echo "ARMS has '$arm': each arm is beside or sequential (e.g. ARMS=\"beside sequential\")" >&2; exit 2 ;;
      esac
      cache=$(mktemp -d); mkdir -p "$cache/loka"
      [ -f "$prices" ] && cp "$prices" "$cache/loka/"
      echo "== $arm: prepare_profile.py --study $study ${flag[*]} (compile and price caches in $cache)"
      TORCHINDUCTOR_CACHE_DIR="$cache/inductor" TRITON_CACHE_DIR="$cache/triton" LOKA_TUNE_CACHE_DIR="$cache/loka" \
        timeout -k 10 "${AB_TIMEOUT:-170}" python3 benchmarks/prepare_profile.py --study "$study" --work "$cache/w" \
        --out "$out/prepare_$arm.txt" "${flag[@]}" "$@" > "$out/prepare_$arm.log" 2>&1
      r=$?; [ "$r" = 0 ] || rc=$r
      echo "== $arm exit $r"; grep -v "UserWarning\|warn_once\|^  " "$out/prepare_$arm.log" | tail -14
      head -1 "$out/prepare_$arm.txt" 2>/dev/null
      rm -rf "$cache"
    done
    exit "$rc" ;;
  gemm-autotune)  # inductor's Triton GEMM templates vs cuBLAS at the largest sites (a hint, not a result)
    env_txt
    timeout -k 10 $(( ${GA_BUDGET:-240} + 200 )) python3 benchmarks/gemm_autotune.py --budget "${GA_BUDGET:-240}" \
      --out "$out/gemm_autotune.json" "$@" 2>&1 | quiet | tee "$out/gemm_autotune.log" | tail -40
    exit "${PIPESTATUS[0]}" ;;
  first-compile)  # each run its own process and cold caches: nothing of another run or part is reused
    env_txt
    timeout -k 10 $(( ${FC_BUDGET:-240} + 170 )) python3 benchmarks/first_compile.py --study "$study" \
      --arms "${FC_ARMS:-plain,warm_pool,import_thread}" --reps "${FC_REPS:-2}" --budget "${FC_BUDGET:-240}" \
      --out "$out/first_compile.json" "$@" 2>&1 | quiet | tee "$out/first_compile.log" | tail -40
    exit "${PIPESTATUS[0]}" ;;
  train-export)  # an export trained as its study trained, beside the same model in plain bf16
    env_txt
    config=${CONFIG:-benchmarks/results/study_best_h200.json}
    bf16=$(mktemp --suffix .json)
    python3 - "$config" "$bf16" <<'PY' || exit 2
import json, sys
d = json.load(open(sys.argv[1]))
d["sites"] = {}
d["mods"] = {"no_bias": False, "keep_bias": [], "blocknorm": None, "hardswish": False, "pad": None}
json.dump(d, open(sys.argv[2], "w"))
PY
    # the study's schedule (an export of this version records it and `train --config` uses it; the
    # flags make an older export train the same way)
    sched=(--steps 200 --batch-size 8192 --lr-dense 1e-4 --lr-sparse 1e-2 --lr-warmup-steps 20)
    rc=0
    for v in config bf16; do
      c=$config; [ "$v" = bf16 ] && c=$bf16
      echo "== $v: loka-tune train --config $c --device cuda --compile ${sched[*]}"
      timeout 200 python3 -m loka_tune train --config "$c" --device cuda --compile "${sched[@]}" "$@" \
        --no-progress --json "$out/train_$v.json" 2>&1 | grep -v -i warning | tail -12
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
    python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {v: json.loads((out / f"train_{v}.json").read_text()) for v in ("config", "bf16") if (out / f"train_{v}.json").is_file()}
(out / "train_export.json").write_text(json.dumps(runs, indent=2) + "\n")
if len(runs) == 2:
    c, b = runs["config"], runs["bf16"]
    print(f"eval log loss {c['eval_logloss']:.5f} vs bf16 {b['eval_logloss']:.5f} "
          f"({100 * (c['eval_logloss'] / b['eval_logloss'] - 1):+.4f}%), NE {c['eval_ne']:.4f} / {b['eval_ne']:.4f}, "
          f"step {1e3 * c['step_time_s']:.3f} / {1e3 * b['step_time_s']:.3f} ms ({b['step_time_s'] / c['step_time_s']:.3f}x)")
PY
    exit "$rc" ;;
esac
# the parts below train at the study's batch (e2e.py must use it)
batch=${BATCH:-$(study_batch)}
receipt="study_$(basename "$study" .toml | sed 's/^[^_]*_//').json"  # study_h200.json, study_h200_b32768.json
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
    # SIGINT in time for what follows to run inside the call (a cut study keeps its finished trials)
    study_timeout=$(within_call "${STUDY_TIMEOUT:-470}" 100)
    echo "== study timeout ${study_timeout} s (${SECONDS} s into the call of ${CALL_LIMIT:-600})"
    timeout -s INT -k 45 "$study_timeout" python3 benchmarks/study_h200.py --study "$study" --work "$out/w" \
      --skip-e2e --out "$out/$receipt" "$@"
    echo "== study_h200 exit $?"; tail -45 "$out/w/study_h200.log"
    # cut after the search (the SIGINT landed in the export: the B = 32768 study of 2026-12-04):
    # its trials and confirmation are in the storage, and the export takes 2 s from there
    if [ ! -f "$out/w/best.json" ] && [ -f "$out/w/study/optuna.db" ]; then
      timeout 60 python3 -m loka_tune export "$study" --storage "sqlite:///$out/w/study/optuna.db" \
        --out "$out/w/best.json" 2>&1 | tail -3
    fi
    # the cache again: the cells the study timed itself (its Dispatch values) come back to be shipped
    cp "${LOKA_TUNE_CACHE_DIR:-$HOME/.cache/loka-tune}/site_prices.json" "$out/w/site_prices_after.json" 2>/dev/null
    cp "$out/w/study/optuna.db" "$out/w/optuna.db" 2>/dev/null
    timeout 60 python3 -m loka_tune report "$study" --storage "sqlite:///$out/w/study/optuna.db" --no-plots \
      --out-dir "$out/w/study" > "$out/study_report.txt" 2>&1; tail -30 "$out/study_report.txt"  # (its probe_report.json)
    rm -rf "$out/w/study" "$out/w/e2e" ;;
  study-e2e)
    mkdir -p "$out/w/study"; cp .carry/w/best.json .carry/w/tune_s.json "$out/w/" || exit 2
    cp .carry/w/optuna.db "$out/w/study/optuna.db" || exit 2
    python3 benchmarks/study_h200.py --study "$study" --work "$out/w" --skip-tune --out "$out/$receipt" "$@"
    rc=$?; cp "$out/w/e2e/results.json" "$out/e2e_results.json" 2>/dev/null; cp "$out/w/e2e/table.md" "$out/e2e_table.md"
    cat "$out/e2e_table.md"; cp "$out/w/study_h200.log" "$out/study_h200_e2e.log"; rm -rf "$out/w"; exit $rc ;;
  e2e)
    env_txt
    config=${CONFIG:-$(modeled_plan "$batch")} || exit 2
    variants=(); [ -n "${E2E_VARIANTS:-}" ] && variants=(--variants "$E2E_VARIANTS")
    infer=(); [ -n "${INFER_BATCHES-512,2048,8192}" ] \
      && infer=(--infer-batches "${INFER_BATCHES-512,2048,8192}" --infer-variants "${INFER_VARIANTS:-bf16_mods,config}")
    # E2E_KERNEL_SRC: inductor writes each kernel's bytes moved into its source (benchmark_kernel: code
    # for benchmarking each kernel alone is added beside it, the kernels are the same), into a cache
    # directory of this run's own (the bundle then holds this run's kernels only)
    if [ -n "${E2E_KERNEL_SRC:-}" ]; then
      export TORCHINDUCTOR_BENCHMARK_KERNEL=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}
    fi
    timeout -k 10 "${E2E_CAP:-560}" python3 benchmarks/e2e.py --study "$study" "${batch_arg[@]}" --seeds 0 --compile \
      --warmup "${E2E_WARMUP:-25}" --profile-steps 10 --steps "${E2E_STEPS:-80}" --config "$config" "${variants[@]}" \
      "${infer[@]}" --budget "${E2E_BUDGET:-470}" --out "$out/e2e" "$@" 2>&1 | quiet | tee "$out/e2e.log" | tail -40
    rc=${PIPESTATUS[0]}
    if [ -n "${E2E_KERNEL_SRC:-}" ]; then  # inductor's source of every FP8 cast and amax kernel it generated
      grep -rlE --include='*.py' 'def triton_(poi|red|per)_fused_[A-Za-z0-9_]*(_scaled_mm|abs[A-Za-z0-9_]*_a?max_)' \
        "${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_$(whoami)}" 2>/dev/null | tar czf "$out/cast_kernels.tgz" -T - \
        && echo "cast_kernels.tgz: $(tar tzf "$out/cast_kernels.tgz" | wc -l) generated file(s)"
      python3 benchmarks/cast_kernels.py "$out/e2e/results.json" --src "$out/cast_kernels.tgz" \
        --out "$out/cast_kernels.json" --md | tail -60
    fi
    exit "$rc" ;;
  *) echo "unknown part $part: one of $parts" >&2; exit 2 ;;
esac
