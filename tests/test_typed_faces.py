"""The public faces are typed for a user's type checker: ``loka_tune`` ships ``py.typed``, and
each lazily loaded name of a package face (``loka_tune``, ``loka_tune.tuner``, ``loka_tune.models``)
has an ``if TYPE_CHECKING:`` import of its real object, so mypy sees ``loka_tune.apply``'s signature
instead of ``Any``. (``loka_tune.kernels`` is not typed yet: ``kernels.linear`` does ``from
loka_tune.kernels import ops``, so its face's imports would close a cycle that
``test_no_import_cycle_at_module_level`` refuses.)"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

import loka_tune

REPO = Path(loka_tune.__file__).resolve().parents[1]
FACES = ["loka_tune", "loka_tune.tuner", "loka_tune.models"]


def test_py_typed_ships_with_the_package() -> None:
    assert (REPO / "loka_tune" / "py.typed").is_file()
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["loka_tune"]  # the wheel carries it


def _face(module: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``(_LAZY, TYPE_CHECKING imports as name -> module, names imported without the re-export
    ``as`` form)`` of a package face, read from its source."""
    tree = ast.parse((REPO / module.replace(".", "/") / "__init__.py").read_text())
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    bare: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            lazy = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.dump(imp)
                for alias in imp.names:
                    typed[alias.asname or alias.name] = imp.module
                    if alias.asname != alias.name:
                        bare.append(alias.name)
    return lazy, typed, bare


@pytest.mark.parametrize("module", FACES)
def test_every_lazy_name_has_its_type_checking_import(module: str) -> None:
    lazy, typed, bare = _face(module)
    assert lazy, f"{module} has no _LAZY table"
    assert typed == lazy  # same names, each from the module the lazy loader imports it from
    assert not bare, f"{module}: import these as `X as X` so a strict checker sees them re-exported: {bare}"


def test_mypy_reads_the_real_signatures(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "user_code.py"
    snippet.write_text(
        "import loka_tune\n"
        "import loka_tune.tuner\n"
        "reveal_type(loka_tune.apply)\n"
        "reveal_type(loka_tune.Probe)\n"
        "reveal_type(loka_tune.tuner.run_study)\n"
        "reveal_type(loka_tune.PrecisionConfig.from_recipe('rowwise'))\n"
        "loka_tune.apply(object(), 'best.json', serving='yes')\n"  # a wrong call mypy must refuse
    )
    config = tmp_path / "mypy.ini"  # a user's plain setup, reading this checkout's loka_tune
    config.write_text(f"[mypy]\nmypy_path = {REPO}\nfollow_imports = silent\n")
    stdout, stderr, _ = api.run([str(snippet), "--config-file", str(config),
                                 "--cache-dir", str(tmp_path / "cache"), "--no-error-summary"])
    lines = [ln for ln in stdout.splitlines() if ln.startswith(str(snippet))]
    revealed = [ln.split('Revealed type is "', 1)[1] for ln in lines if "Revealed type is" in ln]
    assert len(revealed) == 4, stdout + stderr
    apply_t, probe_t, run_study_t, recipe_t = revealed
    assert "Any" != apply_t and apply_t.startswith("def (model: torch.nn.modules.module.Module, config:")
    assert "loka_tune.config.PrecisionConfig" in apply_t and "serving: bool =" in apply_t
    assert apply_t.endswith('-> loka_tune.applying.ApplySummary"')
    assert probe_t.startswith("def (model: torch.nn.modules.module.Module, every: int =")
    assert probe_t.endswith('-> loka_tune.probe.collector.Probe"')
    assert run_study_t.startswith("def (cfg: loka_tune.tuner.study.StudyConfig, *,")
    assert recipe_t == 'loka_tune.config.PrecisionConfig"'
    errors = [ln for ln in lines if ": error:" in ln]
    assert len(errors) == 2, stdout  # the model is not an nn.Module; serving is not a bool
    assert any('Argument 1 to "apply"' in e and "Module" in e for e in errors)
    assert any('Argument "serving" to "apply"' in e and '"bool"' in e for e in errors)
