"""strict_compile: compiled runs fail loudly instead of degrading silently (CPU, inductor)."""

from __future__ import annotations

import pytest
import torch

from loka_tune.objectives.compiled import CompileHealthError, strict_compile


def test_a_clean_compiled_run_reports_its_graphs() -> None:
    lin = torch.nn.Linear(8, 4)
    with strict_compile() as report:
        torch.compile(lin)(torch.randn(3, 8))
    assert report["unique_graphs"] == 1 and report["graph_breaks"] == 0 and report["frames_ok"] >= 1


def test_a_recompile_past_the_limit_raises_instead_of_running_eagerly() -> None:
    import torch._dynamo.config as dcfg

    lin = torch.nn.Linear(8, 4)
    # dynamo's own patch(), not monkeypatch: its settings are not in the module's __dict__, so
    # monkeypatch (pytest >= 9.2) deletes them when it undoes (see tests/conftest.py)
    with dcfg.patch(recompile_limit=1), pytest.raises(CompileHealthError, match="recompile limit"):
        with strict_compile():
            f = torch.compile(lin, dynamic=False)
            f(torch.randn(3, 8))
            with torch.no_grad():  # grad mode is part of the guards: a second graph is needed
                f(torch.randn(3, 8))
    assert dcfg.fail_on_recompile_limit_hit is False  # restored


def test_a_graph_break_fails_the_run() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        print("", end="")  # dynamo cannot trace it: the graph breaks here
        return x + 1

    with pytest.raises(CompileHealthError, match="graph break"):
        with strict_compile():
            torch.compile(f)(torch.randn(3))


def test_an_eager_run_under_a_compile_guard_fails() -> None:
    with pytest.raises(CompileHealthError, match="nothing was compiled"):
        with strict_compile():
            torch.nn.Linear(8, 4)(torch.randn(3, 8))


def test_too_many_graphs_fail_when_a_cap_is_given() -> None:
    lin = torch.nn.Linear(8, 4)
    with pytest.raises(CompileHealthError, match="more than the 1 expected"):
        with strict_compile(max_graphs=1):
            f = torch.compile(lin, dynamic=False)
            f(torch.randn(3, 8))
            f(torch.randn(5, 8))
