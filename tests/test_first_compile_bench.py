"""benchmarks/first_compile.py: the first compiled step of a study's bf16 baseline from fresh
processes on cold caches (issue 21's prepare_s). The GPU numbers are a receipt's; here, its
summary, its refusals and one real run on the CPU (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._bench import load_bench
from tests.tiny_measured import tiny_measured_study

fc = load_bench("first_compile.py")


def _row(arm: str, to_first: float, first: float, status: str = "ok") -> dict[str, object]:
    return {"arm": arm, "status": status, "to_first_step_s": to_first, "first_step_s": first, "build_s": 1.0}


def test_the_summary_takes_each_arms_median_and_what_it_saved_against_plain() -> None:
    """Per arm: the runs that finished, the medians, every first step; against ``plain`` the
    seconds saved to the first step's end (a failed run is not counted)."""
    rows = [_row("plain", 40.0, 29.0), _row("warm_pool", 31.0, 20.0), _row("plain", 30.0, 19.0),
            _row("warm_pool", 29.0, 18.0), _row("warm_pool", 99.0, 99.0, status="error")]
    s = fc._summary(rows, ["plain", "warm_pool", "import_thread"])
    assert s["plain"]["runs"] == 2 and s["plain"]["median_to_first_step_s"] == pytest.approx(35.0)
    assert s["warm_pool"]["runs"] == 2 and s["warm_pool"]["first_step_s"] == [20.0, 18.0]
    assert s["warm_pool"]["saved_vs_plain_s"] == pytest.approx(35.0 - 30.0)
    assert s["import_thread"] == {"runs": 0}


@pytest.mark.parametrize("args, says", [(["--arms", "plain,early"], "'early'"), (["--arms", ","], "none"),
                                        (["--steps", "1"], "at least 2")])
def test_bad_arguments_are_refused_with_the_value_and_the_choices(tmp_path: Path, args: list[str], says: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        fc.main([*args, "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert says in err and ("plain, warm_pool, import_thread" in err or "--steps" in err), err


@pytest.mark.slow
def test_one_cpu_run_compiles_in_its_own_process_on_cold_caches_and_says_where_the_time_went(
        tmp_path: Path) -> None:
    """A real run of the tiny study on the CPU: a child process compiles its bf16 model (its own
    empty inductor cache), and the receipt keeps the first step, the compile's split and the
    time to the first step's end, which holds the first step; the summary counts it."""
    study = tmp_path / "s.toml"
    study.write_text(tiny_measured_study("fc", training={"steps": 4}))
    out = tmp_path / "first_compile.json"
    assert fc.main(["--study", str(study), "--device", "cpu", "--arms", "plain", "--reps", "1",
                    "--steps", "2", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    (run,) = d["runs"]
    assert run["status"] == "ok" and run["error"] is None and run["arm"] == "plain"
    assert {"tracing", "forward", "backward"} <= set(run["compile_s"]), run["compile_s"]
    assert run["to_first_step_s"] >= run["first_step_s"] > 0 and run["process_s"] >= run["wall_s"]
    assert d["summary"]["plain"]["runs"] == 1 and d["meta"]["device"] == "cpu"
