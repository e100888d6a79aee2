from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the repo; skips the test where it is absent (a fresh clone)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data samples not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch intra-op thread per test, restored after. Tiny CPU matmuls and models gain
    nothing from threads, and on a loaded 2-core machine OpenMP barriers stall badly and make
    wall times flaky; per test, so a test that changes the thread count cannot leak it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_TORCH_CONFIGS = ("torch._dynamo.config", "torch._inductor.config")


_GONE = object()


def _config_snapshot(keys: dict[str, dict[str, object]] | None = None) -> dict[str, dict[str, object]]:
    """Each loaded config's settings read as a user reads them (``getattr``: a deleted setting
    is hidden, not removed from the config's own listing); ``keys``: the settings to read."""
    import sys
    import warnings

    out = {}
    for name in _TORCH_CONFIGS:
        if name in sys.modules:
            mod = sys.modules[name]
            names = keys[name] if keys is not None and name in keys else mod.get_config_copy()
            with warnings.catch_warnings():  # reading a deprecated setting warns (once per process)
                warnings.simplefilter("ignore")
                out[name] = {k: getattr(mod, k, _GONE) for k in names}
    return out


@pytest.fixture(autouse=True)
def _torch_config_intact() -> Iterator[None]:
    """Fails the test that leaves torch's dynamo/inductor config changed: a setting deleted,
    or a value not restored. ``monkeypatch.setattr`` on these modules does that under
    pytest >= 9.2 (their settings are not in the module's ``__dict__``, so undoing deletes
    them, and every later ``torch.compile`` fails); use the config's own ``patch(...)``."""
    before = _config_snapshot()
    yield
    after = _config_snapshot(before)
    for name, was in before.items():
        now = after[name]
        changed = sorted(k for k in was if now[k] is not was[k] and now[k] != was[k])
        if changed:
            pytest.fail(f"{name} changed by this test: {changed[:8]}; patch it with "
                        f"`with {name}.patch(key=value):`, not monkeypatch.setattr", pytrace=False)

