"""Tuning your own model: the factory is called by its signature, its failures are one line,
and a ``module:function`` in the working directory imports (as ``python -m`` users expect)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from loka_tune.errors import ConfigError
from loka_tune.tuner.build import FACTORY_CONVENTION, make_model, make_source
from loka_tune.tuner.study import load_study

MODULE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, n_dense, cards, width=16):
        super().__init__()
        self.emb = nn.EmbeddingBag(sum(cards), 8, mode="sum")
        self.hidden = nn.Linear(n_dense + 8, width)
        self.out = nn.Linear(width, 1)

    def forward(self, dense, sparse):
        return self.out(torch.relu(self.hidden(torch.cat([dense, self.emb(sparse)], 1)))).squeeze(-1)


def by_other_names(n_dense, table_sizes, width=16):
    return Net(n_dense, table_sizes, width)


def by_kwargs(**kw):
    return Net(kw["num_dense"], kw["cardinalities"], kw.get("width", 16))


def raises(num_dense, cardinalities):
    raise ValueError("boom in my factory")


class OneInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x)


def one_input(num_dense, cardinalities):
    return OneInput()


def unknown_names(a, b):
    return OneInput()
'''

STUDY = """
[model]
name = "{fn}"
{overrides}
[data]
source = "synthetic"
[data.params]
num_dense = 5
cardinalities = [30, 20, 10]
[training]
steps = 4
window = 2
seeds = [0]
device = "cpu"
[probe]
every = 2
[trials]
n_trials = 1
"""


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the user's module (a fresh name per test), the working directory, not on sys.path."""
    name = f"usernet_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def _study(d: Path, fn: str, overrides: str = "") -> Path:
    module = next(d.glob("usernet_*.py")).stem
    p = d / "mine.toml"
    p.write_text(STUDY.format(fn=f"{module}:{fn}", overrides=overrides))
    return p


@pytest.mark.parametrize("fn", ["by_other_names", "by_kwargs"])
def test_factory_called_by_its_parameter_names(user_dir: Path, fn: str) -> None:
    cfg = load_study(_study(user_dir, fn, "[model.overrides]\nwidth = 24"), cwd=user_dir)
    source = make_source(cfg)
    model = make_model(cfg, source)  # imports from the working directory, not on sys.path
    assert model.hidden.in_features == 5 + 8 and model.hidden.out_features == 24
    assert model.emb.num_embeddings == 60
    assert str(user_dir) in sys.path


def test_unknown_override_names_the_key(user_dir: Path) -> None:
    cfg = load_study(_study(user_dir, "by_other_names", "[model.overrides]\ndepth = 3"), cwd=user_dir)
    with pytest.raises(ConfigError) as ei:
        make_model(cfg, make_source(cfg))
    assert ei.value.key == "model.overrides.depth" and "'depth'" in str(ei.value)


@pytest.mark.parametrize("fn,needle", [
    ("raises", "raised ValueError: boom in my factory"),
    ("one_input", "forward(x) does not take (dense, sparse)"),
    ("unknown_names", "(a, b) takes no num_dense parameter"),
    ("nosuch", "has no function 'nosuch'"),
])
def test_tune_stops_at_once_with_one_line(user_dir: Path, capsys: pytest.CaptureFixture[str], fn: str,
                                          needle: str) -> None:
    from loka_tune.cli import main

    study = _study(user_dir, fn)
    assert main(["tune", str(study), "--no-tracking"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"loka-tune tune: error: {study}: model.name: ") and needle in err
    if fn != "nosuch":
        assert FACTORY_CONVENTION in err


def test_the_readme_example_is_a_working_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README "Tune your own model": its mymodel.py and mymodel.toml, saved in one folder, load,
    build (from the working directory) and run a forward pass; the model's linears are swapped."""
    import re

    from loka_tune.applier import apply
    from loka_tune.config import PrecisionConfig

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Tune your own model"):]
    blocks = dict(re.findall(r"```(?:python|toml)\n# (mymodel\.\w+)\n(.*?)```", section, flags=re.S))
    assert set(blocks) == {"mymodel.py", "mymodel.toml"}
    module = f"mymodel_{tmp_path.name.replace('-', '_')}"  # a fresh module name per run
    (tmp_path / f"{module}.py").write_text(blocks["mymodel.py"])
    (tmp_path / "mymodel.toml").write_text(blocks["mymodel.toml"].replace('"mymodel:build"', f'"{module}:build"'))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cfg = load_study(tmp_path / "mymodel.toml")
    source = make_source(cfg)
    model = make_model(cfg, source)
    assert model.out.in_features == 512  # the override reached build()
    batch = next(iter(source.batches("train", 8, seed=0)))
    assert model(batch.dense, batch.sparse).shape == (8,)
    s = apply(model, PrecisionConfig.from_sites({"mlp.2": "e4m3.row.emulated"}))
    assert list(s.replaced) == ["mlp.2"]
    assert model(batch.dense, batch.sparse).shape == (8,)
