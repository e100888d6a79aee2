"""Trial models are built on the study's device before the config is applied (GPU-only kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loka_tune.config import PrecisionConfig, SitePrecision
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.study import load_study
from tests.test_tune import write_study


def _cfg_and_source(tmp_path: Path):  # noqa: ANN202
    from loka_tune import tune

    cfg = load_study(write_study(tmp_path))
    return tune, cfg, tune.make_source(cfg)


def test_trial_model_on_the_cpu_refuses_a_gpu_only_choice(tmp_path: Path) -> None:
    tune, cfg, src = _cfg_and_source(tmp_path)
    gpu_only = PrecisionConfig(default=SitePrecision.parse("e4m3.row.fa.torch_scaled_mm"))
    with pytest.raises(UnsupportedChoiceError):
        tune.trial_model(cfg, src, gpu_only, device="cpu")  # what a GPU study would hit without the device
    model, summary = tune.trial_model(cfg, src, PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated")))
    assert summary.replaced and all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["e4m3.row.fa.torch_scaled_mm", "e4m3.row.fa.triton", "e4m3.row.fa.fbgemm"])
def test_trial_model_on_cuda_takes_gpu_kernels(tmp_path: Path, choice: str) -> None:
    from loka_tune.kernels.linear import find_linears

    tune, cfg, src = _cfg_and_source(tmp_path)
    ok = [n for n, m in find_linears(tune.make_model(cfg, src)).items()
          if m.in_features % 16 == 0 and m.out_features % 16 == 0]  # what the space would offer FP8
    assert ok
    config = PrecisionConfig(sites={n: SitePrecision.parse(choice) for n in ok})
    model, summary = tune.trial_model(cfg, src, config, device="cuda")
    assert summary.replaced, summary  # at least one site runs the GPU kernel
    assert all(p.device.type == "cuda" for p in model.parameters())
    b = next(iter(src.batches("train", 64, seed=0, device="cuda")))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(b.dense, b.sparse)
    assert out.shape == (64,) and torch.isfinite(out).all()
