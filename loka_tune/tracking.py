"""Compatibility: MLflow tracking now lives in :mod:`loka_tune.tuner.tracking` (kept for a release;
new code imports from there)."""

from __future__ import annotations

from loka_tune.tuner.tracking import (
    Tracker,
    pareto_front,
    plot_choice_map,
    plot_speed_vs_loss,
    retry,
    site_params,
    write_plots,
)

__all__ = ["Tracker", "retry", "write_plots", "plot_speed_vs_loss", "plot_choice_map", "pareto_front",
           "site_params"]
