"""CI does what the README tells a newcomer: `.ci/run` runs the README's Install and Tests
commands, verbatim and in order, in a fresh virtual environment (a CI that installs otherwise
can stay green while a newcomer's install fails)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    """Shell lines without comments and blank lines."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def readme_commands(section: str) -> list[str]:
    """The commands of the first ```bash block of README section ``## <section>``."""
    readme = (REPO / "README.md").read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## )", readme, flags=re.S | re.M)
    assert m, f"README.md has no '## {section}' section"
    block = re.search(r"```bash\n(.*?)```", m.group(1), flags=re.S)
    assert block, f"README.md's '## {section}' has no bash block"
    return _commands(block.group(1))


def test_ci_runs_the_readme_install_and_test_commands_in_order() -> None:
    ci = _commands((REPO / ".ci" / "run").read_text())
    wanted = readme_commands("Install") + readme_commands("Tests")
    assert any(c.startswith("pip install torch") for c in wanted) and wanted[-1] == "python -m pytest -n auto"
    at = -1
    for cmd in wanted:
        assert cmd in ci, f"the README's `{cmd}` is not run by .ci/run"
        assert ci.index(cmd) > at, f"the README's `{cmd}` runs out of order in .ci/run"
        at = ci.index(cmd)
    # into a fresh virtual environment, created before the first install
    venv = next(i for i, c in enumerate(ci) if c.startswith("python3 -m venv "))
    assert venv < ci.index(wanted[0]) and any(c.startswith(". ") and "bin/activate" in c for c in ci[venv:])
    # the PostgreSQL tests run there: .ci/run gives them a server
    assert any("LOKA_TEST_POSTGRES_URL=" in c for c in ci[:ci.index("python -m pytest -n auto")])
