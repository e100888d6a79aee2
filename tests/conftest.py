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
