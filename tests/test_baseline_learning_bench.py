"""benchmarks/baseline_learning.py on the CPU: the bar's verdict, the variants' parsing, and one
end-to-end call of its code path on a tiny study (the GPU call runs the H200 studies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

REPO = Path(__file__).resolve().parents[1]


def _load():  # noqa: ANN202
    return load_bench('baseline_learning.py', 'baseline_learning_bench')


def _rows(ne: list[float | None], status: str = "ok", variant: str = "study") -> list[dict[str, Any]]:
    return [{"study": "s", "variant": variant, "seed": i, "status": status, "eval_ne": x} for i, x in enumerate(ne)]


@pytest.mark.parametrize("ne, passed", [
    ([0.95, 0.955], True),
    ([0.965, 0.9699], True),
    ([0.95, 0.971], False),  # a seed above 0.97
    ([0.951, 0.961], False),  # spread 0.01 is not < 0.01
    ([0.95], False),  # one seed cannot show a spread
])
def test_bar_verdict(ne: list[float], passed: bool) -> None:
    v = _load().bar_verdict(_rows(ne), "s")
    assert v["passed"] is passed, v
    assert "0.97" in v["reason"]


def test_bar_verdict_needs_every_seed_to_have_run() -> None:
    bench = _load()
    rows = _rows([0.95, None])
    rows[1].update(status="error", error="BackendCompilerFailed: fake kernel strides")
    v = bench.bar_verdict(rows, "s")
    assert not v["passed"] and "BackendCompilerFailed" in v["reason"]
    assert not bench.bar_verdict(_rows([0.9, 0.9], variant="old"), "s")["passed"]  # only "study" rows count
    assert not bench.bar_verdict([], "s")["passed"]


def test_parse_add() -> None:
    bench = _load()
    assert bench.parse_add("lr1e-4:lr_dense=1e-4,lr_warmup_steps=40") == ("lr1e-4", {"lr_dense": 1e-4,
                                                                                   "lr_warmup_steps": 40})
    for bad in ("nocolon", "x:momentum=0.9", "x:"):
        with pytest.raises(SystemExit):
            bench.parse_add(bad)


def test_one_call_on_a_tiny_study(tmp_path: Path) -> None:
    """The script's whole path on a CPU: the study's own baseline runs, each variant's rates in
    its rows, a study that cannot load recorded beside the other, and exit 1 when the bar is missed."""
    study = tmp_path / "tinystudy.toml"
    study.write_text('[study]\nname = "tinystudy"\n[model]\nname = "dlrm"\npreset = "tiny"\n'
                     '[data]\nsource = "synthetic"\n[data.params]\nnum_dense = 4\ncardinalities = [50, 20, 7]\n'
                     'eval_examples = 256\n[training]\nsteps = 6\nbatch_size = 32\nwindow = 3\nseeds = [0, 1]\n'
                     'lr_dense = 5e-3\nlr_warmup_steps = 4\ndevice = "cpu"\ncpu_threads = 1\n')
    out = tmp_path / "bl.json"
    code = _load().main(["--studies", f"{study},{tmp_path / 'missing.toml'}", "--device", "cpu",
                         "--add", "slow:lr_dense=1e-5", "--variants", "study,old,slow",
                         "--out", str(out)])
    d = json.loads(out.read_text())
    assert code == 1  # 6 steps of a tiny model do not reach NE 0.97, and one study is missing
    ok = [r for r in d["rows"] if r["study"] == "tinystudy"]
    assert [(r["variant"], r["seed"]) for r in ok] == [("study", 0), ("study", 1), ("old", 0), ("old", 1),
                                                        ("slow", 0), ("slow", 1)]
    assert all(r["status"] == "ok" and 0 < r["eval_ne"] < 2 and r["steps"] == 6 for r in ok)
    rates = {r["variant"]: (r["lr_dense"], r["lr_warmup_steps"]) for r in ok}
    assert rates == {"study": (5e-3, 4), "old": (1e-3, 0), "slow": (1e-5, 4)}
    assert ok[0]["eval_ne"] != ok[1]["eval_ne"]  # two seeds, two runs
    missing = [r for r in d["rows"] if r["study"] == "missing"]
    assert missing and all(r["status"] == "error" for r in missing)
    verdicts = {v["study"]: v["passed"] for v in d["verdicts"]}
    assert verdicts == {"tinystudy": False, "missing": False}


def test_noise_floors_pair_each_variant_with_the_study_budget() -> None:
    bench = _load()
    rows = [{"study": "s", "variant": "study", "seed": 0, "status": "ok"},
            {"study": "s", "variant": "study", "seed": 0, "twin": 1, "status": "ok", "rel_logloss_pct": 0.062},
            {"study": "s", "variant": "study", "seed": 0, "twin": 2, "status": "ok", "rel_logloss_pct": -0.965},
            {"study": "s", "variant": "lr", "seed": 0, "twin": 1, "status": "ok", "rel_logloss_pct": 0.26},
            {"study": "s", "variant": "lr", "seed": 1, "twin": 1, "status": "skipped", "error": "over --budget-s"}]
    floors = {f["variant"]: f for f in bench.noise_floors(rows, {"s": 0.5})}
    assert floors["study"]["floor_pct"] == 0.965 and not floors["study"]["below_budget"]  # |-0.965| > 0.5
    assert floors["study"]["twins_pct"] == {"0": [0.062, -0.965]}
    assert floors["lr"]["floor_pct"] is None and not floors["lr"]["below_budget"]  # a twin did not run
    assert "unknown" in bench.floor_line(floors["lr"]) and "0.965%" in bench.floor_line(floors["study"])
    rows[-1].update(status="ok", rel_logloss_pct=-0.13)
    lr = {f["variant"]: f for f in bench.noise_floors(rows, {"s": 0.5})}["lr"]
    assert lr["floor_pct"] == 0.26 and lr["below_budget"]
    assert bench.bar_verdict([*_rows([0.95, 0.955]), *rows[1:3]], "s")["passed"]  # twins are not baselines


def test_twins_on_a_tiny_study(tmp_path: Path) -> None:
    """--twins: each baseline row is followed by its twins, perturbed (another eval log loss),
    paired with it (rel_logloss_pct), and the floor decides the study variant's verdict."""
    study = tmp_path / "tinystudy.toml"
    study.write_text('[study]\nname = "tinystudy"\n[model]\nname = "dlrm"\npreset = "tiny"\n'
                     '[data]\nsource = "synthetic"\n[data.params]\nnum_dense = 4\ncardinalities = [50, 20, 7]\n'
                     'eval_examples = 256\n[training]\nsteps = 6\nbatch_size = 32\nwindow = 3\nseeds = [0]\n'
                     'lr_dense = 5e-3\ndevice = "cpu"\ncpu_threads = 1\n[objective]\nbudget_pct = 0.5\n')
    out = tmp_path / "bl.json"
    bench = _load()
    with pytest.raises(SystemExit):
        bench.main(["--studies", str(study), "--device", "cpu", "--twins", "-1", "--out", str(out)])
    bench.main(["--studies", str(study), "--device", "cpu", "--twins", "2", "--variants", "study",
                "--out", str(out)])
    d = json.loads(out.read_text())
    assert [(r["seed"], r.get("twin")) for r in d["rows"]] == [(0, None), (0, 1), (0, 2)]
    base, t1, t2 = d["rows"]
    assert all(r["status"] == "ok" for r in d["rows"])
    assert t1["eval_logloss"] != base["eval_logloss"] and t1["eval_logloss"] != t2["eval_logloss"]
    for t in (t1, t2):
        assert t["rel_logloss_pct"] == pytest.approx((t["eval_logloss"] - base["eval_logloss"])
                                                     / base["eval_logloss"] * 100)
    (floor,) = d["floors"]
    assert floor["floor_pct"] == pytest.approx(max(abs(t1["rel_logloss_pct"]), abs(t2["rel_logloss_pct"])))
    assert floor["budget_pct"] == 0.5 and d["meta"]["twins"] == 2
    (v,) = d["verdicts"]
    assert v["floor_pct"] == floor["floor_pct"] and "noise floor" in v["reason"]
