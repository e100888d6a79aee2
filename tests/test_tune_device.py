"""Trial models are built on the study's device before the config is applied (GPU-only kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loka_tune.config import PrecisionConfig, SitePrecision
from loka_tune.errors import UnsupportedChoiceError
from loka_tune.tuner import build, trial
from loka_tune.tuner.baseline import Baseline
from loka_tune.tuner.prepare import StudyContext
from loka_tune.tuner.study import load_study
from tests.test_tune import write_study


def _cfg_and_source(tmp_path: Path):  # noqa: ANN202
    cfg = load_study(write_study(tmp_path))
    return cfg, build.make_source(cfg)


def test_trial_model_on_the_cpu_refuses_a_gpu_only_choice(tmp_path: Path) -> None:
    cfg, src = _cfg_and_source(tmp_path)
    gpu_only = PrecisionConfig(default=SitePrecision.parse("e4m3.row.fa.torch_scaled_mm"))
    with pytest.raises(UnsupportedChoiceError):
        build.trial_model(cfg, src, gpu_only, device="cpu")  # what a GPU study would hit without the device
    model, summary = build.trial_model(cfg, src, PrecisionConfig(default=SitePrecision.parse("e4m3.row.emulated")))
    assert summary.replaced and all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("choice", ["e4m3.row.fa.torch_scaled_mm", "e4m3.row.fa.triton", "e4m3.row.fa.fbgemm"])
def test_trial_model_on_cuda_takes_gpu_kernels(tmp_path: Path, choice: str) -> None:
    from loka_tune.kernels.linear import find_linears

    cfg, src = _cfg_and_source(tmp_path)
    ok = [n for n, m in find_linears(build.make_model(cfg, src)).items()
          if m.in_features % 16 == 0 and m.out_features % 16 == 0]  # what the space would offer FP8
    assert ok
    config = PrecisionConfig(sites={n: SitePrecision.parse(choice) for n in ok})
    model, summary = build.trial_model(cfg, src, config, device="cuda")
    assert summary.replaced, summary  # at least one site runs the GPU kernel
    assert all(p.device.type == "cuda" for p in model.parameters())
    b = next(iter(src.batches("train", 64, seed=0, device="cuda")))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(b.dense, b.sparse)
    assert out.shape == (64,) and torch.isfinite(out).all()


class _Recorder(torch.nn.Module):
    """Records the dtype its linear computes in (what autocast makes of an fp32 input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[torch.dtype] = []

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        y = self.lin(dense)
        self.seen.append(y.dtype)
        return y.float().reshape(-1)


def test_measure_forward_seconds_times_under_the_training_autocast() -> None:
    # the inference objective's baseline and trials were timed without autocast (fp32 GEMMs on
    # a GPU against bf16-trained FP8 trials): the forward must run under the study's rule
    from types import SimpleNamespace

    from loka_tune.objectives.speed import measure_forward_seconds

    batch = SimpleNamespace(dense=torch.randn(8, 4), sparse=torch.zeros(8, 1, dtype=torch.long))
    m = _Recorder()
    assert measure_forward_seconds(m, batch, reps=2, warmup=0, autocast="bf16") > 0
    assert m.seen == [torch.bfloat16] * 2
    m.seen.clear()
    measure_forward_seconds(m, batch, reps=2, warmup=0)  # "auto" on the CPU: fp32, as the trainer
    assert m.seen == [torch.float32] * 2


def test_inference_objective_passes_the_study_autocast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, src = _cfg_and_source(tmp_path)
    from dataclasses import replace

    cfg = replace(cfg, objective=replace(cfg.objective, kind="inference", speed="measured"),
                  training=replace(cfg.training, trainer=replace(cfg.training.trainer, autocast="bf16")))
    seen: list[str] = []

    def fake(model, batch, **kw):  # noqa: ANN001, ANN003, ANN202
        seen.append(kw.get("autocast", "<default>"))
        return 1e-3

    monkeypatch.setattr(trial, "measure_forward_seconds", fake)
    bl = Baseline(seeds=(0,), eval_logloss=(0.5,), eval_ne=1.0, eval_auc=0.5, window_losses=(0.5,),
                       window_steps=(cfg.training.steps,), noise_floor_pct=0.0, step_time_s=1e-3,
                       speed_source="measured", measured_step_time_s=1e-3)
    ctx = StudyContext(cfg, None, src, bl, None, "cpu", "measured")
    out = trial.evaluate_config(ctx, PrecisionConfig())
    assert out.status == "ok", out
    assert seen == ["bf16"]
