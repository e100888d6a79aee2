"""What a study costs beyond its results: mlflow is imported only when tracking is on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_tune import write_study

REPO = Path(__file__).resolve().parents[1]

_RUN = """
import sys
from loka_tune.cli import main
assert main(["tune", sys.argv[1], *sys.argv[2:]]) == 0
assert main(["report", sys.argv[1], "--no-plots"]) == 0
assert main(["export", sys.argv[1], "--out", sys.argv[1] + ".best.json"]) == 0
print("MLFLOW_IMPORTED" if "mlflow" in sys.modules else "MLFLOW_NOT_IMPORTED")
"""


def _imports_mlflow(study: Path, *extra: str) -> bool:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _RUN, str(study), *extra], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return "MLFLOW_IMPORTED" in r.stdout


@pytest.mark.slow
def test_mlflow_is_imported_only_when_tracking_is_on(tmp_path: Path) -> None:
    off = write_study(tmp_path, name="off", n_trials=1, tracking="false")
    assert not _imports_mlflow(off)
    on = write_study(tmp_path, name="on", n_trials=1, tracking="true")
    assert _imports_mlflow(on)  # and the check can tell: tracking on does import it
