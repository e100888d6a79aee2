"""The lazy package faces (loka_tune, loka_tune.kernels, loka_tune.models) share one helper."""

from __future__ import annotations

import subprocess
import sys

import pytest

import loka_tune
import loka_tune.kernels
import loka_tune.models


@pytest.mark.parametrize("pkg", [loka_tune, loka_tune.kernels, loka_tune.models], ids=lambda m: m.__name__)
def test_lazy_faces_load_cache_and_refuse_unknown_names(pkg) -> None:  # type: ignore[no-untyped-def]
    lazy = pkg._LAZY
    assert set(lazy) <= set(dir(pkg)) and set(lazy) <= set(pkg.__all__)
    name, module = next(iter(lazy.items()))
    value = getattr(pkg, name)
    assert value is getattr(sys.modules[module], name) and vars(pkg)[name] is value  # cached
    with pytest.raises(AttributeError, match=f"module '{pkg.__name__}' has no attribute 'no_such_name'"):
        pkg.no_such_name


def test_a_lazy_name_loads_only_its_module() -> None:
    code = (
        "import sys, loka_tune; assert 'loka_tune.applier' not in sys.modules;"
        "loka_tune.load_config; assert 'loka_tune.applier' in sys.modules;"
        "assert 'loka_tune.kernels.linear' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
