#!/usr/bin/env bash
# One device call: GPU tests, quantization bandwidth, GEMM suite. Run from the repo root on
# the H200 (device tool) after installing the wheels (see ../shared/docs/gpu.md):
#   bash benchmarks/run_h200.sh "$OUT" [quick]
# Writes at most 8 files under OUT and prints the summary tables last.
set -o pipefail
out=${1:?usage: run_h200.sh OUT [quick]}
mode=${2:-full}
export PYTHONUNBUFFERED=1
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
q=""; [ "$mode" = quick ] && q="--quick"
[ "${SKIP_SUITE:-0}" = 1 ] || timeout "${SUITE_TIMEOUT:-300}" python3 benchmarks/gemm_suite.py run --out "$out" --cache /tmp/timing_cache.json $q \
  > "$out/gemm_suite.stdout" 2>&1
echo "== suite rc=$? =="; tail -n 25 "$out/gemm_suite.stdout"
echo "== quant =="; cat "$out/kernels_quant.md" 2>/dev/null || tail -n 20 "$out/run.log"
echo "== tests =="; grep -E "passed|failed" "$out/run.log" | tail -n 3
