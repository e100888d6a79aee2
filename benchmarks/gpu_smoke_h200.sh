#!/usr/bin/env bash
# The GPU smoke suite on one H200: the first thing every device call runs (issue 20).
# tests/test_gpu_smoke.py (every reference model x {bf16, bf16 + Mods, tensorwise FP8 on the
# torchao-filter sites, the Dispatch plan} compiled and trained, the probe's report, one
# `loka-tune tune` of studies/gpu_smoke.toml) and the GPU opcheck of the custom ops
# (tests/test_custom_ops.py), then any further tests given, all with `-m gpu`.
# Carry ".whl" (../shared/tools/fetch-gpu-wheels: torchao, fbgemm-gpu-genai, optuna, ...) and run
#   bash benchmarks/gpu_smoke_h200.sh "$OUT" [TEST_PATH_OR_NODE ...]
# from the repo root. Writes into $OUT: env.txt, gpu_smoke.log (pytest's output), gpu_smoke.xml
# (JUnit), gpu_smoke.jsonl (one JSON line per model variant, probe and study) and
# gpu_smoke_summary.txt (their table, also printed last). Exit status: pytest's.
# Settings (environment): SMOKE_WORKERS (8 pytest-xdist workers, 2 on a GPU under 100 GB; --dist worksteal: an idle worker
# takes queued tests from a busy one, the longest are first in the file; 0 runs serially),
# SMOKE_TIMEOUT (420 s for the whole run; the bar is 300), TEST_TIMEOUT (240 s per test, where
# pytest-timeout is installed: a hung test fails alone and the run still prints its tracebacks),
# LOKA_SMOKE_PRESET (large), IMPORT_PROFILE (1: import_profile.{json,txt} first, ~15 s; 0: not).
set -uo pipefail
out=${1:?usage: gpu_smoke_h200.sh OUT [TEST ...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH="$site:$PWD"
else
  echo "no .whl/ here: torchao-filter and study tests may skip or fail (run ../shared/tools/fetch-gpu-wheels, carry .whl)" >&2
  export PYTHONPATH="$PWD"
fi
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv,noheader || echo "no nvidia-smi"
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  python3 -c "import fbgemm_gpu; print('fbgemm_gpu', getattr(fbgemm_gpu, '__version__', '?'))" 2>&1 | tail -1
  python3 -c "import optuna; print('optuna', optuna.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/env.txt"
# where the compiler's import goes, in a fresh process on this (cold) machine: the study's probed
# baseline spends 6-10 s of its preparation importing dynamo and inductor (benchmarks/import_profile.py)
if [ "${IMPORT_PROFILE:-1}" != 0 ]; then
  timeout 120 python3 benchmarks/import_profile.py --out "$out/import_profile.json" 2>&1 | tee "$out/import_profile.txt"
fi

export LOKA_SMOKE_LOG="$out/gpu_smoke.jsonl"
: > "$LOKA_SMOKE_LOG"
args=(-v -m gpu -p no:cacheprovider -rfEs --tb=short --durations=30 --junitxml "$out/gpu_smoke.xml")
# 8 workers fit the H200's 139 GB; on an 80 GB H100 three large-model tests of 8 ran out of
# memory (2026-12-05), and two of 4 still did (third session); 2 ran 22 tests without one (fourth
# session): 2 workers there, 8 from 100 GB up
gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
default_workers=8; [ -n "$gpu_gb" ] && [ "${gpu_gb%%.*}" -lt 100000 ] 2>/dev/null && default_workers=2
workers=${SMOKE_WORKERS:-$default_workers}
if [ "$workers" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
  args+=(-n "$workers" --dist worksteal)
fi
if python3 -c "import pytest_timeout" 2>/dev/null; then
  args+=(--timeout "${TEST_TIMEOUT:-240}")
fi
t0=$(date +%s)
timeout -k 15 "${SMOKE_TIMEOUT:-420}" python3 -m pytest "${args[@]}" \
  tests/test_gpu_smoke.py tests/test_custom_ops.py "$@" 2>&1 | tee "$out/gpu_smoke.log"
rc=${PIPESTATUS[0]}
echo "== pytest exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$out/gpu_smoke.log"
python3 tests/gpu_smoke.py "$LOKA_SMOKE_LOG" 2>&1 | tee "$out/gpu_smoke_summary.txt"
exit "$rc"
