"""benchmarks/import_profile.py: ``-X importtime`` read back, and summed by package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._bench import load_bench

ip = load_bench("import_profile.py")

SAMPLE = """\
import time: self [us] | cumulative | imported package
import time:       120 |        120 |   _io
import time:      2000 |       5000 |     torch._dynamo.utils
import time:      3000 |       3000 |       torch._dynamo.variables.base
import time:       500 |        500 |     sympy.core
import time:     10000 |      15500 |   torch._dynamo
some warning line that is not an import
"""


def test_parse_reads_every_import_line_and_nothing_else() -> None:
    rows = ip.parse_importtime(SAMPLE)
    assert rows == [("_io", 120, 120), ("torch._dynamo.utils", 2000, 5000),
                    ("torch._dynamo.variables.base", 3000, 3000), ("sympy.core", 500, 500),
                    ("torch._dynamo", 10000, 15500)]


def test_packages_add_own_time_two_levels_deep_largest_first() -> None:
    got = ip.by_package(ip.parse_importtime(SAMPLE))
    assert got == {"torch._dynamo": 0.015, "sympy.core": 0.0005, "_io": 0.00012}
    assert list(got) == ["torch._dynamo", "sympy.core", "_io"]
    assert ip.by_package(ip.parse_importtime(SAMPLE), depth=1) == {"torch": 0.015, "sympy": 0.0005, "_io": 0.00012}


@pytest.mark.slow
def test_a_real_child_profiles_the_compiler_import(tmp_path: Path) -> None:
    out = tmp_path / "ip.json"
    assert ip.main(["--out", str(out), "--top", "5"]) == 0
    r = json.loads(out.read_text())
    assert list(r["stages_s"]) == ["torch", "cuda_init", "dynamo", "inductor_compile_fx"]
    assert all(v >= 0 for v in r["stages_s"].values())
    assert r["modules"] > 100  # torch alone imports hundreds
    # the packages partition the modules: their sum is the whole own time
    assert sum(r["by_package_s"].values()) == pytest.approx(r["own_time_s"], abs=0.01)
    assert "torch._dynamo" in r["by_package_s"] and "torch._inductor" in r["by_package_s"]
