"""The study schema is stated once: the section dataclasses' fields and their docs.

docs/study-schema.md, the README's table and `loka-tune tune --help-schema` are generated from
them (loka_tune.tuner.schema) and must be what the code generates now; every documented key is
one the parser accepts (and the other way round), at the default the parser uses; every key the
shipped study files and the README's examples use is documented.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from loka_tune.cli import main
from loka_tune.errors import ConfigError
from loka_tune.tuner import schema, study
from loka_tune.tuner.schema import REGENERATE, readme_table, schema_markdown, section_keys, tables, toml_literal

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"model": {"name": "dlrm"}, "data": {"source": "synthetic"}}


def _parse(doc: dict[str, dict[str, object]], tmp_path: Path) -> study.StudyConfig:
    """``doc`` read as the study file ``tmp_path/s.toml`` would be (its name: ``s``)."""
    return study.parse_study(doc, cwd=tmp_path, base_dir=tmp_path, source_path=tmp_path / "s.toml")


def _documented() -> dict[str, set[str]]:
    return {t: {k.name for k in section_keys(t)} for t in tables()}


def test_the_schema_doc_is_what_the_code_generates() -> None:
    doc = (REPO / schema.SCHEMA_DOC).read_text()
    assert doc == schema_markdown(), f"{schema.SCHEMA_DOC} is out of date: run `{REGENERATE}` and commit it"


def test_the_readme_table_is_what_the_code_generates() -> None:
    readme = (REPO / "README.md").read_text()
    assert readme.count(schema.README_BEGIN) == 1 and readme.count(schema.README_END) == 1
    block = readme.split(schema.README_BEGIN + "\n", 1)[1].split(schema.README_END, 1)[0]
    assert block == readme_table(), f"README.md's study-file table is out of date: run `{REGENERATE}`"
    assert schema.replace_readme_block(readme, readme_table()) == readme


def test_help_schema_prints_the_doc(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # like --help: no study file needed
        main(["tune", "--help-schema"])
    assert e.value.code in (0, None)
    assert capsys.readouterr().out == schema_markdown()


def test_check_flags_a_stale_doc(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text(f"# x\n\n{schema.README_BEGIN}\nold\n{schema.README_END}\nend\n")
    assert schema.main(["--check", "--root", str(tmp_path)]) == 1
    assert schema.main(["--write", "--root", str(tmp_path)]) == 0
    assert schema.main(["--check", "--root", str(tmp_path)]) == 0
    assert (tmp_path / schema.SCHEMA_DOC).read_text() == schema_markdown()
    assert (tmp_path / "README.md").read_text() == f"# x\n\n{schema.README_BEGIN}\n{readme_table()}{schema.README_END}\nend\n"


def test_the_tables_are_the_parsers() -> None:
    with pytest.raises(ConfigError) as e:
        study.parse_study({**MINIMAL, "nope": {}})
    listed = re.search(r"valid sections: ([^)]*)\)", str(e.value))
    assert listed is not None and listed.group(1).split(", ") == list(tables())


def test_every_field_has_a_doc() -> None:
    for table, cls in tables().items():
        assert (cls.__doc__ or "").strip(), f"[{table}] has no docstring"
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc", "").strip(), f"{cls.__name__}.{f.name} has no metadata doc"
        for k in section_keys(table):
            assert k.doc.strip() and k.type and k.default, k
            assert "None" not in k.type and "Mapping" not in k.type, k  # TOML's words, not Python's


def test_the_model_doc_names_every_built_in_model() -> None:
    # a fresh interpreter: other tests register models of their own
    code = "from loka_tune.models import model_names; print(' '.join(model_names()))"
    built_in = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    doc = next(k.doc for k in section_keys("model") if k.name == "name")
    assert re.findall(r'`"(\w+)"`', doc) == built_in  # "package.module:function" is no \w+


@pytest.mark.parametrize("table", list(tables()))
def test_documented_keys_are_the_keys_the_parser_accepts(table: str, tmp_path: Path) -> None:
    doc = {**MINIMAL, table: {**MINIMAL.get(table, {}), "zz_not_a_key": 1}}
    with pytest.raises(ConfigError) as e:
        _parse(doc, tmp_path)
    assert e.value.key == f"{table}.zz_not_a_key"
    listed = re.search(r"valid keys: ([^)]*)\)", str(e.value))
    assert listed is not None, str(e.value)
    assert set(listed.group(1).split(", ")) == _documented()[table]


def test_documented_defaults_are_the_parsers(tmp_path: Path) -> None:
    cfg = _parse(MINIMAL, tmp_path)
    checked = 0
    for table, cls in tables().items():
        worded = {f.name for f in dataclasses.fields(cls) if "default" in f.metadata}
        for k in section_keys(table):
            if k.name in worded:
                continue
            value = getattr(getattr(cfg, table), k.name)
            want = "unset" if value is None else f"`{toml_literal(value)}`"
            assert k.default == want, f"{table}.{k.name}: documented {k.default}, parsed {want}"
            checked += 1
    assert checked > 60


def test_required_tables_are_model_and_data(tmp_path: Path) -> None:
    for missing in MINIMAL:
        with pytest.raises(ConfigError) as e:
            _parse({t: v for t, v in MINIMAL.items() if t != missing}, tmp_path)
        assert e.value.key == missing
    assert _parse(MINIMAL, tmp_path).name == "s"  # the other tables have defaults
    assert "Every table but `[model]` and `[data]` is" in schema_markdown()


def _toml_examples() -> dict[str, dict[str, object]]:
    """Every study-shaped TOML the project ships: studies/*.toml, the README's toml blocks, the
    example in study.py's docstring."""
    out = {str(p.relative_to(REPO)): tomllib.loads(p.read_text()) for p in sorted((REPO / "studies").glob("*.toml"))}
    for i, block in enumerate(re.findall(r"```toml\n(.*?)```", (REPO / "README.md").read_text(), re.S)):
        out[f"README.md toml block {i}"] = tomllib.loads(block)
    example = (study.__doc__ or "").split("study file::", 1)[1]
    out["study.py docstring"] = tomllib.loads(re.sub(r"(?m)^    ", "", example))
    return out


def test_the_examples_use_documented_keys_only() -> None:
    examples = _toml_examples()
    assert len([n for n in examples if n.startswith("studies/")]) >= 5 and "README.md toml block 0" in examples
    documented = _documented()
    for name, doc in examples.items():
        for table, keys in doc.items():
            assert table in documented, f"{name}: [{table}] is not a documented table"
            assert isinstance(keys, dict)
            extra = set(keys) - documented[table]
            assert not extra, f"{name}: [{table}] uses undocumented keys {sorted(extra)}"


def test_the_docstring_example_is_a_valid_study(tmp_path: Path) -> None:
    doc = _toml_examples()["study.py docstring"]
    cfg = study.parse_study(doc, cwd=tmp_path)
    assert cfg.name == "quickstart" and cfg.trials.n_trials == 12 and cfg.objective.budget_pct == 1.0
