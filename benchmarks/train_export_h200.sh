#!/usr/bin/env bash
# The README's GPU walkthrough, last step: train the exported config of studies/wukong_h200.toml
# as the study trained (200 steps, batch 8192, Adam 1e-4 with a 20-step warm-up, compiled),
# beside the same model in plain bf16 (the config with its sites and Mods removed), on one H200.
# Carry ".whl" and run from the repo root:
#   bash benchmarks/train_export_h200.sh "$OUT" [CONFIG.json]   (default benchmarks/results/study_best_h200.json)
# Writes $OUT/train_export_h200.json ({"config": ..., "bf16": ...}: each `loka-tune train --json`).
set -uo pipefail
out=${1:?usage: train_export_h200.sh OUT [CONFIG.json]}
config=${2:-benchmarks/results/study_best_h200.json}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
  || { echo "installing the carried wheels failed" >&2; exit 2; }
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
bf16=$(mktemp --suffix .json)
python3 - "$config" "$bf16" <<'PY'
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
  timeout 200 python3 -m loka_tune train --config "$c" --device cuda --compile "${sched[@]}" \
    --no-progress --json "$out/train_$v.json" 2>&1 | grep -v -i warning | tail -12 || rc=1
done
python3 - "$out" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {v: json.loads((out / f"train_{v}.json").read_text()) for v in ("config", "bf16") if (out / f"train_{v}.json").is_file()}
(out / "train_export_h200.json").write_text(json.dumps(runs, indent=2) + "\n")
if len(runs) == 2:
    c, b = runs["config"], runs["bf16"]
    print(f"eval log loss {c['eval_logloss']:.5f} vs bf16 {b['eval_logloss']:.5f} "
          f"({100 * (c['eval_logloss'] / b['eval_logloss'] - 1):+.4f}%), NE {c['eval_ne']:.4f} / {b['eval_ne']:.4f}, "
          f"step {1e3 * c['step_time_s']:.3f} / {1e3 * b['step_time_s']:.3f} ms ({b['step_time_s'] / c['step_time_s']:.3f}x)")
PY
exit $rc
